"""The controller's handlers of preemption notices: taking a queued notice in a live state,
letting some ranks of an elastic run leave in place (``Leaving``), and ``Preempting``.

:class:`Notices` is a part of :class:`~ringtrain.controller.controller.Controller` (its base
class), kept in its own file: these methods execute what the deciders
(:class:`~ringtrain.controller.preempting.Preemption`, :mod:`ringtrain.controller.leaving`)
return, on the controller's own state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.controller import leaving
from ringtrain.controller.elastic import Rendezvous
from ringtrain.controller.generation import Generation
from ringtrain.controller.preempting import Preemption
from ringtrain.controller.spares import SpareBook
from ringtrain.controller.states import (
    Growing,
    Leaving,
    Preempting,
    PreemptionNotice,
    Resizing,
    Restarting,
    Running,
    State,
    Transition,
)
from ringtrain.elastic.policy import ElasticPolicy
from ringtrain.launch.base import GrowableGroup, WorkerGroup
from ringtrain.wire.channel import Event

logger = logging.getLogger("ringtrain")

LIVE = Running | Growing | Leaving | Resizing | Restarting
"""The states with a worker group whose events are handled."""

TRAINING = Running | Growing | Leaving
"""The live states in which no failure is being handled: the group trains (and may grow, or
let ranks leave)."""


class Notices:
    """The preemption handlers of the controller (see the module docstring)."""

    # The controller's state these handlers read and change (Controller.__init__ sets it).
    current: State
    group: WorkerGroup | None
    elastic: ElasticPolicy | None
    rendezvous: Rendezvous
    spares: SpareBook | None
    preemption: Preemption
    checkpoints: CheckpointManager
    apply: Callable[..., None]
    _take: Callable[..., None]
    _growable: Callable[[], GrowableGroup | None]
    _stop_group: Callable[[Generation], None]
    _last_messages_due: Callable[[Generation], bool]

    def _due_notice(self) -> PreemptionNotice | None:
        """A queued preemption notice to handle now: only in a live state (one received while
        the group starts waits for it to run); more notices while ``Preempting`` are dropped."""
        if isinstance(self.current, Preempting):
            self.preemption.queue.clear()
            return None
        return self.preemption.take() if isinstance(self.current, LIVE) else None

    def _preempt(self, state: State, notice: PreemptionNotice) -> Transition:
        if not isinstance(state, LIVE):
            return Transition(state, state)
        gen = state.generation
        if notice.ranks is not None and self.elastic is not None and isinstance(state, Running):
            # Some ranks of an elastic run: they leave in place while min_workers holds.
            can = self._growable() is not None
            ready = len(self.spares.ready) if self.spares is not None else 0
            why_not = leaving.refusal(self.elastic, gen, notice, can_resize=can, spares=ready)
            if why_not is None:
                reason, effects = leaving.start(
                    gen,
                    notice,
                    generation=self.rendezvous.generation,
                    grace_s=self.preemption.grace_s,
                    min_workers=self.elastic.min_workers,
                    spares=ready,
                )
                self.preemption.handled.append(notice)
                self.apply(effects)
                return Transition(state, Leaving(gen, notice), reason)
            logger.warning("preemption notice for ranks %s: %s", list(notice.ranks), why_not)
        group = self.group if isinstance(state, TRAINING) else None  # else: failing
        can_ask = group is not None and callable(getattr(group, "send", None))
        transition, effects = self.preemption.enter(
            state, gen, notice, group.world_size if group is not None and can_ask else None
        )
        self.apply(effects)
        self._send_preempt_request()
        return transition

    def _send_preempt_request(self) -> None:
        """Send the preemption request to the ranks it has not reached yet."""
        send, request = getattr(self.group, "send", None), self.preemption.request
        if request is None or not callable(send):
            return
        for rank in self.preemption.unreached():
            try:
                send(rank, request)
            except OSError as exc:
                logger.debug("preemption: rank %d not reached yet (%s)", rank, exc)
                continue
            self.preemption.reached(rank)

    def _step_preempting(self, state: Preempting, event: Event | None) -> Transition:
        gen = state.generation
        if self.preemption.asked and self.group is not None:
            self._take(gen, event)
            self._send_preempt_request()
            if gen.all_exited and self._last_messages_due(gen):
                return Transition(state, state)  # the stop round's CheckpointDone, Done
        outcome = self.preemption.outcome(gen, state.deadline)
        if outcome is None:
            return Transition(state, state)
        self._stop_group(gen)
        latest = self.checkpoints.latest
        kept = latest.checkpoint.uri if latest is not None else None
        target, reason, effects = self.preemption.end(state, outcome, kept)
        self.apply(effects)
        return Transition(state, target, reason)
