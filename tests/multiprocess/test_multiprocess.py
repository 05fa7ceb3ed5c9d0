"""Real worker processes talking over gloo, started by the local launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ringtrain as rt
import workloads
from ctrl_c import AS_AT_A_TERMINAL, ctrl_c_driver, sigint_ignored
from support import pid_alive, wait_until


def fit(fn, n, tmp_path, name="run", config=None, raise_on_error=True, **run_kwargs):
    trainer = rt.Trainer(
        fn,
        rt.ScalingConfig(num_workers=n),
        rt.RunConfig(name=name, storage_path=str(tmp_path), progress="plain", **run_kwargs),
        train_loop_config=config or {},
    )
    return trainer.fit(raise_on_error=raise_on_error)


def _final_params(result):
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "model.pt"), weights_only=True)["model"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_world_size_times_batch_equals_one_worker_with_global_batch(tmp_path, world_size):
    b, steps = 4, 6
    multi = fit(
        workloads.equivalence_fn, world_size, tmp_path, "multi", {"batch_size": b, "steps": steps}
    )
    single = fit(
        workloads.equivalence_fn,
        1,
        tmp_path,
        "single",
        {"batch_size": world_size * b, "steps": steps},
    )
    p_multi, p_single = _final_params(multi), _final_params(single)
    initial = workloads.make_model().state_dict()
    for key, value in p_single.items():
        assert not torch.equal(value, initial[key]), "training did not move the parameters"
        torch.testing.assert_close(p_multi[key], value, rtol=1e-5, atol=1e-6)


def test_metrics_of_every_rank_and_retention_by_score(tmp_path):
    scores = [0.5, 0.9, 0.1, 0.7, 0.2]
    result = fit(
        workloads.metrics_fn,
        2,
        tmp_path,
        "metrics",
        {"rounds": len(scores), "scores": scores},
        checkpoint_config=rt.CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="score", checkpoint_score_order="max"
        ),
    )
    assert result.metrics["rank"] == 0 and result.metrics["rank_sum"] == 1.0
    assert set(result.metrics_per_rank) == {0, 1}
    assert result.metrics_per_rank[1]["rank"] == 1
    assert [m["round"] for m in result.metrics_history] == [0, 1, 2, 3, 4]
    # kept: the two best (rounds 1 and 3) and the latest (round 4)
    run_dir = tmp_path / "metrics"
    kept = sorted(p.name for p in run_dir.iterdir() if p.name.startswith("checkpoint_"))
    assert kept == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000004"]
    assert result.checkpoint.path == str(run_dir / "checkpoint_000004")
    assert [m["score"] for _, m in result.best_checkpoints] == [0.9, 0.7, 0.2]
    for ckpt in kept:
        manifest = json.loads((run_dir / ckpt / "manifest.json").read_text())
        assert set(manifest["files"]) == {"model.pt"}
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    reports = [e for e in events if e["type"] == "report"]
    assert sorted((e["rank"], e["round"]) for e in reports) == [
        (r, i) for r in (0, 1) for i in range(5)
    ]
    assert all("time" in e and "metrics" in e for e in reports)
    saved = json.loads((run_dir / "result.json").read_text())
    assert saved["status"] == "FINISHED" and saved["metrics_per_rank"]["1"]["rank"] == 1
    config = json.loads((run_dir / "config.json").read_text())
    assert config["scaling_config"]["num_workers"] == 2
    assert config["train_loop_config"]["scores"] == scores


def test_worker_exception_names_rank_and_carries_traceback(tmp_path):
    with pytest.raises(rt.TrainingFailedError) as info:
        fit(workloads.raising_fn, 2, tmp_path, "raise", {"bad_rank": 1})
    err = info.value
    assert err.rank == 1
    assert str(err).startswith("rank 1 raised ValueError: bad batch on rank 1")
    assert "in raising_fn" in err.traceback and "ValueError" in err.traceback
    saved = json.loads((tmp_path / "raise" / "result.json").read_text())
    assert saved["status"] == "ERRORED" and "bad batch" in saved["error"]


def test_raise_on_error_false_returns_result_with_error(tmp_path):
    result = fit(
        workloads.raising_fn, 2, tmp_path, "noraise", {"bad_rank": 0}, raise_on_error=False
    )
    assert isinstance(result.error, rt.TrainingFailedError)
    assert result.error.rank == 0
    assert result.metrics == {"ok": 1}


def test_sigkilled_worker_is_reported_as_such(tmp_path):
    with pytest.raises(rt.TrainingFailedError) as info:
        fit(workloads.sigkill_fn, 2, tmp_path, "kill", {"bad_rank": 1})
    assert str(info.value).startswith("rank 1 was killed by SIGKILL")
    assert info.value.failures[-1].kind == "signal"


_DRIVER = AS_AT_A_TERMINAL + textwrap.dedent(
    """
    import sys, workloads, ringtrain as rt
    rt.Trainer(workloads.sleeper_fn, rt.ScalingConfig(num_workers=2),
               rt.RunConfig(name="orphans", storage_path=sys.argv[1], progress="plain"),
               train_loop_config={"pid_dir": sys.argv[2]}).fit()
    """
)


def _start_sleeping_driver(tmp_path):
    """A driver process running run 'orphans' with 2 sleeping workers; returns once both workers
    have written their pid files."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tests, *sys.path]))
    driver = subprocess.Popen(  # with SIGINT ignored, as a backgrounded session's child
        ctrl_c_driver(_DRIVER, str(tmp_path), str(pid_dir)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if not wait_until(lambda: len(list(pid_dir.iterdir())) == 2, timeout_s=60):
        driver.kill()
        driver.wait()
        raise AssertionError("the driver's workers did not start within 60 s")
    return driver, pid_dir


# SIGTERM to the driver is a preemption notice since issue 19 (the run ends PREEMPTED after the
# workers save): tests/multiprocess/test_preemption.py covers it, no orphans included.
@pytest.mark.parametrize("driver_signal", [signal.SIGKILL, signal.SIGINT])
def test_no_orphan_workers_when_the_driver_dies(tmp_path, driver_signal):
    driver, pid_dir = _start_sleeping_driver(tmp_path)
    try:
        workers = [int(p.read_text()) for p in pid_dir.iterdir()]
        assert all(pid_alive(p) for p in workers)
        assert not sigint_ignored(driver.pid)  # as a foreground job (tests/ctrl_c.py)
        driver.send_signal(driver_signal)
        driver.wait(timeout=30)
        assert wait_until(lambda: not any(pid_alive(p) for p in workers), timeout_s=15), (
            f"workers {workers} outlived the driver killed by {driver_signal.name}"
        )
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    if driver_signal is not signal.SIGKILL:
        # the run directory says what happened
        saved = json.loads((tmp_path / "orphans" / "result.json").read_text())
        assert saved["status"] == "ABORTED"


def test_restart_after_failure_resumes_from_latest_checkpoint(tmp_path):
    result = fit(
        workloads.flaky_fn,
        2,
        tmp_path,
        "flaky",
        {"steps": 5, "fail_at": 3},
        failure_config=rt.FailureConfig(max_failures=1),
    )
    assert result.error is None
    assert len(result.failures) == 1
    assert result.failures[0].rank == 1
    assert result.failures[0].message == "rank 1 raised RuntimeError: transient failure"
    # attempt 1 resumed after the last complete round (step 2) and finished the job
    assert result.metrics == {"step": 4, "attempt": 1, "start": 3}
    assert [m["step"] for m in result.metrics_history] == [0, 1, 2, 3, 4]
    assert result.checkpoint.path.endswith("checkpoint_000004")


def test_running_again_with_the_same_name_continues_the_run(tmp_path):
    first = fit(workloads.flaky_fn, 2, tmp_path, "again", {"steps": 2, "fail_at": -1})
    assert first.checkpoint.path.endswith("checkpoint_000001")
    second = fit(workloads.flaky_fn, 2, tmp_path, "again", {"steps": 4, "fail_at": -1})
    assert second.metrics["start"] == 2 and second.metrics["step"] == 3
    # round numbers continue, so no checkpoint of the first run is overwritten
    assert second.checkpoint.path.endswith("checkpoint_000003")
    names = sorted(
        p.name for p in (tmp_path / "again").iterdir() if p.name.startswith("checkpoint")
    )
    assert names == [f"checkpoint_00000{i}" for i in range(4)]


def test_memory_storage_carries_checkpoints_through_a_restart(tmp_path):
    """memory:// lives in the driver: workers stage files locally, the driver publishes them."""
    import fsspec

    url = f"memory://{tmp_path.name}/runs"
    result = rt.Trainer(
        workloads.flaky_fn,
        rt.ScalingConfig(num_workers=2),
        rt.RunConfig(
            name="mem",
            storage_path=url,
            failure_config=rt.FailureConfig(max_failures=1),
            progress="off",
        ),
        train_loop_config={"steps": 5, "fail_at": 3},
    ).fit()
    assert result.metrics == {"step": 4, "attempt": 1, "start": 3}
    assert result.checkpoint.uri.endswith(f"/{tmp_path.name}/runs/mem/checkpoint_000004")
    assert result.checkpoint.uri.startswith("memory://")
    fs = fsspec.filesystem("memory")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"/{tmp_path.name}/runs/mem", detail=False))
    assert "checkpoint_000004" in names and not [n for n in names if n.endswith(".tmp")]
    with result.checkpoint.as_directory() as d:
        assert torch.load(os.path.join(d, "model.pt"), weights_only=True)["step"] == 4


@pytest.mark.parametrize("threads", [1, 3])
def test_resources_per_worker_cpu_sets_torch_threads(tmp_path, threads):
    result = rt.Trainer(
        workloads.threads_fn,
        rt.ScalingConfig(num_workers=2, resources_per_worker={"CPU": threads}),
        rt.RunConfig(name="threads", storage_path=str(tmp_path), progress="off"),
    ).fit()
    for rank in (0, 1):
        assert result.metrics_per_rank[rank] == {"threads": threads, "omp": str(threads)}


def test_second_driver_on_a_running_run_is_refused(tmp_path):
    driver, _ = _start_sleeping_driver(tmp_path)
    try:
        trainer = rt.Trainer(
            workloads.threads_fn,
            rt.ScalingConfig(num_workers=2),
            rt.RunConfig(name="orphans", storage_path=str(tmp_path), progress="off"),
        )
        with pytest.raises(RuntimeError, match=f"already running \\(driver pid {driver.pid}"):
            trainer.fit()
    finally:
        driver.kill()
        driver.wait()
    # Once that driver is dead, the same name resumes normally.
    result = trainer.fit()
    assert result.metrics_per_rank[1]["threads"] == 1
