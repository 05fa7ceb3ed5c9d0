"""Fault tolerance with bit-exact resume, on real worker processes over gloo.

Every test that kills, hangs or corrupts something compares the final parameters and optimizer
state, tensor by tensor with ``torch.equal``, against an uninterrupted run of the same seed.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ringtrain as rt
import workloads
from support import assert_bit_identical, run_job

SHARES_RUNS = True  # its tests share cached runs: one pytest worker runs them all (conftest)

EPOCHS = 3  # 120 samples, batch 6 per rank, 2 ranks: 10 steps per epoch, 30 steps in all
_baselines: dict[tuple, dict] = {}


def _fit(tmp_path, name, kill=None, kill_rank=1, *, epochs=EPOCHS, job=None, **config):
    """``workloads.exact_fn`` on 2 workers; ``job``: run_job's config (default: max_failures=2,
    the run in ``tmp_path/runs``); ``config``: more of exact_fn's own settings."""
    out = tmp_path / f"{name}.pt"
    cfg = {"epochs": epochs, "out": str(out), "kill": kill, "kill_rank": kill_rank, **config}
    job = {"storage_path": tmp_path / "runs", **(job or {"max_failures": 2})}
    result = run_job(workloads.exact_fn, name=name, train_loop_config=cfg, **job)
    return result, torch.load(out, weights_only=True)


def _baseline(tmp_path_factory, epochs=EPOCHS, **config):
    key = (epochs, tuple(sorted(config.items())))
    if key not in _baselines:
        tmp = tmp_path_factory.mktemp("baseline")
        result, final = _fit(tmp, "clean", epochs=epochs, **config)
        assert result.failures == []
        _baselines[key] = final
    return _baselines[key]


# Round numbers: a report every 4 steps and at each epoch's end (steps 4, 8, 10 | 12, 16, 20 |...).
KILL_POINTS = {
    "before_first_checkpoint": ("step", 3),
    "mid_epoch": ("step", 17),
    "epoch_boundary": ("epoch_start", 1),
    "during_checkpoint_write": ("write", 3, 300),
    "random": ("step", random.Random(2026).randint(1, 29)),
}


@pytest.mark.parametrize("point", sorted(KILL_POINTS))
def test_sigkill_anywhere_resumes_bit_exactly(tmp_path, tmp_path_factory, point):
    kill = KILL_POINTS[point]
    rank = random.Random(point).choice([0, 1])
    clean = _baseline(tmp_path_factory)
    result, final = _fit(tmp_path, point, kill=kill, kill_rank=rank)
    assert [(f.rank, f.kind, f.message) for f in result.failures] == [
        (rank, "signal", f"rank {rank} was killed by SIGKILL")
    ]
    assert_bit_identical(clean, final)
    # the reported history is that of a run that never failed: recomputed rounds replace the
    # lost attempt's, none is counted twice
    expected = [s for s in range(1, 31) for every in (4, 10) if s % every == 0]
    assert [m["step"] for m in result.metrics_history] == expected


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_loader_with_worker_processes_resumes_mid_epoch(tmp_path, tmp_path_factory, async_save):
    clean = _baseline(tmp_path_factory, loader_workers=2)
    job = {"max_failures": 1, "async_save": async_save}
    result, final = _fit(tmp_path, "workers", ("step", 15), job=job, loader_workers=2)
    assert len(result.failures) == 1
    assert_bit_identical(clean, final)


def test_max_failures_exhausted_raises_with_every_failure(tmp_path):
    with pytest.raises(rt.TrainingFailedError) as info:
        run_job(
            workloads.sigkill_fn,
            storage_path=tmp_path,
            name="doomed",
            max_failures=2,
            train_loop_config={"bad_rank": 1},
        )
    err = info.value
    assert [(f.attempt, f.rank, f.kind) for f in err.failures] == [
        (0, 1, "signal"),
        (1, 1, "signal"),
        (2, 1, "signal"),
    ]
    text = str(err)
    assert "failures (3):" in text
    for attempt in range(3):
        assert f"attempt {attempt}: rank 1 was killed by SIGKILL" in text
    status = json.loads((tmp_path / "doomed" / "result.json").read_text())
    assert status["status"] == "ERRORED" and len(status["failures"]) == 3


@pytest.mark.parametrize("how", ["hang", "freeze"])
def test_hung_worker_is_detected_and_the_run_recovers(tmp_path, tmp_path_factory, capfd, how):
    clean = _baseline(tmp_path_factory)
    # A live rank heartbeats every timeout/5; the driver calls it frozen once it is silent for
    # the whole timeout. 2 s was too short beside a CPU burner: a hung (sleeping, heartbeating)
    # rank went unheard for 2 s and was reported frozen (seen in a run beside a CPU burner).
    job = {"max_failures": 1, "worker_timeout_s": 4.0}
    result, final = _fit(tmp_path, how, (how, 13), job=job)
    [failure] = result.failures
    assert failure.kind == "hang" and failure.rank == 1
    expected = "made no progress" if how == "hang" else "stopped answering"
    assert expected in failure.message and "worker_timeout_s=4" in failure.message
    if how == "hang":
        # The driver asked the hung rank for its stacks: the line it sleeps on reached the
        # driver's output with the rank's prefix (a frozen rank answers only once continued).
        out, err = capfd.readouterr()
        assert re.search(r"\(rank 1\) +File .*workloads\.py\", line \d+ in ", out + err), (
            out + err
        )[-3000:]
    assert_bit_identical(clean, final)
    events = [
        json.loads(line)
        for line in (tmp_path / "runs" / how / "events.jsonl").read_text().split("\n")
        if line
    ]
    assert any(e["type"] == "decision" and "restarting: rank 1" in e["reason"] for e in events)


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_corrupt_checkpoints_are_skipped_and_never_loaded(tmp_path, tmp_path_factory):
    """A finished 2-epoch run is continued to 3 epochs after its two newest checkpoints were
    damaged (one bit flipped, one file truncated): both are set aside, the third newest is
    restored, and the result equals an uninterrupted 3-epoch run."""
    clean = _baseline(tmp_path_factory)
    first, _ = _fit(tmp_path, "damaged", epochs=2)
    assert first.checkpoint is not None
    run = tmp_path / "runs" / "damaged"
    ckpts = sorted(p for p in run.iterdir() if p.name.startswith("checkpoint_"))
    newest, second, third = ckpts[-1], ckpts[-2], ckpts[-3]
    _flip_byte(newest / "train_state.pt")
    with open(second / "rank_00001.pt", "r+b") as f:
        f.truncate(100)
    result, final = _fit(tmp_path, "damaged", epochs=3)
    assert result.failures == []
    assert_bit_identical(clean, final)
    assert (run / f"{newest.name}.corrupt").is_dir() and (run / f"{second.name}.corrupt").is_dir()
    invalid = [
        json.loads(line)
        for line in (run / "events.jsonl").read_text().splitlines()
        if '"checkpoint_invalid"' in line
    ]
    reasons = {e["reason"].split()[1]: e["reason"] for e in invalid}
    assert sorted(reasons) == [second.name, newest.name]
    assert "does not match its SHA-256" in reasons[newest.name]
    assert f"resuming from {third.name}" in reasons[newest.name]
    assert "rank_00001.pt has 100 bytes" in reasons[second.name]


def test_transient_storage_errors_are_retried(tmp_path, tmp_path_factory, monkeypatch):
    clean = _baseline(tmp_path_factory)
    monkeypatch.setenv("RT_FLAKY_FAILS", "2")  # every process: its first two .pt writes fail
    job = {"storage_path": f"flaky://{tmp_path}/runs", "max_failures": 1}
    result, final = _fit(tmp_path, "flaky", ("step", 13), job=job)
    assert len(result.failures) == 1
    assert_bit_identical(clean, final)
    events = (tmp_path / "runs" / "flaky" / "events.jsonl").read_text()
    assert "checkpoint_failed" not in events


def test_persistent_storage_failure_costs_checkpoints_not_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("RT_FLAKY_FAILS", "always")
    job = {"storage_path": f"flaky://{tmp_path}/runs", "async_save": False}
    result, final = _fit(tmp_path, "broken", epochs=1, job=job)
    assert result.error is None and final["step"] == 10
    assert result.checkpoint is None
    run = tmp_path / "runs" / "broken"
    failed = [
        json.loads(line)
        for line in (run / "events.jsonl").read_text().splitlines()
        if '"checkpoint_failed"' in line
    ]
    assert len(failed) == 3  # steps 4, 8 and the epoch's end
    assert (
        "could not write its checkpoint files: ConnectionError: flaky storage"
        in (failed[0]["errors"][0])
    )
    assert not [p for p in run.iterdir() if p.name.startswith("checkpoint_")]


DRIVER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import ringtrain as rt
    import workloads

    class DieAfter:
        def on_checkpoint(self, checkpoint, metrics):
            if checkpoint.path.endswith("checkpoint_000004"):
                os.kill(os.getpid(), signal.SIGKILL)  # the driver itself dies

    rt.Trainer(
        workloads.exact_fn,
        rt.ScalingConfig(num_workers=2),
        rt.RunConfig(name="crashy", storage_path={storage!r}, callbacks=[DieAfter()],
                     progress="off"),
        # Rank 0 waits after its 5th report (round 4): the driver dies at checkpoint_000004
        # before the run can end, however slow it is next to its workers.
        train_loop_config={{"epochs": {epochs}, "out": {out!r},
                            "kill": ("hold_after_reports", 5, {hold!r}), "kill_rank": 0}},
    ).fit()
    """
)


def _run_dying_driver(tmp_path):
    out = tmp_path / "final.pt"
    script = tmp_path / "driver.py"
    script.write_text(
        DRIVER.format(
            tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            storage=str(tmp_path / "runs"),
            epochs=EPOCHS,
            out=str(out),
            hold=str(tmp_path / "held"),
        )
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    run = tmp_path / "runs" / "crashy"
    status = json.loads((run / "result.json").read_text())
    assert status["status"] == "RUNNING"  # nobody got to write the end
    assert (run / "checkpoint_000004").is_dir() and not out.exists()
    return run, out


def test_driver_killed_then_trainer_restore_finishes_bit_exactly(tmp_path, tmp_path_factory):
    clean = _baseline(tmp_path_factory)
    run, out = _run_dying_driver(tmp_path)
    result = rt.Trainer.restore(str(run)).fit()
    assert result.error is None
    assert_bit_identical(clean, torch.load(out, weights_only=True))
    assert json.loads((run / "result.json").read_text())["status"] == "FINISHED"


def test_driver_killed_then_cli_resume_finishes_bit_exactly(tmp_path, tmp_path_factory):
    clean = _baseline(tmp_path_factory)
    run, out = _run_dying_driver(tmp_path)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain.cli", "run", "--resume", str(run), "--progress", "off"],
        capture_output=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert_bit_identical(clean, torch.load(out, weights_only=True))


def test_cli_script_restarts_with_max_failures(tmp_path, tmp_path_factory):
    """`ringtrain run -n 2 --max-failures 1 SCRIPT`: a per-worker script gets the same restart
    and exact resume as a Trainer."""
    clean = _baseline(tmp_path_factory)
    out = tmp_path / "final.pt"
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
            import workloads
            workloads.exact_fn({{"epochs": {EPOCHS}, "out": {str(out)!r},
                                 "kill": ("step", 14), "kill_rank": 0}})
            """
        )
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain.cli",
            "run",
            "-n",
            "2",
            "--max-failures",
            "1",
            "--name",
            "script",
            "--storage-path",
            str(tmp_path / "runs"),
            "--progress",
            "plain",
            str(script),
        ],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert b"restarting: rank 0 was killed by SIGKILL" in proc.stdout + proc.stderr
    assert_bit_identical(clean, torch.load(out, weights_only=True))
