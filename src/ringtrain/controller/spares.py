"""The hot-spare deciders (``ScalingConfig(spares=K)``): the driver's book of spare workers and
the plans that promote them, as values the controller executes.

A spare is a joining worker (:meth:`ringtrain.launch.base.SpareGroup.add_spares`) under an id at
or above the world size: it says Hello, pays its start-up costs, says ``JoinReady`` and waits.
:class:`SpareBook` records what the spares said (:func:`observe`); :func:`to_start` says how
many to start now (the group is steady and no spare died just before: a spare that cannot start
must not crash-loop). When a member is lost, :func:`replace` plans the next generation with a
ready spare in the lost rank's place (the survivors keep their ranks; the state comes by
broadcast from a survivor holding the newest recovery point); when a preemption notice names
some members, :func:`hand_over` gives their places to ready spares, and the group re-forms at
the agreed step boundary (:func:`ringtrain.controller.elastic.reform`). None of this holds the
controller; the protocol is in docs/elastic.md ("Hot spares").
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ringtrain.controller.effects import Discard, Effect, Say, Write
from ringtrain.controller.elastic import ResizePlan, membership
from ringtrain.controller.generation import Generation
from ringtrain.elastic.policy import ElasticDecision
from ringtrain.preemption import PreemptionNotice
from ringtrain.result import WorkerFailure
from ringtrain.rundir.schema import SpareEvent
from ringtrain.wire.channel import Event, Exited, Hello, JoinReady, WorkerError

RETRY_MAX_S = 60.0
"""The longest wait before starting a spare again after spares died in a row (seconds)."""


@dataclass
class SpareBook:
    """The spares of the current worker group (reset by every restart of the group).

    Attributes:
        wanted: ``ScalingConfig.spares``.
        started: spare id -> when it was started (``time.monotonic()``).
        ready: spare id -> when it said ``JoinReady`` (monotonic); a subset of ``started``.
        pids: spare id -> its process id (its Hello).
        lost_in_a_row: spares lost before they became ready, since the last one that did.
        retry_at: no spare is started before this monotonic time (after a lost one).
    """

    wanted: int
    started: dict[int, float] = field(default_factory=dict)
    ready: dict[int, float] = field(default_factory=dict)
    pids: dict[int, int] = field(default_factory=dict)
    lost_in_a_row: int = 0
    retry_at: float = 0.0

    def __contains__(self, spare: object) -> bool:
        return spare in self.started

    @property
    def ready_ids(self) -> list[int]:
        """The ready spares, oldest id first (the order they take ranks in)."""
        return sorted(self.ready)


def spare_of(book: SpareBook | None, event: Event) -> int | None:
    """The spare id ``event`` comes from (``None``: not a spare's, or no spares)."""
    rank = getattr(event, "rank", None)
    return rank if book is not None and isinstance(rank, int) and rank in book else None


def observe(book: SpareBook, event: Event) -> list[Effect]:
    """Record an event of a spare (:func:`spare_of` is not None): its Hello, its JoinReady, or
    its loss (an error or an exit before it was promoted: it is discarded, which stops its
    process if an error left it alive); returns what is done, written and said. A spare's loss
    is no failure of the run (it counts toward no ``max_failures``)."""
    spare = getattr(event, "rank", -1)
    now = time.monotonic()
    if isinstance(event, Hello):
        book.pids[spare] = event.pid
        return [Write(SpareEvent(action="started", spare=spare, pid=event.pid))]
    if isinstance(event, JoinReady):
        book.ready[spare] = now
        book.lost_in_a_row = 0
        ready_s = round(now - book.started.get(spare, now), 3)
        return [Write(SpareEvent(action="ready", spare=spare, ready_s=ready_s))]
    if isinstance(event, WorkerError | Exited):
        was_ready = book.ready.pop(spare, None) is not None
        book.started.pop(spare, None)
        if isinstance(event, WorkerError):
            why = f"raised {event.exc_type}: {event.message}"
        elif event.returncode < 0:
            why = f"was killed by signal {-event.returncode}"
        else:
            why = f"exited with status {event.returncode}"
        if not was_ready:
            book.lost_in_a_row += 1
        delay = 0.0 if was_ready else min(RETRY_MAX_S, 2.0 ** (book.lost_in_a_row - 1))
        book.retry_at = now + delay
        reason = f"spare {spare} {why}"
        return [
            Discard((spare,)),  # the group forgets it (its process is gone or going)
            Write(SpareEvent(action="lost", spare=spare, reason=reason, retry_s=delay)),
            Say(f"{reason}; starting another in {delay:g} s", warn=True),
        ]
    return []


def to_start(book: SpareBook | None, *, steady: bool) -> int:
    """How many spares to start now: the missing ones, when the group trains steadily (no
    failure being handled, the last resize resumed) and the back-off after a lost spare is
    over; 0 otherwise."""
    if book is None or not steady or time.monotonic() < book.retry_at:
        return 0
    return max(0, book.wanted - len(book.started))


def started(book: SpareBook, ids: Sequence[int]) -> None:
    """Record the spares ``ids`` the group just started."""
    now = time.monotonic()
    for spare in ids:
        book.started[spare] = now


def promoted(book: SpareBook, plan: ResizePlan) -> list[Effect]:
    """Forget the spares ``plan`` made members; the ``spare`` events saying which rank each
    took."""
    effects: list[Effect] = []
    for old, new in plan.assignment.items():
        if old in book:
            book.started.pop(old, None)
            book.ready.pop(old, None)
            effects.append(Write(SpareEvent(action="promoted", spare=old, rank=new)))
    return effects


def replace(
    gen: Generation,
    decision: ElasticDecision,
    failure: WorkerFailure,
    ready: Sequence[int],
    *,
    generation: int,
    next_round: int,
    failures: int,
) -> ResizePlan:
    """The next generation after ``failure`` when ``decision.spares`` ready spares take lost
    ranks: the survivors keep their ranks, each spare takes a lost rank (lowest first), lost
    ranks without a spare drop out (the others renumbered in order, as a shrink does). Every
    member takes the newest recovery point by broadcast from a survivor that holds it.

    Args:
        gen: the group that lost ranks.
        decision: the policy's RESIZE decision with ``spares > 0``.
        failure: the root cause.
        ready: the ready spares' ids, in the order they take ranks.
        generation: the rendezvous generation of ``gen``; the plan's is one more.
        next_round: the round the new group's next ``report()`` has.
        failures: the run's failures, this one included (for the message).
    """
    assert decision.snapshot_step is not None and decision.spares > 0
    survivors = set(decision.survivors)
    lost = [r for r in range(gen.world_size) if r not in survivors]
    use = dict(zip(lost, ready[: decision.spares], strict=False))
    order = [use.get(r, r) for r in range(gen.world_size) if r in survivors or r in use]
    step = decision.snapshot_step
    holder = min(r for r in survivors if gen.interrupted[r].snapshot_step == step)
    assignment, orders = membership(
        gen, order, order.index(holder), generation + 1, next_round, step
    )
    reached = [i.step for i in gen.interrupted.values() if i.step is not None]
    rolled_back = max(0, max(reached, default=step) - step)
    taken = sorted(assignment[s] for s in use.values())
    info = {
        "old_world_size": gen.world_size,
        "new_world_size": len(order),
        "cause": failure.message,
        "generation": generation + 1,
        "snapshot_step": step,
        "steps_rolled_back": rolled_back,
        "failure_time": failure.time,
        "spare_ranks": taken,
    }
    handed = ", ".join(f"rank {r} to spare {s}" for r, s in use.items())
    message = (
        f"replacing in place: {failure.message}; {handed}; resuming from the recovery point of "
        f"step {step} ({rolled_back} steps); failure {failures}"
    )
    stale = tuple(gen.rounds.open_rounds())
    return ResizePlan(generation + 1, assignment, orders, info, stale, message, warn=True)


def hand_over(gen: Generation, notice: PreemptionNotice, ready: Sequence[int]) -> dict[int, int]:
    """The places ready spares take from the members a partial preemption ``notice`` names:
    leaving rank -> spare id (lowest ranks first; ``{}``: no spare ready)."""
    leaving = sorted(set(notice.ranks or ()) & set(range(gen.world_size)))
    return dict(zip(leaving, ready, strict=False))
