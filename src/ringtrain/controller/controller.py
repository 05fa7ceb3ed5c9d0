"""The driver-side state machine.

``run()`` calls ``step()`` until the state is terminal; ``step(event)`` handles one worker event
(or polls the group once) in the current state and returns the :class:`Transition` it made. The
states and their data are in :mod:`ringtrain.controller.states`::

    Starting ──▶ Running ──▶ Finished | Stopped
                   │ a rank failed
                   ▼
                 Restarting ──▶ Starting (FailurePolicy: RESTART) | Errored (RAISE)

Elastic runs (``ScalingConfig(num_workers=(min, max))``) go through ``Resizing`` after a failure
(the group continues in place with fewer ranks), ``Growing`` when capacity returns and ``Leaving``
when a preemption notice names some ranks; a notice for the whole run enters ``Preempting``.

The controller is the only object that executes decisions and owns the run's mutable state. The
deciders it asks take facts and return values (``events``: what a worker event means;
``elastic``, ``leaving``: resize and grow plans; ``preempting``; ``policy``: restart or raise;
``rounds``: publication; ``health``: liveness; ``integrity``; ``spares``); their effects
(:mod:`~ringtrain.controller.effects`) are executed by :meth:`Controller.apply`. The class
is written in four files: this one (the loop, starting, running, restarting), ``executor.py``
(executing effects), ``in_place.py`` (the elastic states) and ``notices.py`` (preemption).

A caller may also ask a running job to stop early (``stop_event``, e.g. a sweep pruning a trial):
its group is stopped at once and the run ends ``STOPPED``, its published checkpoints kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.checkpoint.fence import Fence
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.controller import events, integrity
from ringtrain.controller.attempt import root_cause
from ringtrain.controller.effects import Say
from ringtrain.controller.elastic import Rendezvous
from ringtrain.controller.executor import Executor
from ringtrain.controller.generation import Generation, Grow
from ringtrain.controller.in_place import InPlace
from ringtrain.controller.integrity import Recheck
from ringtrain.controller.notices import TRAINING, Notices
from ringtrain.controller.outputs import RunBook, aborted_because, build_result, result_record
from ringtrain.controller.policy import Decision, FailurePolicy
from ringtrain.controller.preempting import Preemption
from ringtrain.controller.resume import ResumePoint
from ringtrain.controller.rounds import Publisher
from ringtrain.controller.spares import SpareBook
from ringtrain.controller.states import (
    Aborted,
    Errored,
    Finished,
    Growing,
    Leaving,
    Preempting,
    PreemptionNotice,
    Resizing,
    Restarting,
    Running,
    RunState,
    Starting,
    State,
    Stopped,
    Transition,
)
from ringtrain.elastic.policy import ElasticPolicy
from ringtrain.launch.base import ChannelReading, Launcher, WorkerGroup, WorkerSpec
from ringtrain.monitor.progress import ProgressReporter
from ringtrain.monitor.straggler import StragglerDetector
from ringtrain.preemption import NoticeSource
from ringtrain.result import Result, TrainingFailedError, WorkerFailure, follow_ons
from ringtrain.rundir import RunDirectory
from ringtrain.rundir.schema import (
    DecisionEvent,
    RunEndEvent,
    RunStartEvent,
    StopRequestedEvent,
    TransitionEvent,
)
from ringtrain.wire.channel import Event, IntegrityMismatch, PreemptSaved, WorkerNotice

__all__ = ["Controller", "RunState", "SpecFactory", "Transition"]

logger = logging.getLogger("ringtrain")

SpecFactory = Callable[[int, int, "str | None"], WorkerSpec]
"""(attempt, start_round, latest checkpoint URI) -> the spec of that attempt's workers."""


class Controller(Executor, InPlace, Notices):
    """Runs a training job to completion through restarts.

    The controller owns the run's mutable state (the current state, the worker group, the
    :class:`~ringtrain.controller.outputs.RunBook`, the elastic
    :class:`~ringtrain.controller.elastic.Rendezvous`) and executes what its deciders return
    (:meth:`apply`); the deciders never hold it.

    Args:
        launcher: starts worker groups.
        make_spec: builds each attempt's :class:`WorkerSpec`.
        world_size: number of workers.
        run_dir: the run directory writer.
        checkpoints: publication and retention of checkpoints.
        failure_policy: restart-or-raise decisions (asked once per failure).
        progress: the live display.
        callbacks: driver-side callbacks (the hooks of :data:`ringtrain.config.CALLBACK_HOOKS`).
        failure_grace_s: how long to keep collecting events after the first failure (seconds);
            cut short once every rank has failed or exited.
        stop_grace_s: SIGTERM-to-SIGKILL grace when stopping a group (seconds).
        worker_timeout_s: a rank without progress for this long is failed as hung (seconds;
            ``None``: never).
        checkpoint_grace_s: after a failure, how long to let live ranks finish background
            checkpoint writes of rounds every rank reported, so that the restart loses only the
            steps after that checkpoint (seconds).
        stragglers: flags slow ranks from the workers' timing windows (``None``: no detection).
        elastic: resize-in-place decisions (``ScalingConfig(num_workers=(min, max))``);
            ``None``: every failure restarts the group (docs/elastic.md).
        stop_event: set by another thread (or a callback) to end the run early: the group is
            stopped within one poll interval and the run ends ``STOPPED`` (used by
            ``ringtrain.tune`` to prune a trial).
        notice_sources: preemption notice sources (:mod:`ringtrain.preemption`), started when
            :meth:`run` starts and stopped when it ends.
        preemption_grace_s: seconds the workers get to save after a notice
            (``FailureConfig.preemption_grace_s``).
        spares: hot spares to keep ready (``ScalingConfig.spares``; needs ``elastic``).
    """

    def __init__(
        self,
        *,
        launcher: Launcher,
        make_spec: SpecFactory,
        world_size: int,
        run_dir: RunDirectory,
        checkpoints: CheckpointManager,
        failure_policy: FailurePolicy,
        progress: ProgressReporter,
        callbacks: Sequence[Any] = (),
        failure_grace_s: float = 1.0,
        stop_grace_s: float = 5.0,
        poll_interval_s: float = 0.1,
        worker_timeout_s: float | None = None,
        checkpoint_grace_s: float = 120.0,
        stragglers: StragglerDetector | None = None,
        elastic: ElasticPolicy | None = None,
        stop_event: threading.Event | None = None,
        notice_sources: Sequence[NoticeSource] = (),
        preemption_grace_s: float = 30.0,
        spares: int = 0,
    ) -> None:
        self.launcher = launcher
        self.make_spec = make_spec
        self.world_size = world_size
        self.run_dir = run_dir
        self.checkpoints = checkpoints
        self.failure_policy = failure_policy
        self.progress = progress
        self.callbacks = list(callbacks)
        self.failure_grace_s = failure_grace_s
        self.stop_grace_s = stop_grace_s
        self.poll_interval_s = poll_interval_s
        self.worker_timeout_s = worker_timeout_s
        self.checkpoint_grace_s = checkpoint_grace_s
        self.stragglers = stragglers
        self.elastic = elastic
        self.stop_event = stop_event
        self.publisher = Publisher(checkpoints)
        self.preemption = Preemption(notice_sources, preemption_grace_s)
        self.resume = ResumePoint(checkpoints, run_dir, progress)

        self.current: State = Starting(0)
        self.group: WorkerGroup | None = None
        self.book = RunBook()
        self.rendezvous = Rendezvous()
        self.next_round = checkpoints.next_round
        self.recheck: Recheck | None = None  # a mismatch the re-run is to name a rank for
        self.excluded = 0  # workers left out after corrupting twice (elastic runs)
        self.said: set[str] = set()  # notes shown once per run (every attempt sends them)
        self.spares = SpareBook(spares) if spares else None  # per group: _start_generation
        self.fence = Fence(-1)  # which workers may still write (checkpoint/fence.py)

    @property
    def state(self) -> RunState:
        """The kind of the current state."""
        return self.current.kind

    @property
    def generation(self) -> int:
        """The elastic rendezvous generation of the worker group (0 for fresh processes)."""
        return self.rendezvous.generation

    @property
    def failures(self) -> list[WorkerFailure]:
        """The failures that stopped or resized a worker group, in order."""
        return self.book.failures

    @property
    def error(self) -> TrainingFailedError | None:
        """What ``Trainer.fit`` raises, once the failure policy gave up."""
        return self.book.error

    # ------------------------------------------------------------------ the loop
    def run(self) -> Result:
        """Step until the job finishes or the FailurePolicy says stop. A Ctrl-C at any point,
        set-up included (result.json says RUNNING, the notice sources hold SIGTERM), ends it
        ``ABORTED``: the group stopped, the handlers restored, the end recorded, then raised."""
        try:
            self.progress.start(self.run_dir.name, self.world_size, self.run_dir.uri)
            self._write_result()
            self.preemption.start()
            while not self.state.terminal:
                self.step(self._due_notice())
        except BaseException as exc:
            # _enter sets the state first: a run directory that cannot be written (the error
            # itself, perhaps) must not hide the original exception.
            with contextlib.suppress(Exception):
                self._enter(Transition(self.current, Aborted(type(exc).__name__), repr(exc)))
            raise
        finally:
            result = self._end()
        return result

    def _end(self) -> Result:
        """Stop the notice sources and the group, then record the end; the end is recorded even
        when stopping is cut short (a second Ctrl-C while the group stops: still raised)."""
        try:
            self.preemption.stop()
            group, self.group = self.group, None
            if group is not None:
                group.stop(grace_s=self.stop_grace_s)
        finally:
            result = self.result()
            self.run_dir.write(
                RunEndEvent(status=self.state.value, duration_s=time.time() - self.book.start_time)
            )
            self._write_result()
            self.run_dir.close()
            self.progress.close(self.state.value)
        if self.state is not RunState.ABORTED:
            self.callback("on_end", result)
        return result

    def step(self, event: Event | PreemptionNotice | None = None) -> Transition:
        """Advance the state machine by one step.

        Args:
            event: one worker event to handle (``None``: poll the group once, waiting up to
                ``poll_interval_s``), or a :class:`PreemptionNotice`.

        Returns:
            The transition made; ``transition.changed`` is False when the state stayed.
            Changes are logged and written as ``transition`` events (from, to, reason).
        """
        state = self.current
        if isinstance(event, PreemptionNotice):
            transition = self._preempt(state, event)
        elif isinstance(state, Starting):
            transition = self._step_starting(state)
        elif isinstance(state, TRAINING):
            transition = self._step_training(state, event)
        elif isinstance(state, Resizing):
            transition = self._step_resizing(state, event)
        elif isinstance(state, Restarting):
            transition = self._step_restarting(state, event)
        elif isinstance(state, Preempting):
            transition = self._step_preempting(state, event)
        else:
            transition = Transition(state, state)  # terminal
        if transition.changed:
            self._enter(transition)
        return transition

    def _enter(self, transition: Transition) -> None:
        self.current = transition.target
        logger.info("%s -> %s: %s", transition.from_.value, transition.to.value, transition.reason)
        self.run_dir.write(
            TransitionEvent(
                from_=transition.from_.value, to=transition.to.value, reason=transition.reason
            )
        )

    # ------------------------------------------------------------------ state handlers
    def _step_starting(self, state: Starting) -> Transition:
        gen, resumed = self._start_generation(state.attempt)
        how = f", resuming from {resumed}" if resumed else ""
        reason = f"started {gen.world_size} workers (attempt {state.attempt}{how})"
        return Transition(state, Running(gen), reason)

    def _step_training(self, state: Running | Growing | Leaving, event: Event | None) -> Transition:
        gen = state.generation
        self._take(gen, event, state.plan if isinstance(state, Growing) else None)
        if self._stop_requested():
            return self._stop(state)
        if gen.first_failure_at is None and not gen.all_exited:
            moved = self._in_place(state)
            if moved is not None:
                return moved
            self.apply(events.hang(gen, self.worker_timeout_s), gen)
        if gen.first_failure_at is not None:
            return self._failed(state, gen)
        if gen.all_exited and self._last_messages_due(gen):
            return Transition(state, state)  # the next polls take them
        if gen.all_exited:
            notice = self.preemption.take() if self.preemption.saved else None
            if notice is not None:
                # The workers stopped for a notice of their own (SIGTERM to them) that reached
                # this driver in one poll with their last events: not FINISHED, but PREEMPTED.
                return self._preempt(state, notice)
            self._stop_group(gen)
            return Transition(state, Finished(), "every worker finished")
        return Transition(state, state)

    def _last_messages_due(self, gen: Generation) -> bool:
        group = self.group
        return isinstance(group, ChannelReading) and gen.last_messages_due(group.reading)

    def _failed(self, state: Running | Growing | Leaving, gen: Generation) -> Transition:
        """A failure (or, elastic runs, a survivor's Interrupted) was seen in ``gen``."""
        failures = list(gen.failures.values())
        failure = failures[0] if failures else None
        reason = failure.message if failure else "a rank was interrupted"
        if self.elastic is not None and not gen.elastic_fallback:
            plan = state.plan if isinstance(state, Growing) else None
            return Transition(state, Resizing(gen, failure, plan), f"{reason}; resizing in place")
        return Transition(state, Restarting(gen, failure), reason)

    def _step_restarting(self, state: Restarting, event: Event | None) -> Transition:
        gen = state.generation
        if self.group is not None:
            # Checked before taking more events too: the step that saw the failure handled the
            # events of its poll, and a grace of 0 s ends the collection there.
            if not gen.drained(self.failure_grace_s, self.checkpoint_grace_s):
                self._take(gen, event)
                if self._stop_requested():
                    return self._stop(state)
                if not gen.drained(self.failure_grace_s, self.checkpoint_grace_s):
                    return Transition(state, state)
            self._stop_group(gen)
        if gen.mismatch is not None:
            return self._corrupted(state, gen, gen.mismatch)
        if not gen.failures:
            return Transition(state, Finished(), "the group ended without a failure")
        everyone = list(gen.failures.values())
        failure = state.failure if state.verdict is not None else root_cause(everyone)
        assert failure is not None
        self.book.follow_on_failures += follow_ons(everyone, failure)
        if state.verdict is None and self.resume.set_aside_unloadable(failure):
            # Bounded: each time, one checkpoint fewer is left to resume from.
            reason = f"the checkpoint could not be loaded ({failure.message}); set aside"
            return Transition(state, Starting(gen.number + 1), reason)
        self.book.failures.append(failure)
        self.callback("on_failure", failure)
        decision = state.verdict or self.failure_policy.decide(failure, len(self.failures))
        self.apply([Say(decision.reason, warn=True)])
        self.run_dir.write(DecisionEvent(decision=decision.decision.value, reason=decision.reason))
        if decision.decision is Decision.RAISE:
            self.book.error = TrainingFailedError(self.failures, self.book.follow_on_failures)
            return Transition(state, Errored(self.book.error), decision.reason)
        return Transition(state, Starting(gen.number + 1), decision.reason)

    def _stop(self, state: State) -> Transition:
        self.run_dir.write(StopRequestedEvent(round=self.next_round - 1))
        if self.group is not None:
            self.group.stop(grace_s=self.stop_grace_s)
            self.group = None
        return Transition(state, Stopped(), f"stop requested after round {self.next_round - 1}")

    def _corrupted(
        self, state: Restarting, gen: Generation, mismatch: IntegrityMismatch
    ) -> Transition:
        """A replica check failed: roll back to the newest checkpoint that passed a check
        (``integrity.after_mismatch`` decides; no failure is counted), restart without a rank
        caught twice (elastic runs), or stop naming it."""
        spare = gen.world_size - self.elastic.min_workers if self.elastic is not None else 0
        decision = integrity.after_mismatch(
            mismatch,
            hosts=gen.hosts,
            caught=self.book.caught,
            suspected=self.book.suspected,
            can_shrink_by=spare,
        )
        self.book.caught.update(decision.culprits)
        if not mismatch.named:
            self.book.suspected.update(mismatch.suspects)
        self.apply(decision.effects)
        if decision.action == "fail":
            failure = WorkerFailure(
                rank=decision.excluded[0],
                kind="corruption",
                message=decision.reason,
                attempt=gen.number,
                time=time.time(),
                step=mismatch.step,
            )
            self.book.failures.append(failure)
            self.callback("on_failure", failure)
            self.book.error = TrainingFailedError(self.failures, self.book.follow_on_failures)
            return Transition(state, Errored(self.book.error), decision.reason)
        if decision.action == "exclude":
            self.excluded += len(decision.excluded)
            assert self.elastic is not None
            self.elastic.max_workers -= len(decision.excluded)  # no growing back onto it
        why = f"newer than the last replica check that passed (step {mismatch.last_clean_step})"
        self.checkpoints.set_aside_after(decision.clean_round, why)
        self.recheck = decision.recheck
        return Transition(state, Starting(gen.number + 1), decision.reason)

    # ------------------------------------------------------------------ a group's life
    def _start_generation(self, number: int) -> tuple[Generation, str | None]:
        """Start attempt ``number``'s worker group from the newest valid checkpoint. Returns
        the generation and the checkpoint it resumes from (None: from scratch)."""
        latest = self.resume.choose(number)
        # Rounds after the checkpoint we resume from are recomputed: their report indices must
        # line up with the restored state, and their metrics replace the lost attempt's.
        self.next_round = latest.round + 1 if latest is not None else 0
        for stale in [r for r in self.book.history if r >= self.next_round]:
            del self.book.history[stale]
        spec = self._attempt_spec(number)
        gen = Generation(number, spec.world_size)
        if self.publisher.guarded:  # a worker declared lost may live: fence its attempt off
            self.set_fence(Fence(number))
        else:
            self.fence = Fence(number)
        self.reset_stragglers()
        self.run_dir.write(RunStartEvent(world_size=spec.world_size, attempt=number))
        for rank in range(spec.world_size):
            self.progress.worker_state(rank, "starting")
        self.group = self.launcher.start(spec)
        self.rendezvous = Rendezvous()  # a (re)start has max workers, at generation 0
        self.spares = SpareBook(self.spares.wanted) if self.spares is not None else None
        mesh = getattr(getattr(getattr(self.group, "spec", None), "config", None), "mesh", None)
        if self.elastic is not None and mesh is not None:
            self.elastic.use_mesh(mesh.dp_shard)  # a lost rank's replica group leaves with it
        return gen, latest.checkpoint.uri if latest is not None else None

    def _attempt_spec(self, number: int) -> WorkerSpec:
        """Attempt ``number``'s spec: without the workers excluded for corruption, and asking
        for the fingerprint a re-run names a corrupted rank by."""
        spec = self.make_spec(number, self.next_round, self.resume.uri)
        if self.excluded:
            spec = dataclasses.replace(spec, world_size=spec.world_size - self.excluded)
            self.world_size = spec.world_size
        if self.recheck is not None:
            config = dataclasses.replace(spec.config, recheck_step=self.recheck.step)
            spec = dataclasses.replace(spec, config=config)
        return spec

    def _take(self, gen: Generation, event: Event | None, plan: Grow | None = None) -> None:
        """Handle ``event``, or what one poll of the group brings (stopping at a stop request:
        the reports still queued belong to rounds after it); ``plan``: a grow under way."""
        assert self.group is not None
        batch = [event] if event is not None else self.group.poll(self.poll_interval_s)
        for ev in batch:
            if self._spare_event(ev):  # in_place.py: a hot spare's, not the group's
                continue
            if isinstance(ev, WorkerNotice):
                self.preemption.from_worker(ev)
            elif isinstance(ev, PreemptSaved):
                self.preemption.saved[ev.rank] = ev
            self.apply(events.handle(gen, ev, generation=self.generation, grow=plan), gen)
            if self._stop_requested():
                break

    def _stop_group(self, gen: Generation) -> None:
        if self.group is not None:
            self.group.stop(grace_s=self.stop_grace_s)
            self.group = None
        self.apply(events.ended(gen))

    def _stop_requested(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    def result(self) -> Result:
        """The run's result so far."""
        status = self.state.value if self.state.terminal else "RUNNING"
        return build_result(
            self.book,
            self.checkpoints,
            uri=self.run_dir.uri,
            status=status,
            preemptions=len(self.preemption.handled),
        )

    def _write_result(self) -> None:
        """Write ``result.json`` (status ``RUNNING`` until the state is terminal)."""
        record = result_record(
            self.result(),
            self.book,
            name=self.run_dir.name,
            world_size=self.world_size,
            rounds=self.next_round,
            aborted=aborted_because(self.current),
        )
        self.run_dir.write_result(record)
