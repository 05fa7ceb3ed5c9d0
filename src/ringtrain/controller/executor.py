"""The controller's executor of effects: :meth:`Executor.apply` runs what a decider returned
(:mod:`ringtrain.controller.effects`) on the run's directory, display, callbacks, checkpoints,
worker group and book-keeping.

:class:`Executor` is a part of :class:`~ringtrain.controller.controller.Controller` (its base
class), kept in its own file; nothing else executes effects.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.checkpoint import fence
from ringtrain.checkpoint.fence import Fence
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.controller import events, integrity
from ringtrain.controller.effects import (
    Adopt,
    Discard,
    DiscardStaging,
    DumpStacks,
    Effect,
    FenceOff,
    GrowIdle,
    Notify,
    Publish,
    RankMetrics,
    RoundDone,
    Say,
    Send,
    Show,
    Timed,
    Verified,
    Write,
)
from ringtrain.controller.elastic import Rendezvous
from ringtrain.controller.generation import Generation
from ringtrain.controller.integrity import Recheck
from ringtrain.controller.outputs import RunBook, call_callbacks
from ringtrain.controller.policy import FailurePolicy
from ringtrain.controller.rounds import Publisher
from ringtrain.controller.script_settings import adopt
from ringtrain.launch.base import GrowableGroup, WorkerGroup
from ringtrain.monitor.progress import ProgressReporter
from ringtrain.monitor.straggler import StragglerDetector
from ringtrain.rundir import RunDirectory
from ringtrain.wire.channel import IntegrityVerified, RunSettings

logger = logging.getLogger("ringtrain")


class Executor:
    """Executes effects (see the module docstring)."""

    # The controller's state the effects change (Controller.__init__ sets it).
    run_dir: RunDirectory
    progress: ProgressReporter
    fence: Fence
    checkpoints: CheckpointManager
    publisher: Publisher
    stragglers: StragglerDetector | None
    group: WorkerGroup | None
    book: RunBook
    rendezvous: Rendezvous
    next_round: int
    recheck: Recheck | None
    failure_policy: FailurePolicy
    said: set[str]
    callbacks: list[Any]
    _growable: Callable[[], GrowableGroup | None]

    def apply(self, effects: Sequence[Effect], gen: Generation | None = None) -> None:
        """Execute a decider's ``effects`` in order (:mod:`ringtrain.controller.effects`);
        ``gen``: the worker group they are about (its rounds publish, its attempt number)."""
        for effect in effects:
            if isinstance(effect, Write):
                self.run_dir.write(effect.record)
            elif isinstance(effect, Say):
                log = logger.warning if effect.warn else logger.info
                log("%s%s", effect.log_prefix, effect.text)
                self.progress.message(effect.text)
            elif isinstance(effect, Show):
                getattr(self.progress, effect.method)(*effect.args)
            elif isinstance(effect, Notify):
                self.callback(effect.hook, *effect.args)
            elif isinstance(effect, Publish | Timed):
                assert gen is not None
                self._apply_group(effect, gen)
            elif isinstance(effect, FenceOff):
                self.fence_off(effect)
            else:
                self._apply_run(effect)

    def _apply_group(self, effect: Publish | Timed, gen: Generation) -> None:
        if isinstance(effect, Publish):
            self.apply(self.publisher.try_publish(gen.rounds, effect.round))
            return
        outer_steps = effect.window.get("outer_steps")
        if effect.rank == 0 and isinstance(outer_steps, int):
            self.book.outer_steps = outer_steps  # DiLoCo's count: Result.outer_steps
        if self.stragglers is not None:
            for change in self.stragglers.update(effect.rank, effect.window):
                self.apply(events.straggler(change, gen.number))

    def _apply_run(self, effect: Effect) -> None:
        if isinstance(effect, RankMetrics):
            self.book.metrics_per_rank[effect.rank] = effect.metrics
        elif isinstance(effect, RoundDone):
            self.book.history[effect.round] = effect.metrics
            self.next_round = effect.round + 1
        elif isinstance(effect, DumpStacks):
            if self.group is not None:
                self.group.dump_stacks(list(effect.ranks))
        elif isinstance(effect, Send):
            for rank in effect.ranks:
                with contextlib.suppress(OSError):  # gone: its failure follows
                    self.group.send(rank, effect.message)  # type: ignore[union-attr]
        elif isinstance(effect, Discard):
            group = self._growable()
            if group is not None:
                group.discard(list(effect.ranks))
        elif isinstance(effect, DiscardStaging):
            for round_ in effect.rounds:
                self.checkpoints.discard_staging(round_)
        elif isinstance(effect, GrowIdle):
            self.rendezvous.idle_since = effect.since
            if effect.grew:
                self.rendezvous.grow_failures = 0
        elif isinstance(effect, Verified):
            self._verified(effect.event)
        elif isinstance(effect, Adopt):
            self._adopt(effect.event)

    def fence_off(self, effect: FenceOff) -> None:
        """Name the lost worker in the run's fence, and guard publication from now on: a worker
        cut off may still run, and a write it began may still land
        (:mod:`ringtrain.checkpoint.fence`)."""
        lost = (*self.fence.lost, effect.worker) if effect.worker else self.fence.lost
        self.set_fence(Fence(effect.attempt, lost))
        self.publisher.guarded = True

    def set_fence(self, new: Fence) -> None:
        """Write ``new`` where the workers write (best effort: storage that fails here fails
        the run's own writes too, and says so there)."""
        self.fence = new
        fs, root = self.checkpoints.fence_location()
        try:
            fence.write(fs, root, new)
        except OSError as exc:
            logger.warning("could not write the run's fence %s: %s", new, exc)

    def _adopt(self, event: RunSettings) -> None:
        """A script's own RunConfig (``ringtrain run SCRIPT`` whose script calls
        ``rt.Trainer(...).fit()``): adopt what can still apply, say the rest (once per run)."""
        adoption = adopt(
            self.checkpoints.config,
            self.failure_policy.max_failures,
            event.run_config,
            run_name=self.run_dir.name,
            run_uri=self.run_dir.uri,
            callbacks=event.callbacks,
            notice_sources=event.notice_sources,
        )
        self.checkpoints.config = adoption.checkpoint_config
        self.failure_policy.max_failures = adoption.max_failures
        for note in adoption.notes:
            if note not in self.said:
                self.said.add(note)
                logger.info(note)
                self.progress.message(note)

    def _verified(self, event: IntegrityVerified) -> None:
        """The re-run passed the step of a mismatch without a majority: name the rank whose
        fingerprint there was another."""
        recheck = self.recheck
        if recheck is None or event.step != recheck.step:
            return
        self.recheck = None
        culprits, effects = integrity.named_by_rerun(recheck, event)
        self.book.caught.update(culprits)
        self.apply(effects)

    def reset_stragglers(self) -> None:
        """A new group (restart or resize): clear every straggler flag, since ranks are
        renumbered and their timing windows describe the old group."""
        if self.stragglers is not None:
            for rank in sorted(self.stragglers.flagged):
                self.progress.straggler(rank, False)
            self.stragglers.reset()

    # ------------------------------------------------------------------ outputs

    def callback(self, hook: str, *args: Any) -> None:
        """Call ``hook(*args)`` on the run's callbacks (:func:`call_callbacks`)."""
        call_callbacks(self.callbacks, hook, *args)
