"""The controller's side of preemption: the notice sources, the notices they queue, asking the
workers to stop at one step, and what ``Preempting`` waits for.

A :class:`Preemption` starts the run's notice sources (:mod:`ringtrain.preemption`) when the
controller's loop starts and stops them when it ends; a source's ``notify`` only appends to a
deque (safe from a signal handler and from any thread). The controller takes a queued notice
whenever it is in a live state (a notice received while the group starts waits for it to run)
and enters ``Preempting`` (:meth:`Preemption.enter`): every worker is sent a
:class:`~ringtrain.wire.channel.PreemptRequest` (by the controller, to the ranks
:meth:`Preemption.unreached` names). :meth:`Preemption.outcome` then decides, at each step of
``Preempting``, whether the state is done: every worker exited (after saving at the stop step,
or finishing first), or the deadline passed (the group is killed; what was not written is said in a
``preemption_incomplete`` event and the previous checkpoint stays, since a round is published only
once every rank's files are verified).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ringtrain.controller.effects import Effect, Say, Show, Write
from ringtrain.controller.generation import Generation
from ringtrain.controller.states import Finished, Preempted, Preempting, State, Transition
from ringtrain.preemption import NoticeSource, PreemptionNotice
from ringtrain.rundir.schema import (
    PreemptionEvent,
    PreemptionIncompleteEvent,
    PreemptionSavedEvent,
)
from ringtrain.wire.channel import PreemptRequest, PreemptSaved, WorkerNotice

logger = logging.getLogger("ringtrain")


@dataclass(frozen=True)
class Outcome:
    """How ``Preempting`` ended: ``status`` ``"saved"`` (every worker saved at ``step`` as round
    ``round``), ``"finished"`` (the workers finished before the stop step), ``"incomplete"``
    (deadline, failure, or the workers could not be asked: ``reason`` says what was lost)."""

    status: str
    reason: str
    step: int | None = None
    round: int | None = None


class Preemption:
    """Notice sources, queued notices and the acknowledgements of one run.

    Args:
        sources: the run's notice sources (the driver's :class:`SignalNotice` and the user's).
        grace_s: ``FailureConfig.preemption_grace_s``.
    """

    def __init__(self, sources: Sequence[NoticeSource] = (), grace_s: float = 30.0) -> None:
        self.sources = list(sources)
        self.grace_s = grace_s
        self.queue: collections.deque[PreemptionNotice] = collections.deque()
        self.handled: list[PreemptionNotice] = []
        self.saved: dict[int, PreemptSaved] = {}
        self.asked = False
        self.request: PreemptRequest | None = None
        self._unreached: set[int] = set()
        self._started: list[NoticeSource] = []

    # ------------------------------------------------------------------ sources
    def notify(self, notice: PreemptionNotice) -> None:
        """Queue ``notice`` (what sources call: lock-free, signal-safe)."""
        self.queue.append(notice)

    def start(self) -> None:
        """Start every source; one that fails to start is logged and left out."""
        for source in self.sources:
            try:
                source.start(self.notify)
            except Exception:
                logger.exception("preemption: notice source %r did not start", source)
                continue
            self._started.append(source)

    def stop(self) -> None:
        """Stop the started sources (each once; one that fails is logged)."""
        while self._started:
            source = self._started.pop()
            try:
                source.stop()
            except Exception:
                logger.exception("preemption: notice source %r did not stop cleanly", source)

    def take(self) -> PreemptionNotice | None:
        """The oldest queued notice, or None."""
        return self.queue.popleft() if self.queue else None

    def from_worker(self, event: WorkerNotice) -> None:
        """A worker received SIGTERM itself: queue it as a notice for that rank."""
        self.notify(
            PreemptionNotice(
                time=event.time, reason=event.reason, source="worker-signal", ranks=(event.rank,)
            )
        )

    # ------------------------------------------------------------------ Preempting
    def enter(
        self, state: State, gen: Generation, notice: PreemptionNotice, world_size: int | None
    ) -> tuple[Transition, list[Effect]]:
        """``state`` -> ``Preempting``: the ``preemption`` event, and the request every worker
        is to be sent (:meth:`unreached`; ``world_size`` ``None``: the group is failing or
        cannot be sent messages, so it is not asked and is stopped at once)."""
        grace = notice.grace_s(self.grace_s)
        ranks = list(notice.ranks) if notice.ranks is not None else None
        effects: list[Effect] = [
            Write(
                PreemptionEvent(
                    source=notice.source or None,
                    reason=notice.reason or None,
                    grace_s=grace,
                    ranks=ranks,
                )
            ),
            Show("message", (f"preemption notice ({notice.reason or notice.source}): saving",)),
        ]
        self.handled.append(notice)
        self.asked = world_size is not None
        if world_size is not None:
            deadline = notice.time + grace
            self.request = PreemptRequest(time=notice.time, deadline=deadline, reason=notice.reason)
            self._unreached = set(range(world_size))
        else:
            logger.warning(
                "preemption: the worker group cannot be sent messages; stopping the group"
            )
        reason = f"preemption notice: the workers go in {grace:g} s"
        if notice.reason:
            reason += f" ({notice.reason})"
        target = Preempting(gen, notice, notice.deadline(self.grace_s))
        return Transition(state, target, reason), effects

    def end(
        self, state: Preempting, outcome: Outcome, kept: str | None
    ) -> tuple[State, str, list[Effect]]:
        """How ``Preempting`` ends with ``outcome`` (the controller stops the group): the
        terminal state, the reason and the effects. ``kept``: the newest published checkpoint
        (what a resume starts from when the workers could not save)."""
        if outcome.status == "finished":
            return Finished(), outcome.reason, []
        if outcome.status == "saved":
            saved_s = time.monotonic() - state.notice.monotonic
            where = "" if outcome.round is None else f" (round {outcome.round}'s checkpoint)"
            record = PreemptionSavedEvent(step=outcome.step, round=outcome.round, saved_s=saved_s)
            return Preempted(), outcome.reason + where, [Write(record)]
        message = f"{outcome.reason}; a resume starts from {kept or 'scratch'}"
        effects: list[Effect] = [
            Write(PreemptionIncompleteEvent(reason=outcome.reason, checkpoint=kept)),
            Say(message, warn=True, log_prefix="preemption: "),
        ]
        return Preempted(), message, effects

    def unreached(self) -> list[int]:
        """The ranks the request has not reached yet (not yet connected, or gone: workers that
        got SIGTERM themselves may have saved and exited before the driver took their notice);
        the controller sends it to them at each step of ``Preempting``."""
        if self.request is None:
            return []
        for rank in [r for r in self._unreached if r in self.saved]:
            self._unreached.discard(rank)
        return sorted(self._unreached)

    def reached(self, rank: int) -> None:
        """The request was sent to ``rank``."""
        self._unreached.discard(rank)

    def outcome(self, gen: Generation, deadline: float) -> Outcome | None:
        """What ended ``Preempting`` for ``gen``, or None while it goes on."""
        if not self.asked:
            return Outcome("incomplete", "the workers could not be asked to save their state")
        if gen.all_exited:
            return self._exited(gen)
        if time.monotonic() >= deadline:
            missing = [r for r in range(gen.world_size) if r not in self.saved]
            writing = gen.rounds.open_rounds()
            what = f"ranks {missing} had not saved their state" if missing else "every rank saved"
            if writing:
                what += f"; round(s) {writing} were still being written"
            return Outcome(
                "incomplete", f"the preemption deadline passed ({what}); the group was killed"
            )
        return None

    def _exited(self, gen: Generation) -> Outcome:
        if len(self.saved) == gen.world_size:
            steps = {s.step for s in self.saved.values()}
            rounds = {s.round for s in self.saved.values()}
            step = max((s for s in steps if s is not None), default=None)
            round_ = rounds.pop() if len(rounds) == 1 else None
            if gen.failures:
                return Outcome("incomplete", "a rank failed while saving", step, None)
            if len(steps) > 1:
                return Outcome("incomplete", f"the ranks stopped at different steps {steps}")
            return Outcome("saved", f"every worker saved its state after step {step}", step, round_)
        if gen.failures:
            failure = next(iter(gen.failures.values()))
            return Outcome("incomplete", f"{failure.message} before the stop step")
        if not self.saved:
            # Whose Done came says which side lost what, should this happen unexpectedly.
            done = f"Done from ranks {sorted(gen.done)} of {gen.world_size}"
            return Outcome("finished", f"every worker finished before the stop step ({done})")
        missing = sorted(set(range(gen.world_size)) - set(self.saved))
        return Outcome("incomplete", f"ranks {missing} exited without saving")
