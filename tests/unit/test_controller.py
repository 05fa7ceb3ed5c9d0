"""The controller's state machine, driven by a scripted fake worker group (tests/fakes.py; no
processes)."""

from __future__ import annotations

import hashlib
import json
import time

import fsspec
import pytest

from fakes import FakeLauncher
from fakes import GuardedGroup as _GuardedGroup
from fakes import HeartbeatGroup as _HeartbeatGroup
from fakes import make_controller as _controller
from ringtrain.checkpoint import storage
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import CheckpointConfig, FailureConfig
from ringtrain.controller.controller import RunState
from ringtrain.controller.policy import Decision, FailurePolicy
from ringtrain.result import TrainingFailedError, WorkerFailure
from ringtrain.wire.channel import CheckpointDone, Done, Exited, Hello, Report, WorkerError


def _report(rank, round_, **metrics):
    return Report(rank=rank, round=round_, time=float(round_), metrics=metrics)


def test_success_collects_rounds_from_every_rank(tmp_path):
    launcher = FakeLauncher(
        [
            [
                [Hello(0, 10, "h"), Hello(1, 11, "h")],
                [_report(0, 0, loss=1.0), _report(1, 0, loss=1.5)],
                [_report(1, 1, loss=0.5)],
                [_report(0, 1, loss=0.4)],
                [Done(0, 2.0, 2), Done(1, 2.0, 2), Exited(0, 2.0, 0), Exited(1, 2.0, 0)],
            ]
        ]
    )
    ctl = _controller(tmp_path, launcher)
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert result.metrics == {"loss": 0.4}
    assert result.metrics_per_rank == {0: {"loss": 0.4}, 1: {"loss": 0.5}}
    assert result.metrics_history == [{"loss": 1.0}, {"loss": 0.4}]
    assert result.error is None
    assert launcher.groups[0].stopped


def test_exception_is_root_cause_over_peer_errors(tmp_path):
    launcher = FakeLauncher(
        [
            [
                [_report(0, 0, a=1), _report(1, 0, a=1)],
                [
                    WorkerError(
                        0, 5.0, "RuntimeError", "[../gloo] Connection closed by peer", "tb0"
                    ),
                    WorkerError(1, 5.1, "ValueError", "bad batch", "Traceback...ValueError"),
                ],
                [Exited(0, 5.2, 1), Exited(1, 5.2, 1)],
            ]
        ]
    )
    ctl = _controller(tmp_path, launcher)
    result = ctl.run()
    assert ctl.state is RunState.ERRORED
    err = result.error
    assert err is not None and err.rank == 1
    assert "rank 1 raised ValueError: bad batch" in str(err)
    assert err.traceback == "Traceback...ValueError"
    assert err.failures[-1].round == 0


def test_signal_is_reported_by_name(tmp_path):
    launcher = FakeLauncher([[[Exited(1, 1.0, -9)], [Exited(0, 1.1, 1)]]])
    result = _controller(tmp_path, launcher).run()
    assert result.error is not None
    assert str(result.error).startswith("rank 1 was killed by SIGKILL")
    assert result.error.failures[0].kind == "signal"


def _stage(tmp_path, round_, rank, payload=b"state"):
    """Write one rank's checkpoint file of ``round_`` as a worker would; returns its entry."""

    staging = tmp_path / "run" / f"checkpoint_{round_:06d}.tmp"
    staging.mkdir(parents=True, exist_ok=True)
    (staging / f"rank_{rank}.bin").write_bytes(payload)
    return {
        f"rank_{rank}.bin": {"size": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    }


def test_restart_without_checkpoint_starts_over_and_replaces_lost_rounds(tmp_path):
    launcher = FakeLauncher(
        [
            [[_report(0, 0, x=1), _report(1, 0, x=1)], [Exited(1, 1.0, 3)], [Exited(0, 1.0, 1)]],
            [
                [_report(0, 0, x=10), _report(1, 0, x=10)],
                [_report(0, 1, x=20), _report(1, 1, x=20)],
                [Exited(0, 2.0, 0), Exited(1, 2.0, 0)],
            ],
        ]
    )
    ctl = _controller(tmp_path, launcher, max_failures=1)
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert [s.attempt for s in launcher.specs] == [0, 1]
    assert launcher.specs[1].start_round == 0  # nothing to resume from: round 0 is redone
    assert result.metrics_history == [{"x": 10}, {"x": 20}]
    assert len(result.failures) == 1 and result.failures[0].message == "rank 1 exited with status 3"


def test_restart_resumes_after_the_latest_checkpoint(tmp_path):
    def ckpt_report(rank, round_, **metrics):
        files = _stage(tmp_path, round_, rank)
        return Report(rank, round_, float(round_), metrics, checkpoint_files=files)

    launcher = FakeLauncher(
        [
            lambda: [
                [ckpt_report(0, 0, x=1), ckpt_report(1, 0, x=1)],
                [_report(0, 1, x=2), _report(1, 1, x=2)],
                [Exited(1, 1.0, -9)],
                [Exited(0, 1.0, 1)],
            ],
            [[_report(0, 1, x=3), _report(1, 1, x=3)], [Exited(0, 2.0, 0), Exited(1, 2.0, 0)]],
        ]
    )
    ctl = _controller(tmp_path, launcher, max_failures=1)
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert launcher.specs[1].start_round == 1  # round 1 is recomputed, round 0 restored
    assert launcher.specs[0].latest_checkpoint is None
    assert launcher.specs[1].latest_checkpoint.endswith("checkpoint_000000")
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000000")
    assert result.metrics_history == [{"x": 1}, {"x": 3}]


def test_failure_policy_decisions_say_why():
    policy = FailurePolicy(FailureConfig(max_failures=2))
    failure = WorkerFailure(
        rank=1, kind="signal", message="rank 1 was killed by SIGKILL", round=112
    )
    first = policy.decide(failure, 1)
    assert first.decision is Decision.RESTART
    assert first.reason == (
        "restarting: rank 1 was killed by SIGKILL after round 112; failure 1 of max_failures=2"
    )
    assert policy.decide(failure, 3).decision is Decision.RAISE
    assert (
        FailurePolicy(FailureConfig(max_failures=-1)).decide(failure, 99).decision
        is Decision.RESTART
    )


@pytest.mark.parametrize("max_failures", [0, 2])
def test_max_failures_exhausted_lists_every_failure(tmp_path, max_failures):
    attempts = [
        [[Exited(0, float(i), 2)], [Exited(1, float(i), 0)]] for i in range(max_failures + 1)
    ]
    ctl = _controller(tmp_path, FakeLauncher(attempts), max_failures=max_failures)
    result = ctl.run()
    assert ctl.state is RunState.ERRORED
    assert result.error is not None
    assert len(result.error.failures) == max_failures + 1
    assert [f.attempt for f in result.error.failures] == list(range(max_failures + 1))


# ---------------------------------------------------------------- asynchronous checkpoints


def _run_path(tmp_path):
    return tmp_path / "run"


def _ckpt_dir(tmp_path, round_):
    return _run_path(tmp_path) / f"checkpoint_{round_:06d}"


def _events(tmp_path):
    text = (_run_path(tmp_path) / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]


def _pending(rank, round_, **metrics):
    return Report(rank, round_, float(round_), metrics, checkpoint_pending=True)


def _exits(t=9.0):
    return [Done(0, t, 2), Done(1, t, 2), Exited(0, t, 0), Exited(1, t, 0)]


def test_async_checkpoint_is_published_once_every_rank_has_written(tmp_path):
    seen = []

    def observe(events):
        """Deliver ``events`` after noting whether round 0 is published at this moment."""

        def batch():
            seen.append(_ckpt_dir(tmp_path, 0).exists())
            return events

        return batch

    def script():
        files0 = _stage(tmp_path, 0, 0, b"rank zero's state")
        files1 = _stage(tmp_path, 0, 1, b"rank one's state")
        return [
            [Hello(0, 10, "h"), Hello(1, 11, "h")],
            [_pending(0, 0, loss=1.0), _pending(1, 0, loss=1.1)],
            observe([CheckpointDone(0, 0, files0)]),  # seen[0]: both reports handled
            # Training goes on while rank 1 still writes: round 1 completes first.
            observe([_report(0, 1, loss=0.5), _report(1, 1, loss=0.6)]),  # seen[1]: rank 0 done
            observe([CheckpointDone(1, 0, files1)]),  # seen[2]: round 1 complete
            observe(_exits()),  # seen[3]: rank 1's write done
        ]

    ctl = _controller(tmp_path, FakeLauncher([script]))
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert seen == [False, False, False, True]
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000000")
    assert result.metrics_history == [{"loss": 1.0}, {"loss": 0.5}]
    assert not (_run_path(tmp_path) / "checkpoint_000000.tmp").exists()
    manifest = storage.read_manifest(
        fsspec.filesystem("file"), str(_ckpt_dir(tmp_path, 0)), verify_checksums=True
    )
    assert {name: info["rank"] for name, info in manifest["files"].items()} == {
        "rank_0.bin": 0,
        "rank_1.bin": 1,
    }
    assert manifest["metrics"]["loss"] == 1.0  # round 0's metrics, not round 1's

    order = [(e["type"], e.get("round")) for e in _events(tmp_path)]
    order = [o for o in order if o[0] in ("report", "checkpoint")]
    assert order == [
        ("report", 0),
        ("report", 0),
        ("report", 1),
        ("report", 1),
        ("checkpoint", 0),
    ]
    assert [e["checkpoint"] for e in _events(tmp_path) if e["type"] == "report"] == [
        True,
        True,
        False,
        False,
    ]


def test_checkpoint_done_before_the_other_ranks_report_is_fine(tmp_path):
    seen = []

    def script():
        files0 = _stage(tmp_path, 0, 0, b"zero")
        files1 = _stage(tmp_path, 0, 1, b"one")

        def rank1_reports():
            seen.append(_ckpt_dir(tmp_path, 0).exists())
            return [_pending(1, 0, loss=2.0)]

        def rank1_written():
            seen.append(_ckpt_dir(tmp_path, 0).exists())
            return [CheckpointDone(1, 0, files1)]

        return [
            [_pending(0, 0, loss=1.0)],
            [CheckpointDone(0, 0, files0)],  # rank 0 is written before rank 1 even reported
            rank1_reports,
            rank1_written,
            _exits(),
        ]

    ctl = _controller(tmp_path, FakeLauncher([script]))
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert seen == [False, False]
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000000")
    manifest = storage.read_manifest(
        fsspec.filesystem("file"), str(_ckpt_dir(tmp_path, 0)), verify_checksums=True
    )
    assert sorted(manifest["files"]) == ["rank_0.bin", "rank_1.bin"]


WHY = "rank 1 could not write its checkpoint files: OSError: disk full"


@pytest.mark.parametrize("how", ["checkpoint_done", "report"])
def test_failed_checkpoint_write_is_skipped_and_training_goes_on(tmp_path, how):
    def ckpt_report(rank, round_, **metrics):
        files = _stage(tmp_path, round_, rank)
        return Report(rank, round_, float(round_), metrics, checkpoint_files=files)

    staged_before = []

    def script():
        files0 = _stage(tmp_path, 0, 0)
        if how == "checkpoint_done":
            round0 = [
                [_pending(0, 0, x=1), _pending(1, 0, x=1)],
                [CheckpointDone(0, 0, files0)],
                [CheckpointDone(1, 0, None, error=WHY)],
            ]
        else:
            round0 = [
                [
                    Report(0, 0, 0.0, {"x": 1}, checkpoint_files=files0),
                    Report(1, 0, 0.0, {"x": 1}, checkpoint_error=WHY),
                ]
            ]

        def note_staging():
            staged_before.append((_run_path(tmp_path) / "checkpoint_000000.tmp").exists())
            return []

        return [
            note_staging,
            *round0,
            [ckpt_report(0, 1, x=2), ckpt_report(1, 1, x=2)],  # the next checkpoint still works
            _exits(),
        ]

    ctl = _controller(tmp_path, FakeLauncher([script]))
    result = ctl.run()
    assert ctl.state is RunState.FINISHED and result.error is None
    assert staged_before == [True]
    assert not _ckpt_dir(tmp_path, 0).exists()
    assert not (_run_path(tmp_path) / "checkpoint_000000.tmp").exists()
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000001")
    assert [t.round for t in ctl.checkpoints.checkpoints] == [1]
    failed = [e for e in _events(tmp_path) if e["type"] == "checkpoint_failed"]
    assert len(failed) == 1
    assert failed[0]["round"] == 0 and failed[0]["errors"] == [WHY]
    published = [e["round"] for e in _events(tmp_path) if e["type"] == "checkpoint"]
    assert published == [1]


# ---------------------------------------------------------------- hang detection


@pytest.mark.parametrize("max_failures", [0, 1])
def test_a_rank_without_progress_is_failed_as_hung(tmp_path, max_failures):
    # Rank 0 keeps making progress; rank 1 answers heartbeats but its progress gets older.
    # A long guard, so that a loaded machine cannot make the guard end the attempt first: the
    # bound below is about which of the two ended it, not about speed.
    hung = _HeartbeatGroup(2, lambda rank, elapsed: 0.0 if rank == 0 else elapsed, guard_s=30)
    attempts = [hung, [[_report(0, 0, x=1), _report(1, 0, x=1)], _exits()]]
    ctl = _controller(
        tmp_path, FakeLauncher(attempts), max_failures=max_failures, worker_timeout_s=0.3
    )
    start = time.monotonic()
    result = ctl.run()
    assert time.monotonic() - start < 25.0  # well before the guard ends the attempt
    assert hung.stopped
    assert hung.dumped == [1]  # asked for its stacks before it was stopped
    failure = result.failures[0]
    assert failure.kind == "hang" and failure.rank == 1 and failure.attempt == 0
    assert failure.step == 41  # the last step its heartbeat told
    assert failure.message.startswith("rank 1 made no progress for ")
    assert "beyond worker_timeout_s=0.3" in failure.message and "stuck too" not in failure.message
    logged = [e for e in _events(tmp_path) if e["type"] == "failure"]
    assert [(e["rank"], e["kind"]) for e in logged] == [(1, "hang")]
    if max_failures == 0:
        assert ctl.state is RunState.ERRORED
        assert isinstance(result.error, TrainingFailedError)
        assert result.error.failures == [failure] and result.error.rank == 1
        assert str(result.error).startswith("rank 1 made no progress")
    else:
        assert ctl.state is RunState.FINISHED and result.error is None
        assert [s.attempt for s in ctl.launcher.specs] == [0, 1]


def test_silent_ranks_fail_the_one_whose_progress_is_oldest(tmp_path):
    # Rank 1 says Hello first, rank 0 a little later, then both go silent (frozen processes).
    # The controller only checks after a long poll, when both are past the timeout: the rank
    # that stopped first is the culprit, the other one waits on it.
    def later(events, sleep_s):
        def batch():
            time.sleep(sleep_s)
            return events

        return batch

    group = _GuardedGroup(
        2, [[Hello(1, 11, "h")], later([Hello(0, 10, "h")], 0.05), later([], 0.6), []]
    )
    ctl = _controller(tmp_path, FakeLauncher([group]), worker_timeout_s=0.3)
    result = ctl.run()
    assert ctl.state is RunState.ERRORED
    assert isinstance(result.error, TrainingFailedError)
    [failure] = result.error.failures
    assert failure.kind == "hang" and failure.rank == 1 and failure.step is None
    assert failure.message.startswith("rank 1 stopped answering for ")
    assert "ranks [0] are stuck too, waiting on it" in failure.message


def test_heartbeats_with_fresh_progress_are_not_a_hang(tmp_path):
    # Control for the hang tests: the same group, every rank making progress, runs past the
    # timeout and finishes.
    group = _HeartbeatGroup(2, lambda rank, elapsed: 0.0, guard_s=0.6)
    ctl = _controller(tmp_path, FakeLauncher([group]), worker_timeout_s=0.3)
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert result.failures == [] and result.error is None


# ---------------------------------------------------------------- corrupt checkpoints


def _flip_byte(path, at=3):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_restart_skips_a_corrupt_latest_checkpoint(tmp_path):
    def ckpt_report(rank, round_, payload, **metrics):
        files = _stage(tmp_path, round_, rank, payload)
        return Report(rank, round_, float(round_), metrics, checkpoint_files=files)

    def corrupt_then_crash():
        # Round 1 is published by now; damage it on storage, then rank 1 dies.
        _flip_byte(_ckpt_dir(tmp_path, 1) / "rank_0.bin")
        return [Exited(1, 1.0, -9)]

    launcher = FakeLauncher(
        [
            lambda: [
                [ckpt_report(0, 0, b"r0 round0", x=1), ckpt_report(1, 0, b"r1 round0", x=1)],
                [ckpt_report(0, 1, b"r0 round1", x=2), ckpt_report(1, 1, b"r1 round1", x=2)],
                corrupt_then_crash,
                [Exited(0, 1.0, 1)],
            ],
            lambda: [
                [ckpt_report(0, 1, b"r0 again", x=3), ckpt_report(1, 1, b"r1 again", x=3)],
                _exits(),
            ],
        ]
    )
    ctl = _controller(tmp_path, launcher, max_failures=1)
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert launcher.specs[1].latest_checkpoint.endswith("checkpoint_000000")
    assert launcher.specs[1].start_round == 1
    corrupt = _run_path(tmp_path) / "checkpoint_000001.corrupt"
    assert corrupt.is_dir()
    assert (corrupt / "rank_0.bin").read_bytes() != b"r0 round1"  # the damaged one, kept
    # Round 1 was recomputed and published afresh.
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000001")
    assert (_ckpt_dir(tmp_path, 1) / "rank_0.bin").read_bytes() == b"r0 again"
    assert result.metrics_history == [{"x": 1}, {"x": 3}]

    events = _events(tmp_path)
    types = [e["type"] for e in events]
    [invalid] = [e for e in events if e["type"] == "checkpoint_invalid"]
    assert "checkpoint_000001" in invalid["reason"] and "SHA-256" in invalid["reason"]
    assert "resuming from checkpoint_000000" in invalid["reason"]
    # Found while preparing the restart: after the failure, before the second attempt starts.
    run_starts = [i for i, t in enumerate(types) if t == "run_start"]
    assert types.index("failure") < types.index("checkpoint_invalid") < run_starts[1]


CORRUPTIONS = {
    "truncated": lambda d: (d / "rank_0.bin").write_bytes((d / "rank_0.bin").read_bytes()[:4]),
    "missing_file": lambda d: (d / "rank_1.bin").unlink(),
    "bit_flip": lambda d: _flip_byte(d / "rank_1.bin"),
    "garbage_manifest": lambda d: (d / "manifest.json").write_bytes(b"\x00{not json"),
    "manifest_without_files": lambda d: (d / "manifest.json").write_text('{"format": 1}'),
    "missing_manifest": lambda d: (d / "manifest.json").unlink(),
}


def _published_manager(tmp_path, rounds=3):
    run = _run_path(tmp_path)
    run.mkdir(parents=True, exist_ok=True)
    mgr = CheckpointManager(fsspec.filesystem("file"), str(run), CheckpointConfig())
    for r in range(rounds):
        files = {**_stage(tmp_path, r, 0, b"zero %d" % r), **_stage(tmp_path, r, 1, b"one %d" % r)}
        mgr.publish(r, files, {"round": r})
    return mgr


def test_latest_verified_returns_the_newest_intact_checkpoint(tmp_path):
    mgr = _published_manager(tmp_path)
    latest = mgr.latest_verified()
    assert latest is not None and latest.round == 2
    assert mgr.notes == [] and [t.round for t in mgr.checkpoints] == [0, 1, 2]
    assert not list(_run_path(tmp_path).glob("*.corrupt"))


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_latest_verified_falls_back_past_a_corrupt_checkpoint(tmp_path, corruption):
    mgr = _published_manager(tmp_path)
    # A quarantined copy from an earlier run is replaced, not merged into.
    old = _run_path(tmp_path) / "checkpoint_000002.corrupt"
    old.mkdir()
    (old / "stale.bin").write_bytes(b"old")
    CORRUPTIONS[corruption](_ckpt_dir(tmp_path, 2))

    latest = mgr.latest_verified()
    assert latest is not None and latest.round == 1
    assert [t.round for t in mgr.checkpoints] == [0, 1]
    assert mgr.next_round == 2
    assert not _ckpt_dir(tmp_path, 2).exists()
    assert old.is_dir() and not (old / "stale.bin").exists()
    [note] = mgr.notes
    assert note.startswith("checkpoint checkpoint_000002 is invalid (")
    assert note.endswith("set aside as checkpoint_000002.corrupt; resuming from checkpoint_000001")
    # Asking again finds the same one, with nothing new to report.
    mgr.notes.clear()
    again = mgr.latest_verified()
    assert again is not None and again.round == 1 and mgr.notes == []


def test_latest_verified_with_every_checkpoint_corrupt_starts_from_scratch(tmp_path):
    mgr = _published_manager(tmp_path, rounds=2)
    mgr.config = CheckpointConfig(from_scratch_if_invalid=True)  # else: NoValidCheckpointError
    _flip_byte(_ckpt_dir(tmp_path, 1) / "rank_0.bin")
    (_ckpt_dir(tmp_path, 0) / "rank_1.bin").write_bytes(b"")
    assert mgr.latest_verified() is None
    assert mgr.checkpoints == [] and mgr.next_round == 0
    assert len(mgr.notes) == 2  # each says where the run really resumes: nowhere
    assert all(n.endswith("no valid checkpoint is left: starting from scratch") for n in mgr.notes)
    assert sorted(p.name for p in _run_path(tmp_path).iterdir()) == [
        "checkpoint_000000.corrupt",
        "checkpoint_000001.corrupt",
    ]


def test_a_live_ranks_inflight_write_lands_before_the_group_is_stopped(tmp_path):
    """Rank 1 dies while rank 0 is still writing round 0 in the background: the controller lets
    rank 0 finish (it would otherwise stop the group at once, all ranks having failed), publishes
    round 0, and the restart resumes from it instead of from scratch."""

    def pending(rank):
        return Report(rank, 0, 0.0, {"step": 3}, checkpoint_pending=True)

    launcher = FakeLauncher(
        [
            lambda: [
                [pending(0), pending(1)],
                [CheckpointDone(1, 0, _stage(tmp_path, 0, 1))],
                [Exited(1, 1.0, -9)],
                [WorkerError(0, 1.1, "RuntimeError", "Connection closed by peer", "tb")],
                [],
                [CheckpointDone(0, 0, _stage(tmp_path, 0, 0))],
                [Exited(0, 1.2, 1)],
            ],
            [
                [_report(0, 1, step=4), _report(1, 1, step=4)],
                [Exited(0, 2.0, 0), Exited(1, 2.0, 0)],
            ],
        ]
    )
    ctl = _controller(tmp_path, launcher, max_failures=1)
    result = ctl.run()
    assert ctl.state is RunState.FINISHED
    assert launcher.specs[1].latest_checkpoint.endswith("checkpoint_000000")
    assert launcher.specs[1].start_round == 1
    assert result.failures[0].rank == 1  # the peer error of rank 0 is not the root cause


def test_a_hung_ranks_pending_write_does_not_hold_the_restart(tmp_path):
    """Both ranks report round 0 with a background write; rank 0 finishes it, rank 1 then
    freezes (its progress ages) and is failed as hung. Its write will never land, so the
    controller restarts at once instead of waiting ``checkpoint_grace_s`` for it (found by
    ``ringtrain chaos``: a SIGSTOPped rank held every restart for 120 s)."""

    class Frozen(_HeartbeatGroup):
        guard_fired = False

        def poll(self, timeout_s):
            if time.monotonic() - self.started > self.guard_s:
                self.guard_fired = True
            return super().poll(timeout_s)

    def pending(rank):
        return Report(rank, 0, 0.0, {"step": 3}, checkpoint_pending=True)

    frozen = Frozen(2, lambda rank, elapsed: 0.0 if rank == 0 else elapsed, guard_s=60.0)
    frozen.script += [[pending(0), pending(1)], [CheckpointDone(0, 0, _stage(tmp_path, 0, 0))]]
    attempts = [frozen, [[_report(0, 0, x=1), _report(1, 0, x=1)], _exits()]]
    ctl = _controller(
        tmp_path,
        FakeLauncher(attempts),
        max_failures=1,
        worker_timeout_s=0.3,
        checkpoint_grace_s=3600.0,
    )
    result = ctl.run()
    assert not frozen.guard_fired and frozen.stopped
    assert [(f.rank, f.kind) for f in result.failures] == [(1, "hang")]
    assert ctl.state is RunState.FINISHED


def test_a_resize_clears_the_straggler_flags_of_the_old_group(tmp_path):
    # Ranks are renumbered by a resize (old rank 2 becomes rank 1 of 2): the old group's timing
    # windows and flags would otherwise be compared against, and shown for, the wrong ranks.
    from ringtrain.controller.generation import Generation
    from ringtrain.monitor.straggler import StragglerDetector

    class Progress:
        def __init__(self):
            self.cleared = []

        def straggler(self, rank, flagged):
            self.cleared.append((rank, flagged))

    detector = StragglerDetector()
    ctl = _controller(tmp_path, FakeLauncher([]), world_size=3, stragglers=detector)
    ctl.progress = Progress()
    window = {"step_s_mean": 0.1, "comm_exposed_s": 0.0}
    for rank in range(3):
        detector.update(rank, window)
    detector.flagged.add(2)
    from ringtrain.controller.elastic import ResizePlan

    plan = ResizePlan(1, {0: 0, 1: 1}, {}, {"old_world_size": 3}, (), "resized")
    new = ctl._next_generation(Generation(0, 3), plan)
    assert (new.world_size, ctl.world_size, new.resize) == (2, 2, {"old_world_size": 3})
    assert ctl.progress.cleared == [(2, False)]
    assert detector.flagged == set() and detector.latest == {}
