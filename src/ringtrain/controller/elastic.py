"""The controller's elastic side (``ScalingConfig(num_workers=(min, max))``): after a lost worker,
resize the group in place instead of restarting it (the ``Resizing`` state), and grow it back to
``max`` when capacity returns (the ``Growing`` state). A collaborator of
:class:`ringtrain.controller.controller.Controller`: its handlers of those two states call it; it
returns the next :class:`~ringtrain.controller.generation.Generation` instead of changing the
controller's state. The protocol is in docs/elastic.md and :mod:`ringtrain.elastic.worker`.

A preemption notice that covers only some ranks makes them *leave* in place when ``min_workers``
still holds without them: the coordinator's ``leaving``
(:class:`~ringtrain.controller.leaving.Leaving`, whose ``refusal`` and ``start`` the controller
calls) pauses the members as for a grow, and
:meth:`grow_resize` re-forms the group from the others."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ringtrain.controller.attempt import root_cause, signal_name
from ringtrain.controller.generation import Generation, Grow
from ringtrain.controller.health import HELLO_TIMEOUT_S
from ringtrain.controller.leaving import Leaving
from ringtrain.controller.policy import Decision
from ringtrain.elastic.policy import ElasticAction, ElasticDecision, ElasticPolicy
from ringtrain.launch.base import GrowableGroup
from ringtrain.result import WorkerFailure
from ringtrain.rundir.schema import (
    GrowFailedEvent,
    GrowStartEvent,
    ResizeEvent,
    ResizeFallbackEvent,
)
from ringtrain.wire.channel import (
    Event,
    Exited,
    GrowRequest,
    JoinReady,
    Resize,
    Resumed,
    WorkerError,
)

if TYPE_CHECKING:
    from ringtrain.controller.controller import Controller

logger = logging.getLogger("ringtrain")


class ElasticCoordinator:
    """Resizing in place and growing back for one controller.

    Args:
        ctl: the controller whose group, run directory, checkpoints, progress display, failure
            policy and failure list this uses.
        policy: the resize-in-place decisions (``None``: not an elastic run; only
            ``generation`` is used).

    ``generation`` is the rendezvous generation of the worker group (0 for fresh processes, +1
    per resize); ``grow`` the grow in progress; ``grow_failures`` the consecutive failed grows;
    ``grow_idle_since`` since when (monotonic) the group has been below max without trying
    (None: it is not); ``leaving`` the ranks of a partial preemption notice leaving in place.
    """

    def __init__(self, ctl: Controller, policy: ElasticPolicy | None) -> None:
        self.ctl = ctl
        self.policy = policy
        self.generation = 0
        self.grow: Grow | None = None
        self.grow_failures = 0
        self.grow_idle_since: float | None = None
        self.leaving = Leaving(self)

    def reset(self) -> None:
        """A fresh worker group (a start or restart) has ``max`` workers at generation 0."""
        self.generation = 0
        self.grow, self.grow_idle_since = None, None
        self.grow_failures = 0
        self.leaving.notice = None
        spec = getattr(self.ctl.group, "spec", None)  # the launchers' groups keep theirs
        mesh = getattr(getattr(spec, "config", None), "mesh", None)
        if self.policy is not None and mesh is not None:
            self.policy.use_mesh(mesh.dp_shard)  # a lost rank's replica group leaves with it

    def growable(self) -> GrowableGroup | None:
        """The worker group, when its launcher can resize and grow it in place (it implements
        :class:`~ringtrain.launch.base.GrowableGroup`); None otherwise."""
        group = self.ctl.group
        return group if isinstance(group, GrowableGroup) else None

    # ------------------------------------------------------------------ resizing
    def after_failure(self, gen: Generation) -> tuple[ElasticDecision, Generation]:
        """After a failure: wait for the survivors (WAIT), resize in place (RESIZE: the new
        generation is returned) or give up (FALLBACK: the usual restart from the disk
        checkpoint follows; ``gen.elastic_fallback`` is set)."""
        assert self.policy is not None and gen.first_failure_at is not None
        finished = gen.done | {r for r, code in gen.exited.items() if code == 0}
        decision = self.policy.decide(
            gen.world_size,
            gen.failures,
            gen.interrupted,
            finished,
            time.monotonic() - gen.first_failure_at,
        )
        if decision.action is ElasticAction.RESIZE:
            failure = root_cause(list(gen.failures.values()))
            verdict = self.ctl.failure_policy.decide(failure, len(self.ctl.failures) + 1)
            if verdict.decision is Decision.RAISE:
                decision = ElasticDecision(ElasticAction.FALLBACK, verdict.reason)
            elif self.growable() is None:
                decision = ElasticDecision(
                    ElasticAction.FALLBACK,
                    "not resizing in place: this launcher cannot resize a worker group",
                )
            else:
                try:
                    return decision, self._resize(gen, decision, failure)
                except OSError as exc:
                    decision = ElasticDecision(
                        ElasticAction.FALLBACK, f"resize in place failed ({exc})"
                    )
        if decision.action is ElasticAction.FALLBACK:
            if decision.stuck and self.ctl.group is not None:
                self.ctl.group.dump_stacks(list(decision.stuck))  # where they are stuck
            gen.elastic_fallback = True
            message = f"{decision.reason}; restarting the group from the disk checkpoint"
            logger.warning(message)
            self.ctl.progress.message(message)
            self.ctl.run_dir.write(ResizeFallbackEvent(reason=decision.reason))
        return decision, gen

    def _resize(
        self, gen: Generation, decision: ElasticDecision, failure: WorkerFailure
    ) -> Generation:
        """Turn the survivors into the next generation of the group, ranks renumbered in order,
        without restarting a process."""
        ctl = self.ctl
        group = self.growable()
        assert group is not None and decision.snapshot_step is not None
        self.leaving.notice = None  # a leave in progress: the lost rank's failure decides instead
        ctl.failures.append(failure)
        ctl.callback("on_failure", failure)
        self.generation += 1
        old_world, new_world = gen.world_size, len(decision.survivors)
        # Rounds some rank never reported are gone; a round whose files the lost rank owed can
        # never be published: drop its staging directory (survivors finished their writes
        # before saying Interrupted).
        for round_ in gen.rounds.open_rounds():
            ctl.checkpoints.discard_staging(round_)
        assignment, orders = self._resize_orders(
            gen, decision.survivors, decision.source, ctl.next_round, decision.snapshot_step
        )
        reached = [i.step for i in gen.interrupted.values() if i.step is not None]
        reached += [s for s in gen.health.last_step.values() if s is not None]
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
        new = self.next_generation(gen, new_world, info)
        if self.grow is not None:  # workers waiting to join a group that just lost one
            self._grow_failed(self.grow, f"a member was lost ({failure.message})", backoff=False)
        group.resize(assignment, orders)
        message = (
            f"{decision.reason}: {failure.message}; rolling back to the snapshot of step "
            f"{decision.snapshot_step} ({rolled_back} steps); failure {len(ctl.failures)}"
        )
        logger.warning(message)
        ctl.progress.message(message)
        for rank in range(new_world, old_world):
            ctl.progress.worker_state(rank, "stopped")
        for rank in range(new_world):
            ctl.progress.worker_state(rank, "running")
        return new

    def next_generation(self, gen: Generation, new_world: int, info: dict[str, Any]) -> Generation:
        """The resized group of ``new_world`` workers (same attempt number as ``gen``; ``info``
        is its pending ``resize`` event); the controller's world size and straggler flags follow
        it."""
        new = Generation(gen.number, new_world)
        new.health.resized(time.monotonic())  # a member stuck re-forming it is a hang
        new.resize = info
        self.ctl.world_size = new_world
        self.ctl.reset_stragglers()
        return new

    def _resize_orders(
        self,
        gen: Generation,
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
                store_prefix=f"ringtrain/elastic/{gen.number}/{self.generation}/",
                source_rank=source,
                start_round=start_round,
                snapshot_step=snapshot_step,
            )
            for old, new in assignment.items()
        }
        return assignment, orders

    def on_resumed(self, gen: Generation, event: Resumed) -> None:
        if gen.resize is None:
            return
        info, gen.resize = gen.resize, None
        resume_s = max(0.0, event.time - info["failure_time"])
        pause_time = info.pop("pause_time", None)
        extra = {} if pause_time is None else {"paused_s": max(0.0, event.time - pause_time)}
        self.ctl.run_dir.write(ResizeEvent(**info, resume_s=resume_s, **extra))
        grew = info["new_world_size"] > info["old_world_size"]
        if grew:
            self.grow_failures = 0
        # Below max: the next try to grow back is measured from here.
        self.grow_idle_since = time.monotonic()
        since = "capacity returned" if grew or pause_time is not None else "the failure"
        text = (
            f"resized {info['old_world_size']} -> {info['new_world_size']} workers; training "
            f"resumed {resume_s:.2f} s after {since}, at step {event.step}"
        )
        if "paused_s" in extra:
            text += f" (paused {extra['paused_s']:.2f} s)"
        logger.info(text)
        self.ctl.progress.message(text)

    # ------------------------------------------------------------------ growing back
    def grow_tick(self, gen: Generation) -> Generation | None:
        """Drive a grow back to ``max`` one poll at a time (no failure is in progress): start
        workers to join once ``elastic_grow_after_s`` has passed below ``max``; when all of
        them are ready (JoinReady), ask the members to pause at their next step boundary; when
        all members paused, make one group of members and joiners. Returns the new generation
        once one is formed."""
        assert self.policy is not None and self.ctl.group is not None
        grow = self.grow
        paused = [r for r, i in gen.interrupted.items() if i.grow and r < gen.world_size]
        if self.leaving.notice is not None:
            return self.leaving.tick(gen, paused)
        if grow is None:
            if paused:  # a stale request paused the members: re-form them as they were
                if len(paused) == gen.world_size:
                    return self.grow_resize(gen, [], None, "re-formed after a cancelled grow")
                return None
            self._grow_start(gen)
            return None
        if grow.dead and not grow.requested:
            self._grow_failed(grow, "; ".join(grow.dead[r] for r in sorted(grow.dead)))
            return None
        if not grow.requested:
            self._request_pause(gen, grow)
            return None
        if len(paused) < gen.world_size:
            return None
        joiners = [r for r in grow.ranks if r not in grow.dead]
        why = "; ".join(grow.dead[r] for r in sorted(grow.dead))
        if grow.dead:
            self._grow_failed(grow, why, discard=sorted(grow.dead))
        cause = (
            "capacity returned"
            if joiners
            else f"re-formed after the joining workers failed ({why})"
        )
        return self.grow_resize(gen, joiners, grow, cause)

    def _request_pause(self, gen: Generation, grow: Grow) -> None:
        if set(grow.ranks) <= grow.ready:
            grow.requested = True
            group = self.growable()
            assert group is not None  # a grow started, so the group can grow
            for rank in range(gen.world_size):
                try:
                    group.send(rank, GrowRequest(self.generation))
                except OSError:
                    pass  # that member is gone: its failure follows and cancels the grow
        elif time.monotonic() - grow.started_at > max(
            HELLO_TIMEOUT_S, self.ctl.worker_timeout_s or 0
        ):
            waiting = sorted(set(grow.ranks) - grow.ready)
            self._grow_failed(grow, f"ranks {waiting} did not get ready to join in time")

    def _grow_start(self, gen: Generation) -> None:
        ctl = self.ctl
        group = self.growable()
        assert self.policy is not None and ctl.group is not None
        if (
            self.grow_idle_since is None
            or self.leaving.notice is not None
            or gen.resize is not None  # the last resize has not resumed yet
            or gen.done
            or gen.exited
            or group is None
        ):
            return
        ranks = self.policy.grow_ranks(
            gen.world_size, time.monotonic() - self.grow_idle_since, self.grow_failures
        )
        if not ranks:
            return
        try:
            started = list(group.grow(ranks))
        except (OSError, RuntimeError, ValueError) as exc:
            self._grow_failed(Grow(ranks), f"could not start workers: {exc}", discard=[])
            return
        extra = started[len(started) - len(started) % self.policy.replica_group_size :]
        if extra:  # grow by whole replica groups only: stop a partial one
            group.discard(extra)
            started = started[: len(started) - len(extra)]
        if not started:  # no capacity now: look again after elastic_grow_after_s
            self.grow_idle_since = time.monotonic()
            return
        self.grow = Grow(started)
        message = (
            f"growing back: starting {len(started)} worker(s) (ranks {started}) to grow "
            f"{gen.world_size} -> {gen.world_size + len(started)}; the members pause at "
            "their next step boundary once the new workers are up"
        )
        logger.info(message)
        ctl.progress.message(message)
        ctl.run_dir.write(
            GrowStartEvent(old_world_size=gen.world_size, ranks=started, generation=self.generation)
        )

    def on_joiner_event(self, event: Event) -> None:
        """An event of a worker started to join (its rank is >= the world size)."""
        grow = self.grow
        rank = getattr(event, "rank", -1)
        if grow is None or rank not in grow.ranks:
            return  # a stale event of a rank that left
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
        assert self.policy is not None
        ranks = grow.ranks if discard is None else discard
        group = self.growable()
        if ranks and group is not None:
            group.discard(ranks)
        if discard is None:
            self.grow = None
        if backoff:
            self.grow_failures += 1
        self.grow_idle_since = time.monotonic()
        delay = self.policy.grow_delay_s(self.grow_failures)
        message = f"growing back failed: {reason}; trying again in {delay:g} s"
        logger.warning(message)
        self.ctl.progress.message(message)
        self.ctl.run_dir.write(GrowFailedEvent(reason=reason, ranks=ranks, retry_s=delay))

    def grow_resize(
        self,
        gen: Generation,
        joiners: list[int],
        grow: Grow | None,
        cause: str,
        members: list[int] | None = None,
        since: float | None = None,
    ) -> Generation:
        """Make the paused ``members`` (default: all, ranks kept; else renumbered in order) and
        ``joiners`` (numbered after them) the next generation: each is sent a Resize, the
        joiners get the newest snapshot by broadcast from a member; the paused ranks not in
        ``members`` are stopped (a leave). ``since``: when the cause arose (Unix seconds)."""
        ctl = self.ctl
        group = self.growable()
        assert group is not None
        old_world = gen.world_size
        members = list(range(old_world)) if members is None else members
        steps = {r: gen.interrupted[r].snapshot_step for r in members}
        held = [s for s in steps.values() if s is not None]
        newest = max(held) if held else None
        order = members + joiners
        source = None
        if newest is not None and (joiners or len(set(steps.values())) > 1):
            source = order.index(min(r for r in members if steps[r] == newest))
        self.generation += 1
        for round_ in gen.rounds.open_rounds():
            ctl.checkpoints.discard_staging(round_)
        new_world = len(order)
        assignment, orders = self._resize_orders(
            gen, order, source, ctl.next_round, newest if newest is not None else -1
        )
        reached = [i.step for i in gen.interrupted.values() if i.step is not None]
        rolled_back = max(0, max(reached, default=newest or 0) - (newest or 0))
        pauses = [gen.interrupted[r].time for r in members if gen.interrupted[r].grow]
        info = {
            "old_world_size": old_world,
            "new_world_size": new_world,
            "cause": cause,
            "generation": self.generation,
            "snapshot_step": newest,
            "steps_rolled_back": rolled_back,
            "failure_time": since or (grow.capacity_time if grow is not None else time.time()),
            "pause_time": min(pauses, default=time.time()),
        }
        new = self.next_generation(gen, new_world, info)
        self.grow = None
        try:
            group.resize(assignment, orders)
        except OSError as exc:  # a connection went away just now: restart from disk
            reason = f"growing back failed while re-forming the group ({exc})"
            new.elastic_fallback = True
            ctl.events.on_failure(
                new,
                WorkerFailure(
                    rank=0, kind="exit", message=reason, attempt=gen.number, time=time.time()
                ),
            )
            ctl.run_dir.write(ResizeFallbackEvent(reason=reason))
            return new
        message = (
            f"{'growing back' if new_world > old_world else 'resizing'} in place: {old_world} -> "
            f"{new_world} workers ({cause}); joining at the snapshot of step {newest}"
        )
        logger.info(message)
        ctl.progress.message(message)
        for rank in range(new_world):
            ctl.progress.worker_state(rank, "running")
        return new
