"""Preemption without processes: the controller's Preempting transitions against a scripted fake
group that records what it is sent, the notice sources (signals, a polled callable, a file) and
FailureConfig's validation (issue 19). The real-process tests are
tests/multiprocess/test_preemption.py."""

from __future__ import annotations

import os
import signal
import time

import pytest

import ringtrain as rt
from fakes import FakeGroup, FakeLauncher
from fakes import controller_events as _events
from fakes import make_controller as _controller
from ringtrain.controller.states import Preempting, RunState
from ringtrain.preemption import (
    CallableNotice,
    FileNotice,
    NoticeSource,
    PreemptionNotice,
    SignalNotice,
)
from ringtrain.wire.channel import Done, Exited, PreemptRequest, PreemptSaved, WorkerNotice

pytestmark = pytest.mark.timeout(60)


class SendingGroup(FakeGroup):
    """A FakeGroup that records the driver -> worker messages sent to it."""

    def __init__(self, world_size, script):
        super().__init__(world_size, script)
        self.sent: list[tuple[int, object]] = []

    def send(self, rank, message):
        self.sent.append((rank, message))


def _notice(**kw) -> PreemptionNotice:
    return PreemptionNotice.now("test notice", "test", **kw)


def _preempting(tmp_path, script, **kw):
    group = SendingGroup(2, script)
    ctl = _controller(tmp_path, FakeLauncher([group]), **kw)
    ctl.step()  # Starting -> Running
    t = ctl.step(_notice())
    assert (t.from_, t.to) == (RunState.RUNNING, RunState.PREEMPTING)
    grace = kw.get("preemption_grace_s", 30)
    assert t.reason == f"preemption notice: the workers go in {grace:g} s (test notice)"
    assert [r for r, _ in group.sent] == [0, 1]
    assert all(isinstance(m, PreemptRequest) for _, m in group.sent)
    return ctl, group


def test_every_worker_saved_ends_preempted_and_counts_no_failure(tmp_path):
    saved = [PreemptSaved(r, 1.0, 7, None) for r in (0, 1)]
    done = [Done(0, 1.0, 0), Done(1, 1.0, 0), Exited(0, 1.0, 0), Exited(1, 1.0, 0)]
    ctl, group = _preempting(tmp_path, [saved, done])
    assert not ctl.step().changed  # the saves are in, the exits not yet
    t = ctl.step()
    assert (t.from_, t.to) == (RunState.PREEMPTING, RunState.PREEMPTED)
    assert t.reason == "every worker saved its state after step 7"
    assert group.stopped and ctl.failures == []
    result = ctl.result()
    assert (result.status, result.preemptions, result.failures) == ("PREEMPTED", 1, [])
    kinds = [e["type"] for e in _events(tmp_path)]
    assert kinds.index("preemption") < kinds.index("preemption_saved")
    saved_event = next(e for e in _events(tmp_path) if e["type"] == "preemption_saved")
    assert saved_event["step"] == 7 and saved_event["saved_s"] >= 0


def test_the_deadline_kills_the_group_and_says_what_was_not_written(tmp_path):
    ctl, group = _preempting(tmp_path, [[PreemptSaved(0, 1.0, 3, 2)]], preemption_grace_s=0.2)
    assert isinstance(ctl.current, Preempting)
    t = ctl.step()
    deadline = time.monotonic() + 10
    while not t.changed and time.monotonic() < deadline:
        t = ctl.step()
    assert (t.from_, t.to) == (RunState.PREEMPTING, RunState.PREEMPTED)
    assert "the preemption deadline passed (ranks [1] had not saved their state)" in t.reason
    assert t.reason.endswith("a resume starts from scratch")
    assert group.stopped
    incomplete = [e for e in _events(tmp_path) if e["type"] == "preemption_incomplete"]
    assert len(incomplete) == 1 and incomplete[0]["checkpoint"] is None


def test_workers_that_finish_before_the_stop_step_end_finished(tmp_path):
    done = [Done(0, 1.0, 0), Done(1, 1.0, 0), Exited(0, 1.0, 0), Exited(1, 1.0, 0)]
    ctl, _ = _preempting(tmp_path, [done])
    t = ctl.step()
    assert t.to is RunState.FINISHED
    assert t.reason == "every worker finished before the stop step (Done from ranks [0, 1] of 2)"


def test_a_worker_notice_and_a_notice_during_start_are_handled_once_running(tmp_path):
    """A worker's own SIGTERM arrives as an event; a notice queued while the group starts waits
    for Running; more notices while Preempting are dropped (one preemption counted)."""
    group = SendingGroup(2, [[WorkerNotice(1, 1.0, "SIGTERM to rank 1 from pid 9")]])
    ctl = _controller(tmp_path, FakeLauncher([group]))
    ctl.preemption.notify(_notice())
    assert ctl._due_notice() is None  # Starting: kept
    ctl.step(ctl._due_notice())
    assert ctl.state is RunState.RUNNING
    t = ctl.step(ctl._due_notice())
    assert t.to is RunState.PREEMPTING and "test notice" in t.reason
    ctl.step(ctl._due_notice())  # polls the WorkerNotice: queued, then dropped
    assert ctl._due_notice() is None and len(ctl.preemption.handled) == 1
    event = next(e for e in _events(tmp_path) if e["type"] == "preemption")
    assert (event["source"], event["grace_s"], event["ranks"]) == ("test", 30.0, None)


def test_a_group_that_cannot_be_asked_is_stopped_at_once(tmp_path):
    ctl = _controller(tmp_path, FakeLauncher([[]]))  # FakeGroup: no send()
    ctl.step()
    ctl.step(_notice(deadline_s=120))
    t = ctl.step()
    assert t.to is RunState.PREEMPTED
    assert t.reason.startswith("the workers could not be asked to save their state")


# ---------------------------------------------------------------- notice sources


def test_signal_notice_turns_sigusr1_into_a_notice_and_restores_the_handler():
    got: list[PreemptionNotice] = []
    before = signal.getsignal(signal.SIGUSR1)
    source = SignalNotice(signals=(signal.SIGUSR1,))
    assert isinstance(source, NoticeSource)
    source.start(got.append)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        source.stop()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert len(got) == 1 and got[0].source == "signal" and "SIGUSR1 to the driver" in got[0].reason
    assert got[0].deadline_s is None and got[0].grace_s(30) == 30
    with pytest.raises(ValueError, match="SIGINT stops a run at once"):
        SignalNotice(signals=(signal.SIGINT,))


def test_callable_and_file_notices(tmp_path):
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("metadata endpoint down")  # logged, polling goes on
        return "spot reclaim" if len(calls) >= 3 else None

    got: list[PreemptionNotice] = []
    source = CallableNotice(check, interval_s=0.01, deadline_s=120)
    source.start(got.append)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    source.stop()
    assert [(n.reason, n.source, n.grace_s(30)) for n in got] == [("spot reclaim", "callable", 120)]
    assert len(calls) == 3  # not called again after a notice

    path = tmp_path / "preempt"
    got.clear()
    files = FileNotice(path, interval_s=0.01)
    files.start(got.append)
    time.sleep(0.1)
    assert got == []
    # Written atomically (a reader never sees it half written), as a careful writer would.
    (tmp_path / "preempt.tmp").write_text("maintenance at 10:00\n")
    os.replace(tmp_path / "preempt.tmp", path)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    files.stop()
    assert [(n.reason, n.source) for n in got] == [("maintenance at 10:00", "file")]
    with pytest.raises(ValueError, match="interval_s"):
        CallableNotice(check, interval_s=0)


def _first_notice(source, timeout_s=10.0):
    got: list[PreemptionNotice] = []
    source.start(got.append)
    try:
        deadline = time.monotonic() + timeout_s
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        source.stop()
    return got


@pytest.mark.parametrize("first_chunk", ["", "mainten"])
def test_a_file_notice_written_in_pieces_still_gives_its_reason(tmp_path, first_chunk):
    """A notice file written non-atomically (``echo reason > flag`` creates the file, then
    writes): a poll between the two sees an empty file or half a line. The reason must still
    be the whole first line, not "<path> exists" or "mainten" (issue 40, the race behind
    test_callable_and_file_notices's flakiness under load)."""
    path = tmp_path / "preempt"
    got: list[PreemptionNotice] = []
    files = FileNotice(path, interval_s=0.01, settle_s=60)
    files.start(got.append)
    try:
        with open(path, "w") as f:
            f.write(first_chunk)
            f.flush()
            time.sleep(0.3)  # 30 polls see the file half written
            f.write("maintenance at 10:00\n"[len(first_chunk) :])
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        files.stop()
    assert [(n.reason, n.source) for n in got] == [("maintenance at 10:00", "file")]


def test_an_empty_or_unterminated_notice_file_is_a_notice_once_it_settles(tmp_path):
    """A touched file (no reason) and a reason without a newline are notices once the file has
    not changed for ``settle_s``."""
    empty = tmp_path / "flag"
    empty.touch()
    assert [n.reason for n in _first_notice(FileNotice(empty, 0.01, settle_s=0.05))] == [
        f"{empty} exists"
    ]
    bare = tmp_path / "bare"
    bare.write_text("drain now")
    assert [n.reason for n in _first_notice(FileNotice(bare, 0.01, settle_s=0.05))] == ["drain now"]
    with pytest.raises(ValueError, match="settle_s"):
        FileNotice(bare, settle_s=-1)


def test_failure_config_validates_the_preemption_fields():
    config = rt.FailureConfig(max_failures=3, preemption_grace_s=30)
    assert config.preemption_grace_s == 30 and config.notice_sources == ()
    for bad in (0, -1, float("inf"), True, "30"):
        with pytest.raises((ValueError, TypeError), match="preemption_grace_s"):
            rt.FailureConfig(preemption_grace_s=bad)
    with pytest.raises(TypeError, match="is not a notice source"):
        rt.FailureConfig(notice_sources=[lambda: None])
    with pytest.raises(TypeError, match="must be a list of notice sources"):
        rt.FailureConfig(notice_sources=FileNotice("/x"))
    out = rt.FailureConfig(notice_sources=[FileNotice("/x")]).to_dict()
    assert out["notice_sources_repr"] == ["FileNotice('/x')"] and "notice_sources" not in out


def test_a_worker_forked_by_a_ringtrain_launcher_is_stopped_by_its_grandparent_too(tmp_path):
    """The SIGTERM that stops a worker at once comes from its parent, or from the parent's parent
    when the parent is a ringtrain launcher process (a fork server); anyone else's is a notice."""
    from ringtrain.worker.preempt import launchers

    for pid, cmdline, stat in (
        (10, b"python\0train.py\0", b"10 (python) S 7 10 10"),
        (20, b"python\0-m\0ringtrain.launch.pool\0", b"20 (python (pool)) S 7 20 20"),
    ):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes(cmdline)
        (tmp_path / str(pid) / "stat").write_bytes(stat)
    assert launchers(10, proc=str(tmp_path)) == {10}
    assert launchers(20, proc=str(tmp_path)) == {20, 7}
    assert launchers(30, proc=str(tmp_path)) == {30}  # gone: the parent alone
    assert launchers() == {os.getppid()}
