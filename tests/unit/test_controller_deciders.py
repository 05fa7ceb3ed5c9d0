"""The controller's deciders as values: each takes facts (a generation's book-keeping, an event,
a policy) and returns effects or a plan; none is given the Controller (the import contract in
pyproject.toml forbids them to import it). These tests compare what they return."""

from __future__ import annotations

import time

from ringtrain.controller import elastic as plans
from ringtrain.controller import events, leaving
from ringtrain.controller.effects import (
    DumpStacks,
    Notify,
    Publish,
    RankMetrics,
    RoundDone,
    Say,
    Send,
    Show,
    Write,
)
from ringtrain.controller.generation import Generation, Grow
from ringtrain.controller.preempting import Outcome, Preemption
from ringtrain.controller.states import Finished, Preempted, Preempting
from ringtrain.elastic.policy import ElasticAction, ElasticDecision, ElasticPolicy
from ringtrain.preemption import PreemptionNotice
from ringtrain.result import WorkerFailure
from ringtrain.rundir.schema import FailureEvent, PreemptionIncompleteEvent, ReportEvent
from ringtrain.wire.channel import (
    CheckpointDone,
    Exited,
    GrowRequest,
    Interrupted,
    JoinReady,
    Report,
    WorkerError,
)


def _report(rank: int, round_: int, **metrics: float) -> Report:
    return Report(rank=rank, round=round_, time=1.0, metrics=dict(metrics))


def test_a_report_is_recorded_and_its_round_completes_with_the_last_rank():
    gen = Generation(0, 2)
    first = events.handle(gen, _report(0, 0, loss=1.0), generation=0, grow=None)
    assert [type(e) for e in first] == [RankMetrics, Write, Show, Notify]
    assert isinstance(first[1].record, ReportEvent) and first[1].record.rank == 0
    second = events.handle(gen, _report(1, 0, loss=2.0), generation=0, grow=None)
    assert RoundDone(0, {"loss": 1.0}) in second  # rank 0's metrics are the round's
    assert Notify("on_round", (0, {"loss": 1.0})) in second
    assert not any(isinstance(e, Publish) for e in second)  # no checkpoint in this round
    assert gen.last_round(1) == 0


def test_a_checkpoint_write_outcome_asks_for_publication():
    gen = Generation(0, 1)
    done = CheckpointDone(rank=0, round=3, files={"a.pt": {}})
    assert events.handle(gen, done, generation=0, grow=None) == [Publish(3)]


def test_an_exception_is_kept_over_the_exit_status_that_follows_it():
    gen = Generation(0, 2)
    error = WorkerError(rank=1, time=1.0, exc_type="ValueError", message="bad", traceback="tb")
    effects = events.handle(gen, error, generation=0, grow=None)
    assert Show("worker_state", (1, "failed")) in effects
    record = next(e.record for e in effects if isinstance(e, Write))
    assert isinstance(record, FailureEvent) and record.kind == "exception"
    assert events.handle(gen, Exited(1, 2.0, 1), generation=0, grow=None) == []
    assert gen.failures[1].kind == "exception" and gen.first_failure_at is not None


def test_a_joiners_events_go_to_the_grow_plan_not_the_members():
    gen, plan = Generation(0, 2), Grow([2])
    assert events.handle(gen, JoinReady(rank=2, time=1.0), generation=1, grow=plan) == []
    assert plan.ready == {2}
    events.handle(gen, Exited(2, 1.0, -9), generation=1, grow=plan)
    assert plan.dead == {2: "joining rank 2 was killed by SIGKILL"} and not gen.failures


def test_a_stale_interrupted_of_an_older_generation_is_ignored():
    gen = Generation(0, 2)
    old = Interrupted(
        rank=0, time=1.0, exc_type="E", message="m", snapshot_step=1, step=1,
        generation=0, grow=False,
    )  # fmt: skip
    events.handle(gen, old, generation=1, grow=None)
    assert gen.interrupted == {} and gen.first_failure_at is None


def test_a_hang_asks_for_the_stacks_before_the_failure():
    gen = Generation(0, 2)
    gen.health.started_at -= 100
    now = time.monotonic()
    for rank in range(2):
        gen.health.seen(rank, now)
        gen.health.progressed(rank, now - (10 if rank == 1 else 0))
    effects = events.hang(gen, 5.0)
    assert effects[0] == DumpStacks((1,))
    assert gen.failures[1].kind == "hang"
    assert events.hang(gen, None) == []


def _paused_gen(world: int, steps: dict[int, int], grow: bool = True) -> Generation:
    gen = Generation(0, world)
    for rank, step in steps.items():
        gen.interrupted[rank] = Interrupted(
            rank=rank, time=1.0, exc_type="E", message="m", snapshot_step=step, step=step,
            generation=0, grow=grow,
        )  # fmt: skip
    return gen


def test_a_shrink_plan_renumbers_the_survivors_and_names_the_rollback():
    gen = _paused_gen(3, {0: 4, 1: 5}, grow=False)
    decision = ElasticDecision(
        ElasticAction.RESIZE, "resizing in place: 3 -> 2 workers (lost ranks [2])",
        survivors=(0, 1), source=1, snapshot_step=5,
    )  # fmt: skip
    failure = WorkerFailure(rank=2, kind="signal", message="rank 2 was killed by SIGKILL")
    plan = plans.shrink(gen, decision, failure, generation=0, next_round=7, failures=1)
    assert plan.generation == 1 and plan.assignment == {0: 0, 1: 1} and plan.world_size == 2
    assert {o.rank for o in plan.orders.values()} == {0, 1}
    assert all(o.start_round == 7 and o.source_rank == 1 for o in plan.orders.values())
    assert plan.info["steps_rolled_back"] == 0 and plan.warn
    assert plan.message.endswith("rolling back to the snapshot of step 5 (0 steps); failure 1")


def test_a_reform_plan_adds_the_joiners_after_the_members_and_takes_the_newest_snapshot():
    gen = _paused_gen(2, {0: 6, 1: 6})
    plan = plans.reform(gen, joiners=[2], cause="capacity returned", generation=1, next_round=3)
    assert plan.assignment == {0: 0, 1: 1, 2: 2} and plan.generation == 2
    assert plan.orders[2].source_rank == 0 and plan.orders[2].snapshot_step == 6
    assert plan.message == (
        "growing back in place: 2 -> 3 workers (capacity returned); joining at the snapshot of "
        "step 6"
    )
    leave = plans.reform(gen, joiners=[], cause="x", generation=1, next_round=3, members=[1])
    assert leave.assignment == {1: 0} and leave.world_size == 1


def test_grow_steps():
    gen = _paused_gen(2, {})
    plan = Grow([2])
    assert plans.grow_step(gen, plan, worker_timeout_s=None).action == "wait"
    plan.ready.add(2)
    assert plans.grow_step(gen, plan, worker_timeout_s=None).action == "pause"
    plan.requested = True
    assert plans.grow_step(gen, plan, worker_timeout_s=None).action == "wait"  # not paused yet
    paused = _paused_gen(2, {0: 3, 1: 3})
    step = plans.grow_step(paused, plan, worker_timeout_s=None)
    assert (step.action, step.joiners, step.cause) == ("reform", (2,), "capacity returned")
    dead = Grow([2])
    dead.dead[2] = "joining rank 2 exited with status 1"
    step = plans.grow_step(gen, dead, worker_timeout_s=None)
    assert (step.action, step.discard, step.reason) == (
        "give_up",
        (2,),
        "joining rank 2 exited with status 1",
    )


def test_leaving_is_refused_with_the_reason():
    policy = ElasticPolicy(2, 3)
    gen = Generation(0, 3)
    partial = PreemptionNotice(time=1.0, ranks=(2,))
    assert leaving.refusal(policy, gen, partial, can_resize=True) is None
    assert leaving.refusal(None, gen, partial, can_resize=True) == "the run is not elastic"
    two = PreemptionNotice(time=1.0, ranks=(1, 2))
    assert "fewer than min_workers=2" in leaving.refusal(policy, gen, two, can_resize=True)
    assert "cannot resize" in leaving.refusal(policy, gen, partial, can_resize=False)
    reason, effects = leaving.start(gen, partial, generation=0, grace_s=30.0, min_workers=2)
    assert effects[0] == Send((0, 1, 2), GrowRequest(0))
    assert reason.startswith("preemption notice for ranks [2]")
    assert leaving.staying(gen, partial) is None
    assert leaving.staying(_paused_gen(3, {0: 1, 1: 1, 2: 1}), partial) == [0, 1]


def test_preemption_outcomes_become_terminal_states_with_their_events():
    preemption = Preemption()
    notice = PreemptionNotice(time=1.0, deadline_s=60)
    state = Preempting(Generation(0, 2), notice, deadline=0.0)
    target, reason, effects = preemption.end(state, Outcome("finished", "all done"), None)
    assert (target, reason, effects) == (Finished(), "all done", [])
    target, reason, effects = preemption.end(
        state, Outcome("incomplete", "the deadline passed"), "runs/x/checkpoint_000003"
    )
    assert isinstance(target, Preempted)
    assert reason == "the deadline passed; a resume starts from runs/x/checkpoint_000003"
    assert isinstance(effects[0].record, PreemptionIncompleteEvent)
    assert effects[1] == Say(reason, warn=True, log_prefix="preemption: ")
