"""The controller's state machine, driven by a scripted fake worker group (no processes)."""

from __future__ import annotations

import pytest

from ringtrain.channel import Done, Exited, Hello, Report, WorkerError
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import CheckpointConfig, FailureConfig
from ringtrain.controller.controller import Controller, RunState
from ringtrain.controller.policy import Decision, FailurePolicy
from ringtrain.launch.base import WorkerSpec
from ringtrain.monitor.progress import make_progress
from ringtrain.result import WorkerFailure
from ringtrain.rundir import RunDirectory


class FakeGroup:
    def __init__(self, world_size, script):
        self.world_size = world_size
        self.script = list(script)  # list of event batches, one batch per poll
        self.stopped = False

    def poll(self, timeout_s):
        return self.script.pop(0) if self.script else []

    def stop(self, grace_s=5.0):
        self.stopped = True

    def pids(self):
        return {}


class FakeLauncher:
    def __init__(self, attempts):
        self.attempts = list(attempts)
        self.specs: list[WorkerSpec] = []
        self.groups: list[FakeGroup] = []

    def start(self, spec):
        self.specs.append(spec)
        script = self.attempts.pop(0)
        # A callable script is built when its attempt starts (after the controller has cleared
        # the previous attempt's staging directories), as real workers would write files then.
        group = FakeGroup(spec.world_size, script() if callable(script) else script)
        self.groups.append(group)
        return group


def _controller(tmp_path, launcher, world_size=2, max_failures=0):
    run_dir = RunDirectory(str(tmp_path), "run")
    run_dir.create()
    ckpts = CheckpointManager(run_dir.fs, run_dir.path, CheckpointConfig())
    return Controller(
        launcher=launcher,
        make_spec=lambda attempt, start, latest: WorkerSpec(
            world_size=world_size,
            run_dir=run_dir.uri,
            attempt=attempt,
            start_round=start,
            latest_checkpoint=latest,
        ),
        world_size=world_size,
        run_dir=run_dir,
        checkpoints=ckpts,
        failure_policy=FailurePolicy(FailureConfig(max_failures=max_failures)),
        progress=make_progress("off"),
        failure_grace_s=0.0,
        poll_interval_s=0.0,
    )


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
    import hashlib

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
