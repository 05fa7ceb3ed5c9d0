"""The controller's handlers of the elastic states: ``Resizing`` (after a lost worker), and the
in-place moves of ``Running`` below ``max`` (``Growing``) and of a partial preemption
(``Leaving``).

:class:`InPlace` is a part of :class:`~ringtrain.controller.controller.Controller` (its base
class), kept in its own file: these methods execute the plans of the elastic deciders
(:mod:`ringtrain.controller.elastic`, :mod:`ringtrain.controller.leaving`) on the controller's own
state; nothing here is called by anything but the controller.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ringtrain.controller import elastic as plans
from ringtrain.controller import events, leaving
from ringtrain.controller import spares as spare_plans
from ringtrain.controller.attempt import root_cause
from ringtrain.controller.effects import DiscardStaging, Say, Send, Write
from ringtrain.controller.elastic import Rendezvous, ResizePlan
from ringtrain.controller.generation import Generation, Grow
from ringtrain.controller.outputs import RunBook
from ringtrain.controller.policy import Decision, FailureDecision, FailurePolicy
from ringtrain.controller.spares import SpareBook
from ringtrain.controller.states import (
    Growing,
    Leaving,
    Resizing,
    Restarting,
    Running,
    State,
    Transition,
)
from ringtrain.elastic.policy import ElasticAction, ElasticDecision, ElasticPolicy
from ringtrain.launch.base import GrowableGroup, SpareGroup, WorkerGroup
from ringtrain.monitor.progress import ProgressReporter
from ringtrain.result import WorkerFailure
from ringtrain.rundir.schema import ResizeFallbackEvent
from ringtrain.wire.channel import Event, GrowRequest


class InPlace:
    """The elastic handlers of the controller (see the module docstring)."""

    # The controller's state these handlers read and change (Controller.__init__ sets it).
    group: WorkerGroup | None
    elastic: ElasticPolicy | None
    rendezvous: Rendezvous
    spares: SpareBook | None
    book: RunBook
    failure_policy: FailurePolicy
    progress: ProgressReporter
    next_round: int
    world_size: int
    worker_timeout_s: float | None
    apply: Callable[..., None]
    callback: Callable[..., None]
    reset_stragglers: Callable[[], None]
    _take: Callable[..., None]
    _stop: Callable[[State], Transition]
    _stop_requested: Callable[[], bool]

    def _step_resizing(self, state: Resizing, event: Event | None) -> Transition:
        gen = state.generation
        self._take(gen, event, state.plan)
        if self._stop_requested():
            return self._stop(state)
        if gen.all_exited:
            return Transition(state, Restarting(gen, state.failure), "every worker exited")
        assert self.elastic is not None and gen.first_failure_at is not None
        finished = gen.done | {r for r, code in gen.exited.items() if code == 0}
        waited = time.monotonic() - gen.first_failure_at
        ready = self.spares.ready_ids if self.spares is not None else []
        decision = self.elastic.decide(
            gen.world_size, gen.failures, gen.interrupted, finished, waited, spares=len(ready)
        )
        if decision.action is ElasticAction.WAIT:
            return Transition(state, state)  # waiting for the survivors
        if decision.action is ElasticAction.FALLBACK:
            return self._fall_back(state, decision)
        failure = root_cause(list(gen.failures.values()))
        verdict = self.failure_policy.decide(failure, len(self.book.failures) + 1)  # the only ask
        if verdict.decision is Decision.RAISE:
            return self._fall_back(state, decision, verdict.reason, failure, verdict)
        if self._growable() is None:
            why = "not resizing in place: this launcher cannot resize a worker group"
            return self._fall_back(state, decision, why, failure, verdict)
        counters = {
            "generation": self.rendezvous.generation,
            "next_round": self.next_round,
            "failures": len(self.book.failures) + 1,
        }
        if decision.spares:  # hot spares take the lost ranks
            plan = spare_plans.replace(gen, decision, failure, ready, **counters)
        else:
            plan = plans.shrink(gen, decision, failure, **counters)
        try:
            new = self._shrink(gen, plan, failure, state.plan)
        except OSError as exc:
            return self._fall_back(
                state, decision, f"resize in place failed ({exc})", failure, verdict
            )
        return Transition(state, Running(new), decision.reason)

    def _fall_back(
        self,
        state: Resizing,
        decision: ElasticDecision,
        reason: str | None = None,
        failure: WorkerFailure | None = None,
        verdict: FailureDecision | None = None,
    ) -> Transition:
        """Resizing in place cannot be done (``reason``, default the decision's): the group is
        restarted from the disk checkpoint; ``verdict`` is the failure policy's answer when it
        was asked already (about ``failure``)."""
        gen = state.generation
        why = reason or decision.reason
        if decision.stuck and self.group is not None and reason is None:
            self.group.dump_stacks(list(decision.stuck))  # where they are stuck
        gen.elastic_fallback = True
        self.apply(
            [
                Say(f"{why}; restarting the group from the disk checkpoint", warn=True),
                Write(ResizeFallbackEvent(reason=why)),
            ]
        )
        target = Restarting(gen, failure or state.failure, verdict)
        return Transition(state, target, why)

    def _spare_event(self, event: Event) -> bool:
        """Record ``event`` if a hot spare sent it (True), else leave it to the group (False)."""
        if spare_plans.spare_of(self.spares, event) is None:
            return False
        assert self.spares is not None
        self.apply(spare_plans.observe(self.spares, event))
        return True

    def _keep_spares(self, gen: Generation) -> None:
        """Start the hot spares the group lacks, while it trains steadily (after its last
        resize resumed; not after a spare just died: :func:`~ringtrain.controller.spares.
        to_start`)."""
        group = self.group
        steady = gen.resize is None and not gen.interrupted and not gen.exited
        count = spare_plans.to_start(self.spares, steady=steady)
        if count == 0 or not isinstance(group, SpareGroup) or self.spares is None:
            return
        try:
            ids = group.add_spares(count)
        except (OSError, RuntimeError, ValueError) as exc:
            self.spares.retry_at = time.monotonic() + spare_plans.RETRY_MAX_S
            self.apply([Say(f"could not start a hot spare: {exc}", warn=True)])
            return
        spare_plans.started(self.spares, ids)

    def _growable(self) -> GrowableGroup | None:
        """The worker group, when its launcher can resize and grow it in place."""
        group = self.group
        return group if isinstance(group, GrowableGroup) else None

    def _in_place(self, state: Running | Growing | Leaving) -> Transition | None:
        """Elastic runs without a failure in progress: a leave or a grow moves one poll on."""
        gen = state.generation
        if isinstance(state, Leaving):
            members = leaving.staying(gen, state.notice)
            if members is None:
                return None
            cause = f"preemption notice for ranks {sorted(set(state.notice.ranks or ()))}"
            ready = self.spares.ready_ids if self.spares is not None else []
            slots = spare_plans.hand_over(gen, state.notice, ready)  # spares take their places
            joiners = list(slots.values())
            return self._reform(state, gen, joiners, cause, members, state.notice.time, slots)
        if self.elastic is None:
            return None
        self._keep_spares(gen)
        if isinstance(state, Growing):
            return self._grow_step(state)
        paused = plans.paused_members(gen)
        if paused:  # a stale request paused the members: re-form them as they were
            if len(paused) < gen.world_size:
                return None
            return self._reform(state, gen, [], "re-formed after a cancelled grow")
        ranks = plans.grow_ranks(
            self.elastic, gen, self.rendezvous, can_grow=self._growable() is not None
        )
        plan = self._start_joiners(gen, ranks) if ranks else None
        if plan is None:
            return None
        reason = f"capacity returned: starting ranks {plan.ranks} to join"
        return Transition(state, Growing(gen, plan), reason)

    def _start_joiners(self, gen: Generation, ranks: list[int]) -> Grow | None:
        """Start workers to join ``gen``; the plan of the grow, or None (none could start)."""
        group = self._growable()
        assert group is not None and self.elastic is not None
        try:
            started = list(group.grow(ranks))
        except (OSError, RuntimeError, ValueError) as exc:
            self._give_up_grow([], f"could not start workers: {exc}")
            return None
        kept, extra = plans.whole_groups(self.elastic, started)
        if extra:  # grow by whole replica groups only: stop a partial one
            group.discard(extra)
        if not kept:  # no capacity now: look again after elastic_grow_after_s
            self.rendezvous.idle_since = time.monotonic()
            return None
        plan = Grow(kept)
        self.apply(plans.grow_started(gen, plan, self.rendezvous.generation))
        return plan

    def _grow_step(self, state: Growing) -> Transition | None:
        gen, plan = state.generation, state.plan
        step = plans.grow_step(gen, plan, worker_timeout_s=self.worker_timeout_s)
        if step.action == "pause":
            plan.requested = True
            self.apply(
                [Send(tuple(range(gen.world_size)), GrowRequest(self.rendezvous.generation))]
            )
        elif step.action == "give_up":
            self._give_up_grow(step.discard, step.reason)
            return Transition(state, Running(gen), "growing back failed; the group trains on")
        elif step.action == "reform":
            if step.discard:
                self._give_up_grow(step.discard, step.reason)
            return self._reform(
                state, gen, list(step.joiners), step.cause, since=plan.capacity_time
            )
        return None

    def _give_up_grow(self, ranks: Sequence[int], reason: str, *, backoff: bool = True) -> None:
        """Stop the joiners ``ranks`` and say why; the next grow comes after
        ``elastic_grow_after_s`` (doubled per consecutive failure when ``backoff``)."""
        assert self.elastic is not None
        if backoff:
            self.rendezvous.grow_failures += 1
        self.rendezvous.idle_since = time.monotonic()
        delay = self.elastic.grow_delay_s(self.rendezvous.grow_failures)
        self.apply(plans.grow_failed(ranks, reason, delay))

    def _reform(
        self,
        state: Running | Growing | Leaving,
        gen: Generation,
        joiners: list[int],
        cause: str,
        members: list[int] | None = None,
        since: float | None = None,
        slots: dict[int, int] | None = None,
    ) -> Transition:
        """Re-form ``gen``'s paused members (and ``joiners``; hot spares in ``slots``: leaving
        rank -> spare id) into the next generation."""
        plan = plans.reform(
            gen,
            joiners=joiners,
            cause=cause,
            generation=self.rendezvous.generation,
            next_round=self.next_round,
            members=members,
            since=since,
            slots=slots,
        )
        self.apply([DiscardStaging(plan.stale_rounds)])
        new = self._next_generation(gen, plan)
        group = self._growable()
        assert group is not None
        try:
            group.resize(plan.assignment, plan.orders)
        except OSError as exc:  # a connection went away just now: restart from disk
            why = f"growing back failed while re-forming the group ({exc})"
            new.elastic_fallback = True
            failure = WorkerFailure(
                rank=0, kind="exit", message=why, attempt=gen.number, time=time.time()
            )
            self.apply([*events.failed(new, failure), Write(ResizeFallbackEvent(reason=why))])
        else:
            self._resized(gen, plan)
            if self.spares is not None:
                self.apply(spare_plans.promoted(self.spares, plan))
        reason = f"re-formed the group: {gen.world_size} -> {new.world_size} workers ({cause})"
        return Transition(state, Running(new), reason)

    def _shrink(
        self, gen: Generation, plan: ResizePlan, failure: WorkerFailure, grow: Grow | None
    ) -> Generation:
        """Execute a resize after ``failure``: the survivors become the next generation (the
        joiners of ``grow``, a grow under way, are stopped). ``OSError``: a survivor's
        connection is gone (nothing of the run's state changed; the caller falls back)."""
        group = self._growable()
        assert group is not None
        self.apply([DiscardStaging(plan.stale_rounds)])
        if grow is not None:  # workers waiting to join a group that just lost one
            self._give_up_grow(grow.ranks, f"a member was lost ({failure.message})", backoff=False)
        group.resize(plan.assignment, plan.orders)
        self.book.failures.append(failure)
        self.callback("on_failure", failure)
        new = self._next_generation(gen, plan)
        self._resized(gen, plan)
        if self.spares is not None:
            self.apply(spare_plans.promoted(self.spares, plan))
        return new

    def _next_generation(self, gen: Generation, plan: ResizePlan) -> Generation:
        """The re-formed group of ``plan`` (same attempt number as ``gen``; its ``resize`` event
        pending); the world size, the rendezvous generation and the straggler flags follow."""
        new = Generation(gen.number, plan.world_size)
        new.health.resized(time.monotonic())  # a member stuck re-forming it is a hang
        for old, rank in plan.assignment.items():  # who each survivor is, under its new rank
            if old in gen.hosts:
                new.hosts[rank] = gen.hosts[old]
            if old in gen.pids:
                new.pids[rank] = gen.pids[old]
            if old in gen.health.host_silent:
                new.health.host_silent[rank] = gen.health.host_silent[old]
        new.resize = dict(plan.info)
        self.rendezvous.generation = plan.generation
        self.world_size = plan.world_size
        self.reset_stragglers()
        return new

    def _resized(self, gen: Generation, plan: ResizePlan) -> None:
        self.apply([Say(plan.message, warn=plan.warn)])
        for rank in range(plan.world_size, gen.world_size):
            self.progress.worker_state(rank, "stopped")
        for rank in range(plan.world_size):
            self.progress.worker_state(rank, "running")
