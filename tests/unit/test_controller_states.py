"""The controller's state machine, one ``step()`` at a time, against a scripted fake group (no
processes): each test checks the Transition (from, to, reason) and the ``transition`` event."""

from __future__ import annotations

import threading
import time

import pytest

from fakes import FakeGroup, FakeLauncher
from fakes import HeartbeatGroup as _HeartbeatGroup
from fakes import controller_events as _events
from fakes import make_controller as _controller
from ringtrain.config import FailureConfig
from ringtrain.controller.policy import FailurePolicy
from ringtrain.controller.states import (
    Growing,
    Leaving,
    PreemptionNotice,
    Resizing,
    Restarting,
    Running,
    RunState,
    Starting,
    Transition,
)
from ringtrain.elastic.policy import ElasticPolicy
from ringtrain.wire.channel import Exited, Hello, Interrupted, JoinReady, Resumed

pytestmark = pytest.mark.timeout(60)


def _assert_written(tmp_path, t: Transition) -> None:
    """``t`` is the last transition written to events.jsonl, with its reason."""
    last = [e for e in _events(tmp_path) if e["type"] == "transition"][-1]
    assert (last["from"], last["to"], last["reason"]) == (t.from_.value, t.to.value, t.reason)


def _started(ctl, tmp_path) -> Transition:
    t = ctl.step()
    assert (t.from_, t.to) == (RunState.STARTING, RunState.RUNNING)
    assert t.reason == "started 2 workers (attempt 0)"
    assert isinstance(t.target, Running) and t.target.generation.world_size == 2
    _assert_written(tmp_path, t)
    return t


def test_start_then_running_then_finished(tmp_path):
    ctl = _controller(tmp_path, FakeLauncher([[]]))
    assert ctl.state is RunState.STARTING and isinstance(ctl.current, Starting)
    _started(ctl, tmp_path)
    stay = ctl.step(Hello(0, 10, "h"))
    assert not stay.changed and stay.to is RunState.RUNNING
    assert not ctl.step(Exited(0, 1.0, 0)).changed
    t = ctl.step(Exited(1, 1.0, 0))
    assert (t.from_, t.to, t.reason) == (
        RunState.RUNNING,
        RunState.FINISHED,
        "every worker finished",
    )
    _assert_written(tmp_path, t)
    assert ctl.launcher.groups[0].stopped and ctl.group is None


def test_failure_restarts_then_starts_the_next_attempt(tmp_path):
    ctl = _controller(tmp_path, FakeLauncher([[], []]), max_failures=1)
    _started(ctl, tmp_path)
    t = ctl.step(Exited(1, 1.0, -9))
    assert (t.from_, t.to, t.reason) == (
        RunState.RUNNING,
        RunState.RESTARTING,
        "rank 1 was killed by SIGKILL",
    )
    assert isinstance(t.target, Restarting) and t.target.failure.rank == 1
    _assert_written(tmp_path, t)
    t = ctl.step()  # failure_grace_s=0: drained at once, the policy decides
    assert (t.from_, t.to) == (RunState.RESTARTING, RunState.STARTING)
    assert t.reason == "restarting: rank 1 was killed by SIGKILL; failure 1 of max_failures=1"
    assert isinstance(t.target, Starting) and t.target.attempt == 1
    _assert_written(tmp_path, t)
    assert ctl.launcher.groups[0].stopped
    t = ctl.step()
    assert (t.to, t.reason) == (RunState.RUNNING, "started 2 workers (attempt 1)")


def test_max_failures_exhausted_is_errored(tmp_path):
    ctl = _controller(tmp_path, FakeLauncher([[]]), max_failures=0)
    _started(ctl, tmp_path)
    assert ctl.step(Exited(1, 1.0, -9)).to is RunState.RESTARTING
    t = ctl.step()
    assert (t.from_, t.to) == (RunState.RESTARTING, RunState.ERRORED)
    assert t.reason == "stopping: rank 1 was killed by SIGKILL; failure 1 exceeds max_failures=0"
    _assert_written(tmp_path, t)
    assert ctl.error is not None and ctl.error.rank == 1
    decision = [e for e in _events(tmp_path) if e["type"] == "decision"]
    assert [d["decision"] for d in decision] == ["raise"]


def test_a_hang_fails_the_rank_and_restarts(tmp_path):
    hung = _HeartbeatGroup(2, lambda rank, elapsed: 0.0 if rank == 0 else elapsed, guard_s=30)
    ctl = _controller(tmp_path, FakeLauncher([hung, []]), max_failures=1, worker_timeout_s=0.3)
    _started(ctl, tmp_path)
    deadline = time.monotonic() + 20
    t = ctl.step()
    while not t.changed and time.monotonic() < deadline:
        t = ctl.step()
    assert (t.from_, t.to) == (RunState.RUNNING, RunState.RESTARTING)
    assert t.reason.startswith("rank 1 made no progress for ")
    assert "beyond worker_timeout_s=0.3" in t.reason
    _assert_written(tmp_path, t)
    t = ctl.step()
    assert t.to is RunState.STARTING and t.reason.startswith("restarting: rank 1 made no progress")


def test_stop_requested_is_stopped(tmp_path):
    stop = threading.Event()
    ctl = _controller(tmp_path, FakeLauncher([[]]), stop_event=stop)
    _started(ctl, tmp_path)
    assert not ctl.step().changed
    stop.set()
    t = ctl.step()
    assert (t.from_, t.to, t.reason) == (
        RunState.RUNNING,
        RunState.STOPPED,
        "stop requested after round -1",
    )
    _assert_written(tmp_path, t)
    assert ctl.launcher.groups[0].stopped and ctl.state.terminal


def test_a_preemption_notice_stops_the_group_and_ends_preempted(tmp_path):
    ctl = _controller(tmp_path, FakeLauncher([[]]))
    _started(ctl, tmp_path)
    t = ctl.step(PreemptionNotice(time=1.0, deadline_s=120, reason="spot reclaim"))
    assert (t.from_, t.to, t.reason) == (
        RunState.RUNNING,
        RunState.PREEMPTING,
        "preemption notice: the workers go in 120 s (spot reclaim)",
    )
    _assert_written(tmp_path, t)
    t = ctl.step()
    assert (t.from_, t.to) == (RunState.PREEMPTING, RunState.PREEMPTED)
    _assert_written(tmp_path, t)
    assert ctl.launcher.groups[0].stopped


class ElasticGroup(FakeGroup):
    """A FakeGroup that can resize, grow, discard and send, recording each call."""

    def __init__(self, world_size):
        super().__init__(world_size, [])
        self.calls = []

    def resize(self, assignment, orders):
        self.calls.append(("resize", dict(assignment)))

    def grow(self, ranks):
        self.calls.append(("grow", list(ranks)))
        return list(ranks)

    def discard(self, ranks):
        self.calls.append(("discard", list(ranks)))

    def send(self, rank, message):
        self.calls.append(("send", rank))


def _paused(rank, generation, step, grow):
    return Interrupted(
        rank=rank, time=2.0, exc_type="E", message="m", snapshot_step=step,
        step=step, generation=generation, grow=grow,
    )  # fmt: skip


def _elastic_controller(tmp_path, group, **policy):
    """A controller over ``group`` (3 workers, elastic between 2 and 3), already RUNNING."""
    ctl = _controller(
        tmp_path,
        FakeLauncher([group]),
        world_size=3,
        max_failures=3,
        elastic=ElasticPolicy(2, 3, **policy),
    )
    assert ctl.step().to is RunState.RUNNING
    return ctl


def test_elastic_rank_lost_resizes_then_grows_back(tmp_path):
    group = ElasticGroup(3)
    ctl = _elastic_controller(tmp_path, group, grow_after_s=0.0)
    t = ctl.step(Exited(2, 1.0, -9))
    assert (t.from_, t.to) == (RunState.RUNNING, RunState.RESIZING)
    assert t.reason == "rank 2 was killed by SIGKILL; resizing in place"
    assert isinstance(t.target, Resizing) and t.target.failure.rank == 2
    _assert_written(tmp_path, t)
    assert not ctl.step(_paused(0, 0, 3, grow=False)).changed  # waiting for rank 1
    t = ctl.step(_paused(1, 0, 3, grow=False))
    assert (t.from_, t.to) == (RunState.RESIZING, RunState.RUNNING)
    assert isinstance(t.target, Running) and t.target.generation.world_size == 2
    assert "2 of 3" in t.reason or t.reason  # the ElasticPolicy's own words
    _assert_written(tmp_path, t)
    assert group.calls[0] == ("resize", {0: 0, 1: 1})
    assert ctl.world_size == 2 and ctl.generation == 1 and len(ctl.failures) == 1

    # Training resumed below max: with grow_after_s=0 a worker is started to join at once.
    t = ctl.step(Resumed(rank=0, time=1.5, generation=1, step=4))
    assert (t.from_, t.to) == (RunState.RUNNING, RunState.GROWING)
    assert t.reason == "capacity returned: starting ranks [2] to join"
    assert isinstance(t.target, Growing) and t.target.plan.ranks == [2]
    _assert_written(tmp_path, t)
    assert not ctl.step(JoinReady(rank=2, time=2.0)).changed  # -> GrowRequest to the members
    assert [c for c in group.calls if c[0] == "send"] == [("send", 0), ("send", 1)]
    assert not ctl.step(_paused(0, 1, 6, grow=True)).changed
    t = ctl.step(_paused(1, 1, 6, grow=True))
    assert (t.from_, t.to) == (RunState.GROWING, RunState.RUNNING)
    assert t.reason == "re-formed the group: 2 -> 3 workers (capacity returned)"
    _assert_written(tmp_path, t)
    assert group.calls[-1] == ("resize", {0: 0, 1: 1, 2: 2})
    assert ctl.world_size == 3 and ctl.generation == 2


def test_survivors_that_never_report_the_lost_peer_are_asked_for_their_stacks(tmp_path):
    # wait_s=0: the first check after rank 2's loss finds ranks 0 and 1 silent and gives up on
    # resizing in place; before the restart, they are asked where they are stuck.
    group = ElasticGroup(3)
    ctl = _elastic_controller(tmp_path, group, wait_s=0.0)
    assert ctl.step(Exited(2, 1.0, -9)).to is RunState.RESIZING
    assert group.dumped == []
    t = ctl.step()  # a poll: nothing came
    assert "ranks [0, 1] did not report a lost peer within 0 s" in t.reason
    assert t.to is RunState.RESTARTING and group.dumped == [0, 1]


def test_transitions_of_a_whole_run_are_written_in_order(tmp_path):
    launcher = FakeLauncher([[[Exited(1, 1.0, -9)]], [[Exited(0, 2.0, 0), Exited(1, 2.0, 0)]]])
    ctl = _controller(tmp_path, launcher, max_failures=1)
    ctl.run()
    path = [(e["from"], e["to"]) for e in _events(tmp_path) if e["type"] == "transition"]
    assert path == [
        ("STARTING", "RUNNING"),
        ("RUNNING", "RESTARTING"),
        ("RESTARTING", "STARTING"),
        ("STARTING", "RUNNING"),
        ("RUNNING", "FINISHED"),
    ]


def test_ctrl_c_in_any_state_is_aborted(tmp_path):
    class Interrupting(FakeGroup):
        def poll(self, timeout_s):
            raise KeyboardInterrupt

    ctl = _controller(tmp_path, FakeLauncher([Interrupting(2, [])]))
    with pytest.raises(KeyboardInterrupt):
        ctl.run()
    assert ctl.state is RunState.ABORTED
    last = [e for e in _events(tmp_path) if e["type"] == "transition"][-1]
    assert (last["from"], last["to"], last["reason"]) == (
        "RUNNING",
        "ABORTED",
        "KeyboardInterrupt()",
    )
    assert ctl.launcher.groups[0].stopped


def test_a_partial_notice_is_a_leaving_state_that_re_forms_without_the_leaving_ranks(tmp_path):
    group = ElasticGroup(3)
    ctl = _elastic_controller(tmp_path, group)
    notice = PreemptionNotice(time=1.0, deadline_s=60, reason="node drain", ranks=(2,))
    t = ctl.step(notice)
    assert (t.from_, t.to) == (RunState.RUNNING, RunState.LEAVING)
    assert isinstance(t.target, Leaving) and t.target.notice is notice
    assert t.reason.startswith("preemption notice for ranks [2] (node drain): they leave")
    _assert_written(tmp_path, t)
    assert [c for c in group.calls if c[0] == "send"] == [("send", 0), ("send", 1), ("send", 2)]
    assert not ctl.step(_paused(0, 0, 5, grow=True)).changed
    assert not ctl.step(_paused(1, 0, 5, grow=True)).changed  # rank 2 has not paused yet
    t = ctl.step(_paused(2, 0, 5, grow=True))
    assert (t.from_, t.to) == (RunState.LEAVING, RunState.RUNNING)
    assert t.reason == "re-formed the group: 3 -> 2 workers (preemption notice for ranks [2])"
    _assert_written(tmp_path, t)
    assert group.calls[-1] == ("resize", {0: 0, 1: 1})
    assert ctl.world_size == 2 and ctl.generation == 1 and ctl.failures == []
    preemptions = [e for e in _events(tmp_path) if e["type"] == "preemption"]
    assert [p["ranks"] for p in preemptions] == [[2]]


def test_a_failure_while_leaving_ends_the_leave_and_resizes(tmp_path):
    group = ElasticGroup(3)
    ctl = _elastic_controller(tmp_path, group)
    t = ctl.step(PreemptionNotice(time=1.0, deadline_s=60, reason="drain", ranks=(2,)))
    assert t.to is RunState.LEAVING
    t = ctl.step(Exited(0, 1.0, -9))
    assert (t.from_, t.to) == (RunState.LEAVING, RunState.RESIZING)
    assert t.reason == "rank 0 was killed by SIGKILL; resizing in place"


class CountingPolicy(FailurePolicy):
    """A FailurePolicy that counts how often it is asked."""

    def __init__(self, max_failures):
        super().__init__(FailureConfig(max_failures=max_failures))
        self.asked = []

    def decide(self, failure, failures_so_far):
        self.asked.append((failure.rank, failures_so_far))
        return super().decide(failure, failures_so_far)


@pytest.mark.parametrize("max_failures", [0, 1])
def test_the_failure_policy_is_asked_once_per_failure(tmp_path, max_failures):
    # Elastic, max_failures=0: the resize is refused by the policy and the group restarts from
    # disk; the restart does not ask again (it used to: a veto, then the decision). With
    # max_failures=1 the policy allows it and the group resizes in place.
    group = ElasticGroup(3)
    ctl = _elastic_controller(tmp_path, group)
    policy = ctl.failure_policy = CountingPolicy(max_failures)
    assert ctl.step(Exited(2, 1.0, -9)).to is RunState.RESIZING
    ctl.step(_paused(0, 0, 3, grow=False))
    t = ctl.step(_paused(1, 0, 3, grow=False))
    if max_failures == 0:
        assert (t.from_, t.to) == (RunState.RESIZING, RunState.RESTARTING)
        assert t.reason.startswith("stopping: rank 2 was killed by SIGKILL; failure 1 exceeds")
        t = ctl.step()
        assert (t.from_, t.to) == (RunState.RESTARTING, RunState.ERRORED)
        decision = [e for e in _events(tmp_path) if e["type"] == "decision"]
        assert [d["decision"] for d in decision] == ["raise"]
    else:
        assert (t.from_, t.to) == (RunState.RESIZING, RunState.RUNNING)
    assert policy.asked == [(2, 1)]
    assert [f.rank for f in ctl.failures] == [2]


def test_a_loss_while_growing_stops_the_joiners_of_the_plan_the_state_carries(tmp_path):
    group = ElasticGroup(3)
    ctl = _elastic_controller(tmp_path, group, grow_after_s=0.0)
    assert ctl.step(Exited(2, 1.0, -9)).to is RunState.RESIZING
    ctl.step(_paused(0, 0, 3, grow=False))
    assert ctl.step(_paused(1, 0, 3, grow=False)).to is RunState.RUNNING
    t = ctl.step(Resumed(rank=0, time=1.5, generation=1, step=4))
    assert t.to is RunState.GROWING
    plan = t.target.plan
    t = ctl.step(Exited(1, 2.0, -9))  # a member lost while rank 2 is joining
    assert (t.from_, t.to) == (RunState.GROWING, RunState.RESIZING)
    assert t.target.plan is plan  # the one place the grow plan lives
    t = ctl.step(_paused(0, 1, 5, grow=False))
    assert t.to is RunState.RESTARTING  # 1 of 2 left, below min=2: restart from disk
    assert ("discard", [2]) not in group.calls  # the restart stops the whole group instead


def test_a_resize_stops_the_joiners_of_a_grow_under_way(tmp_path):
    group = ElasticGroup(4)
    ctl = _controller(
        tmp_path,
        FakeLauncher([group]),
        world_size=4,
        max_failures=3,
        elastic=ElasticPolicy(2, 4, grow_after_s=0.0),
    )
    assert ctl.step().to is RunState.RUNNING
    assert ctl.step(Exited(3, 1.0, -9)).to is RunState.RESIZING
    for rank in range(3):
        t = ctl.step(_paused(rank, 0, 3, grow=False))
    assert t.to is RunState.RUNNING and ctl.world_size == 3
    t = ctl.step(Resumed(rank=0, time=1.5, generation=1, step=4))
    assert t.to is RunState.GROWING and t.target.plan.ranks == [3]
    assert ctl.step(Exited(2, 2.0, -9)).to is RunState.RESIZING
    ctl.step(_paused(0, 1, 5, grow=False))
    t = ctl.step(_paused(1, 1, 5, grow=False))
    assert (t.from_, t.to) == (RunState.RESIZING, RunState.RUNNING)
    assert ("discard", [3]) in group.calls
    grow_failed = [e for e in _events(tmp_path) if e["type"] == "grow_failed"]
    assert grow_failed[-1]["reason"] == "a member was lost (rank 2 was killed by SIGKILL)"
