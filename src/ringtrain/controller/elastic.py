"""The elastic deciders (``ScalingConfig(num_workers=(min, max))``): plans for re-forming a
worker group in place, as values the controller executes.

- After a lost worker (the ``Resizing`` state), :func:`shrink` plans the group of the survivors
  that the :class:`~ringtrain.elastic.policy.ElasticPolicy` chose (ranks renumbered in order,
  every member resuming from one in-memory snapshot).
- When capacity returns (``Running`` below ``max``), :func:`grow_ranks` says which workers to
  start; the ``Growing`` state then carries the :class:`~ringtrain.controller.generation.Grow`
  plan, and :func:`grow_step` says what to do at each poll: wait, ask the members to pause at
  their next step boundary, give up, or re-form the group with the joiners (:func:`reform`).
- A partial preemption notice (the ``Leaving`` state, :mod:`ringtrain.controller.leaving`) ends
  with :func:`reform` too, without the leaving ranks.

Each function takes the facts it needs (the policy, the group's
:class:`~ringtrain.controller.generation.Generation`, the rendezvous counters) and returns a
value; none holds the controller. The protocol is in docs/elastic.md and
:mod:`ringtrain.elastic.worker`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ringtrain.controller.effects import Discard, Effect, Say, Write
from ringtrain.controller.generation import Generation, Grow
from ringtrain.controller.health import HELLO_TIMEOUT_S
from ringtrain.elastic.policy import ElasticDecision, ElasticPolicy
from ringtrain.result import WorkerFailure
from ringtrain.rundir.schema import GrowFailedEvent, GrowStartEvent
from ringtrain.wire.channel import Resize


@dataclass
class Rendezvous:
    """An elastic run's counters, owned by the controller and reset by every (re)start.

    Attributes:
        generation: the rendezvous generation of the worker group (0 for fresh processes, +1
            per resize or grow).
        grow_failures: consecutive grows whose joining workers failed (the back-off of
            :meth:`~ringtrain.elastic.policy.ElasticPolicy.grow_delay_s`).
        idle_since: since when (monotonic seconds) the group has been below ``max`` without
            trying to grow (``None``: it is not below, or a grow is under way).
    """

    generation: int = 0
    grow_failures: int = 0
    idle_since: float | None = None


@dataclass(frozen=True)
class ResizePlan:
    """One re-forming of the group in place, ready to execute.

    Attributes:
        generation: the new rendezvous generation.
        assignment: old rank -> new rank, for every member of the new group.
        orders: old rank -> the :class:`~ringtrain.wire.channel.Resize` it is sent.
        info: the new generation's ``resize`` event, written once its first step completes.
        stale_rounds: rounds some rank never reported or still wrote: their staging
            directories can never be published.
        message: one line for the log and the display.
        warn: ``message`` is a warning (a failure caused the resize).
    """

    generation: int
    assignment: dict[int, int]
    orders: dict[int, Resize]
    info: dict[str, Any] = field(repr=False)
    stale_rounds: tuple[int, ...]
    message: str
    warn: bool = False

    @property
    def world_size(self) -> int:
        return len(self.assignment)


def membership(
    gen: Generation,
    order: Sequence[int],
    source: int | None,
    generation: int,
    start_round: int,
    snapshot_step: int,
) -> tuple[dict[int, int], dict[int, Resize]]:
    """The next generation's membership: old rank -> new rank (``order`` lists the old ranks in
    new-rank order) and the :class:`Resize` each member is sent."""
    assignment = {old: new for new, old in enumerate(order)}
    orders = {
        old: Resize(
            generation=generation,
            world_size=len(order),
            rank=new,
            store_prefix=f"ringtrain/elastic/{gen.number}/{generation}/",
            source_rank=source,
            start_round=start_round,
            snapshot_step=snapshot_step,
        )
        for old, new in assignment.items()
    }
    return assignment, orders


def shrink(
    gen: Generation,
    decision: ElasticDecision,
    failure: WorkerFailure,
    *,
    generation: int,
    next_round: int,
    failures: int,
) -> ResizePlan:
    """The group of ``decision``'s survivors after ``failure`` (a RESIZE decision), without
    restarting a process.

    Args:
        gen: the group that lost a rank.
        decision: the policy's RESIZE decision (survivors in new-rank order, the snapshot step
            and the rank whose snapshot all take).
        failure: the root cause.
        generation: the rendezvous generation of ``gen``; the plan's is one more.
        next_round: the round the new group's next ``report()`` has.
        failures: the run's failures, this one included (for the message).
    """
    assert decision.snapshot_step is not None
    new_generation = generation + 1
    assignment, orders = membership(
        gen, decision.survivors, decision.source, new_generation, next_round, decision.snapshot_step
    )
    reached = [i.step for i in gen.interrupted.values() if i.step is not None]
    reached += [s for s in gen.health.last_step.values() if s is not None]
    rolled_back = max(0, max(reached, default=decision.snapshot_step) - decision.snapshot_step)
    info = {
        "old_world_size": gen.world_size,
        "new_world_size": len(decision.survivors),
        "cause": failure.message,
        "generation": new_generation,
        "snapshot_step": decision.snapshot_step,
        "steps_rolled_back": rolled_back,
        "failure_time": failure.time,
    }
    message = (
        f"{decision.reason}: {failure.message}; rolling back to the snapshot of step "
        f"{decision.snapshot_step} ({rolled_back} steps); failure {failures}"
    )
    # Rounds some rank never reported are gone; a round whose files the lost rank owed can never
    # be published (survivors finished their writes before saying Interrupted).
    stale = tuple(gen.rounds.open_rounds())
    return ResizePlan(new_generation, assignment, orders, info, stale, message, warn=True)


def reform(
    gen: Generation,
    *,
    joiners: Sequence[int],
    cause: str,
    generation: int,
    next_round: int,
    members: Sequence[int] | None = None,
    since: float | None = None,
    slots: dict[int, int] | None = None,
) -> ResizePlan:
    """Make the paused ``members`` (default: all, ranks kept; else renumbered in order) and
    ``joiners`` (numbered after them) the next generation: the joiners (and members with an
    older snapshot) take the newest snapshot by broadcast from a member; the paused ranks not in
    ``members`` are stopped (a leave).

    Args:
        gen: the group whose members all paused at a step boundary.
        joiners: the ranks of the workers started to join, ready.
        cause: why (for the message and the ``resize`` event).
        generation: the rendezvous generation of ``gen``; the plan's is one more.
        next_round: the round the new group's next ``report()`` has.
        members: the members that stay (``None``: all).
        since: when the cause arose (Unix seconds; default: now).
        slots: hot spares taking leaving members' places (leaving rank -> spare id, the spares
            among ``joiners``): the spare gets that rank and the members keep theirs.
    """
    old_world = gen.world_size
    kept = list(range(old_world)) if members is None else list(members)
    steps = {r: gen.interrupted[r].snapshot_step for r in kept}
    held = [s for s in steps.values() if s is not None]
    newest = max(held) if held else None
    order = kept + list(joiners)
    if slots:  # a hot spare takes each leaving rank's place (ringtrain.controller.spares)
        order = [slots.get(r, r) for r in range(old_world) if r in kept or r in slots]
    source = None
    if newest is not None and (joiners or len(set(steps.values())) > 1):
        source = order.index(min(r for r in kept if steps[r] == newest))
    new_generation = generation + 1
    assignment, orders = membership(
        gen, order, source, new_generation, next_round, newest if newest is not None else -1
    )
    reached = [i.step for i in gen.interrupted.values() if i.step is not None]
    rolled_back = max(0, max(reached, default=newest or 0) - (newest or 0))
    pauses = [gen.interrupted[r].time for r in kept if gen.interrupted[r].grow]
    info = {
        "old_world_size": old_world,
        "new_world_size": len(order),
        "cause": cause,
        "generation": new_generation,
        "snapshot_step": newest,
        "steps_rolled_back": rolled_back,
        "failure_time": since if since is not None else time.time(),
        "pause_time": min(pauses, default=time.time()),
    }
    if slots:
        info["spare_ranks"] = sorted(assignment[s] for s in slots.values())
    message = (
        f"{'growing back' if len(order) > old_world else 'resizing'} in place: {old_world} -> "
        f"{len(order)} workers ({cause}); joining at the snapshot of step {newest}"
    )
    stale = tuple(gen.rounds.open_rounds())
    return ResizePlan(new_generation, assignment, orders, info, stale, message)


def paused_members(gen: Generation) -> list[int]:
    """The members of ``gen`` that paused at a step boundary when asked (a grow or a leave)."""
    return [r for r, i in gen.interrupted.items() if i.grow and r < gen.world_size]


def grow_ranks(
    policy: ElasticPolicy, gen: Generation, rendezvous: Rendezvous, *, can_grow: bool
) -> list[int]:
    """The workers to start now so that ``gen`` grows back to ``max`` (``[]``: not now: the group
    is not idle below max long enough, is finishing or re-forming, or cannot grow in place)."""
    if (
        rendezvous.idle_since is None
        or gen.resize is not None  # the last resize has not resumed yet
        or gen.done
        or gen.exited
        or not can_grow
    ):
        return []
    return policy.grow_ranks(
        gen.world_size, time.monotonic() - rendezvous.idle_since, rendezvous.grow_failures
    )


def whole_groups(policy: ElasticPolicy, started: Sequence[int]) -> tuple[list[int], list[int]]:
    """The started joiners cut to whole replica groups: ``(kept, extra)``; the extra ones are
    stopped (a group grows by whole replica groups only)."""
    cut = len(started) - len(started) % policy.replica_group_size
    return list(started[:cut]), list(started[cut:])


def grow_started(gen: Generation, plan: Grow, generation: int) -> list[Effect]:
    """What is said when ``plan``'s workers were started to join ``gen``."""
    started, world = plan.ranks, gen.world_size
    return [
        Say(
            f"growing back: starting {len(started)} worker(s) (ranks {started}) to grow "
            f"{world} -> {world + len(started)}; the members pause at their next step boundary "
            "once the new workers are up"
        ),
        Write(GrowStartEvent(old_world_size=world, ranks=started, generation=generation)),
    ]


@dataclass(frozen=True)
class GrowStep:
    """What :func:`grow_step` decided for a grow in progress.

    ``action``: ``"wait"`` (nothing now), ``"pause"`` (every joiner is ready: ask the members to
    pause at their next step boundary), ``"give_up"`` (stop the joiners ``discard``; ``reason``
    says why), or ``"reform"`` (every member paused: re-form the group with ``joiners``, for
    ``cause``; the dead joiners ``discard`` are given up first, for ``reason``).
    """

    action: str
    reason: str = ""
    joiners: tuple[int, ...] = ()
    discard: tuple[int, ...] = ()
    cause: str = ""


def grow_step(gen: Generation, plan: Grow, *, worker_timeout_s: float | None) -> GrowStep:
    """One poll of the ``Growing`` state (no failure in ``gen``)."""
    why_dead = "; ".join(plan.dead[r] for r in sorted(plan.dead))
    if plan.dead and not plan.requested:
        return GrowStep("give_up", why_dead, discard=tuple(plan.ranks))
    if not plan.requested:
        if set(plan.ranks) <= plan.ready:
            return GrowStep("pause")
        if time.monotonic() - plan.started_at > max(HELLO_TIMEOUT_S, worker_timeout_s or 0):
            waiting = sorted(set(plan.ranks) - plan.ready)
            return GrowStep(
                "give_up",
                f"ranks {waiting} did not get ready to join in time",
                discard=tuple(plan.ranks),
            )
        return GrowStep("wait")
    if len(paused_members(gen)) < gen.world_size:
        return GrowStep("wait")
    joiners = tuple(r for r in plan.ranks if r not in plan.dead)
    cause = (
        "capacity returned"
        if joiners
        else f"re-formed after the joining workers failed ({why_dead})"
    )
    dead = tuple(sorted(plan.dead))
    return GrowStep("reform", why_dead, joiners=joiners, discard=dead, cause=cause)


def grow_failed(ranks: Sequence[int], reason: str, delay_s: float | None) -> list[Effect]:
    """What is done and said when a grow is given up (its ``ranks`` stopped); the next try
    comes after ``delay_s`` (``None``: never)."""
    effects: list[Effect] = [Discard(tuple(ranks))] if ranks else []
    return [
        *effects,
        Say(f"growing back failed: {reason}; {_retry(delay_s)}", warn=True),
        Write(GrowFailedEvent(reason=reason, ranks=list(ranks), retry_s=delay_s)),
    ]


def _retry(delay_s: float | None) -> str:
    return "not trying again" if delay_s is None else f"trying again in {delay_s:g} s"
