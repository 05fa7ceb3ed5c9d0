"""The controller's elastic side (``ScalingConfig(num_workers=(min, max))``): after a lost worker,
resize the group in place instead of restarting it, and grow it back to ``max`` when capacity
returns. Mixed into :class:`ringtrain.controller.controller.Controller`, whose state it shares;
the protocol is in docs/elastic.md and :mod:`ringtrain.elastic.worker`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.channel import Event, Exited, GrowRequest, JoinReady, Resize, Resumed, WorkerError
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.controller.attempt import (
    HELLO_TIMEOUT_S,
    Attempt,
    Grow,
    root_cause,
    signal_name,
)
from ringtrain.controller.policy import Decision, FailurePolicy
from ringtrain.elastic.policy import ElasticAction, ElasticDecision, ElasticPolicy
from ringtrain.launch.base import Launcher, WorkerGroup
from ringtrain.monitor.progress import ProgressReporter
from ringtrain.monitor.straggler import StragglerDetector
from ringtrain.result import WorkerFailure
from ringtrain.rundir import RunDirectory

logger = logging.getLogger("ringtrain")


class ElasticControl:
    """Resizing and growing back, as methods of the controller (the attributes below are the
    controller's; :class:`~ringtrain.controller.controller.Controller` sets them)."""

    launcher: Launcher
    group: WorkerGroup | None
    run_dir: RunDirectory
    checkpoints: CheckpointManager
    failure_policy: FailurePolicy
    progress: ProgressReporter
    stragglers: StragglerDetector | None
    elastic: ElasticPolicy | None
    failures: list[WorkerFailure]
    world_size: int
    next_round: int
    worker_timeout_s: float | None
    generation: int
    _attempt: Attempt | None
    _grow: Grow | None
    _grow_failures: int
    _grow_idle_since: float | None

    # The controller's methods this side calls.
    _on_failure: Callable[[Attempt, WorkerFailure], None]
    _callback: Callable[..., None]

    def _elastic(self, attempt: Attempt) -> ElasticAction:
        """After a failure in an elastic run: wait for the survivors, resize in place, or give
        up (the usual restart from the disk checkpoint follows)."""
        assert self.elastic is not None and attempt.first_failure_at is not None
        finished = attempt.done | {r for r, code in attempt.exited.items() if code == 0}
        decision = self.elastic.decide(
            attempt.world_size,
            attempt.failures,
            attempt.interrupted,
            finished,
            time.monotonic() - attempt.first_failure_at,
        )
        if decision.action is ElasticAction.RESIZE:
            failure = root_cause(list(attempt.failures.values()))
            verdict = self.failure_policy.decide(failure, len(self.failures) + 1)
            if verdict.decision is Decision.RAISE:
                decision = ElasticDecision(ElasticAction.FALLBACK, verdict.reason)
            elif not callable(getattr(self.group, "resize", None)):
                decision = ElasticDecision(
                    ElasticAction.FALLBACK,
                    "not resizing in place: this launcher cannot resize a worker group",
                )
            else:
                try:
                    self._resize(attempt, decision, failure)
                    return ElasticAction.RESIZE
                except OSError as exc:
                    decision = ElasticDecision(
                        ElasticAction.FALLBACK, f"resize in place failed ({exc})"
                    )
        if decision.action is ElasticAction.FALLBACK:
            attempt.elastic_fallback = True
            message = f"{decision.reason}; restarting the group from the disk checkpoint"
            logger.warning(message)
            self.progress.message(message)
            self.run_dir.event("resize_fallback", reason=decision.reason)
        return decision.action

    def _resize(self, attempt: Attempt, decision: ElasticDecision, failure: WorkerFailure) -> None:
        """Turn the survivors into the next generation of the group, ranks renumbered in order,
        without restarting a process."""
        assert self.group is not None and decision.snapshot_step is not None
        self.failures.append(failure)
        self._callback("on_failure", failure)
        self.generation += 1
        old_world, new_world = attempt.world_size, len(decision.survivors)
        # Rounds some rank never reported are gone; a round whose files the lost rank owed can
        # never be published: drop its staging directory (survivors finished their writes
        # before saying Interrupted).
        for round_ in sorted(set(attempt.writing) | set(attempt.pending)):
            self.checkpoints.discard_staging(round_)
        start_round = self.next_round
        assignment, orders = self._resize_orders(
            attempt, decision.survivors, decision.source, start_round, decision.snapshot_step
        )
        reached = [i.step for i in attempt.interrupted.values() if i.step is not None]
        reached += [s for s in attempt.last_step.values() if s is not None]
        rolled_back = max(0, max(reached, default=decision.snapshot_step) - decision.snapshot_step)
        info = {
            "old_world_size": old_world,
            "new_world_size": new_world,
            "cause": failure.message,
            "generation": self.generation,
            "snapshot_step": decision.snapshot_step,
            "steps_rolled_back": rolled_back,
            "failure_time": failure.time,
        }
        self._next_generation(attempt, new_world, info)
        if self._grow is not None:  # workers waiting to join a group that just lost one
            self._grow_failed(self._grow, f"a member was lost ({failure.message})", backoff=False)
        self.group.resize(assignment, orders)  # type: ignore[attr-defined]
        message = (
            f"{decision.reason}: {failure.message}; rolling back to the snapshot of step "
            f"{decision.snapshot_step} ({rolled_back} steps); failure {len(self.failures)}"
        )
        logger.warning(message)
        self.progress.message(message)
        for rank in range(new_world, old_world):
            self.progress.worker_state(rank, "stopped")
        for rank in range(new_world):
            self.progress.worker_state(rank, "running")

    def _reset_stragglers(self) -> None:
        """A new group (restart or resize): clear every straggler flag, since ranks are
        renumbered and their timing windows describe the old group."""
        if self.stragglers is not None:
            for rank in sorted(self.stragglers.flagged):
                self.progress.straggler(rank, False)
            self.stragglers.reset()

    def _next_generation(self, attempt: Attempt, new_world: int, info: dict[str, Any]) -> Attempt:
        """Make the resized group of ``new_world`` workers the current attempt (same attempt
        number; ``info`` is its pending ``resize`` event)."""
        new = Attempt(attempt.number, new_world)
        new.resize = info
        self._attempt = new
        self.world_size = new_world
        self._reset_stragglers()
        return new

    def _resize_orders(
        self,
        attempt: Attempt,
        order: Sequence[int],
        source: int | None,
        start_round: int,
        snapshot_step: int,
    ) -> tuple[dict[int, int], dict[int, Resize]]:
        """The next generation's membership: old rank -> new rank (``order`` lists the old
        ranks in new-rank order) and the :class:`Resize` each member is sent."""
        assignment = {old: new for new, old in enumerate(order)}
        orders = {
            old: Resize(
                generation=self.generation,
                world_size=len(order),
                rank=new,
                store_prefix=f"ringtrain/elastic/{attempt.number}/{self.generation}/",
                source_rank=source,
                start_round=start_round,
                snapshot_step=snapshot_step,
            )
            for old, new in assignment.items()
        }
        return assignment, orders

    def _on_resumed(self, attempt: Attempt, event: Resumed) -> None:
        if attempt.resize is None:
            return
        info, attempt.resize = attempt.resize, None
        resume_s = max(0.0, event.time - info["failure_time"])
        pause_time = info.pop("pause_time", None)
        extra = {} if pause_time is None else {"paused_s": max(0.0, event.time - pause_time)}
        self.run_dir.event("resize", **info, resume_s=resume_s, **extra)
        grew = info["new_world_size"] > info["old_world_size"]
        if grew:
            self._grow_failures = 0
        # Below max: the next try to grow back is measured from here.
        self._grow_idle_since = time.monotonic()
        since = "capacity returned" if grew or pause_time is not None else "the failure"
        text = (
            f"resized {info['old_world_size']} -> {info['new_world_size']} workers; training "
            f"resumed {resume_s:.2f} s after {since}, at step {event.step}"
        )
        if "paused_s" in extra:
            text += f" (paused {extra['paused_s']:.2f} s)"
        logger.info(text)
        self.progress.message(text)

    # ------------------------------------------------------------------ elastic: growing back
    def _grow_tick(self, attempt: Attempt) -> bool:
        """Drive a grow back to ``max`` one poll at a time (no failure is in progress): start
        workers to join once ``elastic_grow_after_s`` has passed below ``max``; when all of them
        is ready (JoinReady), ask the members to pause at their next step boundary; when all members
        paused, make one group of members and joiners. Returns whether a new generation was
        formed (``self._attempt`` replaced)."""
        assert self.elastic is not None and self.group is not None
        grow = self._grow
        paused = [
            r
            for r in range(attempt.world_size)
            if r in attempt.interrupted and attempt.interrupted[r].grow
        ]
        if grow is None:
            if paused:  # a stale request paused the members: re-form them as they were
                if len(paused) == attempt.world_size:
                    self._grow_resize(attempt, [], None, "re-formed after a cancelled grow")
                    return True
                return False
            return self._grow_start(attempt)
        if grow.dead and not grow.requested:
            self._grow_failed(grow, "; ".join(grow.dead[r] for r in sorted(grow.dead)))
            return False
        if not grow.requested:
            if set(grow.ranks) <= grow.ready:
                grow.requested = True
                for rank in range(attempt.world_size):
                    try:
                        self.group.send(rank, GrowRequest(self.generation))  # type: ignore[attr-defined]
                    except OSError:
                        pass  # that member is gone: its failure follows and cancels the grow
            elif time.monotonic() - grow.started_at > max(
                HELLO_TIMEOUT_S, self.worker_timeout_s or 0
            ):
                waiting = sorted(set(grow.ranks) - grow.ready)
                self._grow_failed(grow, f"ranks {waiting} did not get ready to join in time")
            return False
        if len(paused) < attempt.world_size:
            return False
        joiners = [r for r in grow.ranks if r not in grow.dead]
        why = "; ".join(grow.dead[r] for r in sorted(grow.dead))
        if grow.dead:
            self._grow_failed(grow, why, discard=sorted(grow.dead))
        self._grow_resize(
            attempt,
            joiners,
            grow,
            "capacity returned"
            if joiners
            else f"re-formed after the joining workers failed ({why})",
        )
        return True

    def _grow_start(self, attempt: Attempt) -> bool:
        assert self.elastic is not None and self.group is not None
        if (
            self._grow_idle_since is None
            or attempt.resize is not None  # the last resize has not resumed yet
            or attempt.done
            or attempt.exited
            or not callable(getattr(self.group, "grow", None))
        ):
            return False
        ranks = self.elastic.grow_ranks(
            attempt.world_size, time.monotonic() - self._grow_idle_since, self._grow_failures
        )
        if not ranks:
            return False
        try:
            started = list(self.group.grow(ranks))  # type: ignore[attr-defined]
        except (OSError, RuntimeError, ValueError) as exc:
            self._grow_failed(Grow(ranks), f"could not start workers: {exc}", discard=[])
            return False
        if not started:  # no capacity now: look again after elastic_grow_after_s
            self._grow_idle_since = time.monotonic()
            return False
        self._grow = Grow(started)
        message = (
            f"growing back: starting {len(started)} worker(s) (ranks {started}) to grow "
            f"{attempt.world_size} -> {attempt.world_size + len(started)}; the members pause at "
            "their next step boundary once the new workers are up"
        )
        logger.info(message)
        self.progress.message(message)
        self.run_dir.event(
            "grow_start",
            old_world_size=attempt.world_size,
            ranks=started,
            generation=self.generation,
        )
        return False

    def _on_joiner_event(self, grow: Grow, event: Event) -> None:
        rank = getattr(event, "rank", -1)
        if isinstance(event, JoinReady):
            grow.ready.add(rank)
        elif isinstance(event, WorkerError):
            grow.dead.setdefault(
                rank, f"joining rank {rank} raised {event.exc_type}: {event.message}"
            )
        elif isinstance(event, Exited):
            how = (
                f"was killed by {signal_name(-event.returncode)}"
                if event.returncode < 0
                else f"exited with status {event.returncode}"
            )
            grow.dead.setdefault(rank, f"joining rank {rank} {how}")

    def _grow_failed(
        self, grow: Grow, reason: str, *, backoff: bool = True, discard: list[int] | None = None
    ) -> None:
        """Give up on ``grow`` (or on its ``discard`` ranks only): stop its workers, log why,
        and try again after ``elastic_grow_after_s`` (doubled per consecutive failure when
        ``backoff``)."""
        assert self.elastic is not None
        ranks = grow.ranks if discard is None else discard
        if ranks and callable(getattr(self.group, "discard", None)):
            self.group.discard(ranks)  # type: ignore[union-attr]
        if discard is None:
            self._grow = None
        if backoff:
            self._grow_failures += 1
        self._grow_idle_since = time.monotonic()
        delay = self.elastic.grow_delay_s(self._grow_failures)
        message = f"growing back failed: {reason}; trying again in {delay:g} s"
        logger.warning(message)
        self.progress.message(message)
        self.run_dir.event("grow_failed", reason=reason, ranks=ranks, retry_s=delay)

    def _grow_resize(
        self, attempt: Attempt, joiners: list[int], grow: Grow | None, cause: str
    ) -> None:
        """Make the paused members (ranks kept) and ``joiners`` (numbered after them) the next
        generation: each member is sent a Resize, the joiners get the newest snapshot by
        broadcast from a member."""
        assert self.group is not None
        old_world = attempt.world_size
        members = list(range(old_world))
        steps = {r: attempt.interrupted[r].snapshot_step for r in members}
        held = [s for s in steps.values() if s is not None]
        newest = max(held) if held else None
        source = None
        if newest is not None and (joiners or len(set(steps.values())) > 1):
            source = min(r for r in members if steps[r] == newest)
        self.generation += 1
        for round_ in sorted(set(attempt.writing) | set(attempt.pending)):
            self.checkpoints.discard_staging(round_)
        order = members + joiners
        new_world = len(order)
        assignment, orders = self._resize_orders(
            attempt, order, source, self.next_round, newest if newest is not None else -1
        )
        reached = [i.step for i in attempt.interrupted.values() if i.step is not None]
        rolled_back = max(0, max(reached, default=newest or 0) - (newest or 0))
        pauses = [attempt.interrupted[r].time for r in members if attempt.interrupted[r].grow]
        info = {
            "old_world_size": old_world,
            "new_world_size": new_world,
            "cause": cause,
            "generation": self.generation,
            "snapshot_step": newest,
            "steps_rolled_back": rolled_back,
            "failure_time": grow.capacity_time if grow is not None else time.time(),
            "pause_time": min(pauses, default=time.time()),
        }
        new = self._next_generation(attempt, new_world, info)
        self._grow = None
        try:
            self.group.resize(assignment, orders)  # type: ignore[attr-defined]
        except OSError as exc:  # a connection went away just now: restart from disk
            reason = f"growing back failed while re-forming the group ({exc})"
            new.elastic_fallback = True
            self._on_failure(
                new,
                WorkerFailure(
                    rank=0, kind="exit", message=reason, attempt=attempt.number, time=time.time()
                ),
            )
            self.run_dir.event("resize_fallback", reason=reason)
            return
        message = (
            f"{'growing back' if new_world > old_world else 'resizing'} in place: {old_world} -> "
            f"{new_world} workers ({cause}); joining at the snapshot of step {newest}"
        )
        logger.info(message)
        self.progress.message(message)
        for rank in range(new_world):
            self.progress.worker_state(rank, "running")
