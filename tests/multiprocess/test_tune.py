"""Sweeps (issue 6) on real worker processes: every trial is a ringtrain run over gloo.

The workload (``tune_workloads.regression_fn``) is SGD on a linear regression: learning rates
below ~1 converge, above ~1 diverge, so a space half of whose points diverge has a known answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

import ringtrain as rt
import tune_workloads
from ringtrain import tune
from ringtrain.tune.resources import ResourcePool, check_fits, trial_demand
from support import wait_until

pytest.importorskip("optuna")

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_config(tmp_path, name, **kw):
    return rt.RunConfig(name=name, storage_path=str(tmp_path / "runs"), progress="off", **kw)


def _intervals(log_dir):
    out = []
    for f in sorted(os.listdir(log_dir)):
        with open(os.path.join(log_dir, f)) as fh:
            out += [json.loads(line) for line in fh]
    return out


def _max_overlap(records):
    points = sorted([(r["start"], 1) for r in records] + [(r["end"], -1) for r in records])
    now = peak = 0
    for _, delta in points:
        now += delta
        peak = max(peak, now)
    return peak


# ------------------------------------------------------------------------------ pure logic
def test_resource_pool_is_gang_scheduled():
    demand = trial_demand(rt.ScalingConfig(num_workers=2))
    assert demand == {"CPU": 2.0}
    pool = ResourcePool({"CPU": 5.0})
    assert pool.concurrency(demand) == 2
    pool.take(demand)
    pool.take(demand)
    assert not pool.fits(demand)  # 1 CPU left: half a trial never starts
    gpu = ResourcePool({"CPU": 8.0, "GPU": 4.0}, max_concurrent=3)
    gdemand = trial_demand(rt.ScalingConfig(num_workers=2, use_gpu=True))
    assert gdemand == {"CPU": 2.0, "GPU": 2.0}
    first, second = gpu.take(gdemand), gpu.take(gdemand)
    assert (first, second) == ([0, 1], [2, 3])  # disjoint devices per trial
    assert not gpu.fits(gdemand)
    gpu.give_back(gdemand, first)
    assert gpu.take(gdemand) == [0, 1]


def test_a_trial_that_cannot_fit_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match=r"a trial needs 4 CPU .* has 2 CPU"):
        check_fits({"CPU": 4.0}, {"CPU": 2.0}, "this machine")
    tuner = tune.Tuner(
        tune_workloads.regression_fn,
        param_space={"lr": 0.1},
        tune_config=tune.TuneConfig(metric="score", mode="max", resources={"CPU": 1}),
        scaling_config=rt.ScalingConfig(num_workers=2),
        run_config=_run_config(tmp_path, "toobig"),
    )
    with pytest.raises(ValueError, match=r"TuneConfig\(resources="):
        tuner.fit()
    assert not (tmp_path / "runs" / "toobig").exists()


def test_tune_config_errors_name_the_field():
    with pytest.raises(ValueError, match=r"TuneConfig\.mode"):
        tune.TuneConfig(metric="a", mode="maximize")
    with pytest.raises(ValueError, match=r"TuneConfig\.num_samples"):
        tune.TuneConfig(num_samples=0)
    with pytest.raises(ValueError, match=r"TuneConfig\.max_concurrent_trials"):
        tune.TuneConfig(max_concurrent_trials=0)
    with pytest.raises(ValueError, match=r"TuneConfig\.storage"):
        tune.TuneConfig(storage="study.db")
    with pytest.raises(ValueError, match=r"TuneConfig\(metric='score'\) needs mode="):
        tune.Tuner(tune_workloads.regression_fn, tune_config=tune.TuneConfig(metric="score"))
    # As in Ray Tune, a sweep needs no metric (tests/unit/test_tune_ray_form.py).
    assert tune.Tuner(tune_workloads.regression_fn, param_space={"lr": 0.1}).metric is None


# ------------------------------------------------------------------------------ real sweeps
def test_random_and_tpe_run_num_samples_trials_in_bounds(tmp_path):
    for alg in ("random", "tpe"):
        grid = tune.Tuner(
            tune_workloads.regression_fn,
            param_space={"lr": tune.loguniform(1e-3, 0.3), "rounds": 2, "nested": {"k": 3}},
            tune_config=tune.TuneConfig(
                metric="score",
                mode="max",
                num_samples=3,
                search_alg=alg,
                seed=1,
                resources={"CPU": 2},
            ),
            run_config=_run_config(tmp_path, f"sweep_{alg}"),
        ).fit()
        assert len(grid) == 3 and grid.statuses == ["COMPLETE"] * 3
        lrs = [r.config["lr"] for r in grid]
        assert all(1e-3 <= lr <= 0.3 for lr in lrs) and len(set(lrs)) == 3
        assert all(r.config["nested"] == {"k": 3} and r.config["rounds"] == 2 for r in grid)
        trials = ["trial_0000", "trial_0001", "trial_0002"]
        expected = ["study.db", "tuner.json", "tuner.pkl", "tuner.pkl.sig", *trials]
        assert sorted(os.listdir(grid.path)) == sorted(expected)
        best = grid.get_best_result()
        assert best.metrics["score"] == max(r.metrics["score"] for r in grid)
        assert best.checkpoint is not None and best.path.endswith(
            f"trial_{lrs.index(best.config['lr']):04d}"
        )
        df = grid.get_dataframe()
        assert list(df["config/lr"]) == lrs and list(df["status"]) == ["COMPLETE"] * 3
        assert (df["iterations"] == 2).all() and (df["worker_seconds"] > 0).all()


def test_a_sweep_in_a_warm_pool_block_forks_its_trials_from_the_blocks_zygote(tmp_path, _warm_pool):
    """In an open ``rt.warm_pool()`` block (the session's), a sweep starts no zygote of its
    own: every trial's workers are the block's zygote's children, and the zygote outlives the
    sweep."""
    grid = tune.Tuner(
        tune_workloads.parent_fn,
        param_space={"k": tune.grid_search([1, 2])},
        tune_config=tune.TuneConfig(metric="score", mode="max", resources={"CPU": 2}),
        scaling_config=rt.ScalingConfig(num_workers=2),
        run_config=_run_config(tmp_path, "in_block"),
    ).fit()
    assert grid.statuses == ["COMPLETE", "COMPLETE"]
    zygote = _warm_pool.zygote_pid
    assert zygote is not None and {r.metrics["ppid"] for r in grid} == {zygote}
    assert _warm_pool.zygote_pid == zygote  # still up: the block's, not the sweep's


def test_asha_prunes_the_diverging_half_and_keeps_the_best(tmp_path):
    good, bad = [0.05, 0.1, 0.2, 0.3], [1.8, 2.2, 2.6, 3.0]
    grid = tune.Tuner(
        tune_workloads.regression_fn,
        param_space={"lr": tune.grid_search(good + bad), "rounds": 6, "sleep_s": 0.2},
        tune_config=tune.TuneConfig(
            metric="score",
            mode="max",
            scheduler=tune.ASHAScheduler(grace_period=1, reduction_factor=3),
            resources={"CPU": 2},
        ),
        run_config=_run_config(tmp_path, "asha"),
    ).fit()
    status = {r.config["lr"]: s for r, s in zip(grid, grid.statuses, strict=True)}
    assert all(status[lr] == "PRUNED" for lr in bad), status
    assert "COMPLETE" in [status[lr] for lr in good]
    best = grid.get_best_result()
    assert best.config["lr"] in good and status[best.config["lr"]] == "COMPLETE"
    study_trials = {t.number: t for t in grid.study.get_trials()}
    for result, s in zip(grid, grid.statuses, strict=True):
        if s != "PRUNED":
            continue
        number = int(result.path.rsplit("_", 1)[1])
        pruned_at = max(study_trials[number].intermediate_values)  # the step it was pruned at
        if result.config["lr"] in bad:
            assert pruned_at == 1  # the first rung: grace_period=1
        with open(os.path.join(result.path, "result.json")) as f:
            run = json.load(f)
        # Its workers were stopped within one report round of the decision (rounds of ~0.2 s).
        assert run["status"] == "STOPPED" and run["rounds"] <= pruned_at + 1 < 6
    assert sum(t.state.name == "PRUNED" for t in study_trials.values()) == grid.num_pruned >= 4


def test_gang_scheduling_never_exceeds_capacity(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    grid = tune.Tuner(
        tune_workloads.regression_fn,
        param_space={
            "lr": tune.grid_search([0.01, 0.02, 0.03, 0.04]),
            "log": str(log),
            "rounds": 2,
            "sleep_s": 0.2,
        },
        tune_config=tune.TuneConfig(metric="score", mode="max", resources={"CPU": 5}),
        scaling_config=rt.ScalingConfig(num_workers=2),
        run_config=_run_config(tmp_path, "gang"),
    ).fit()
    assert grid.statuses == ["COMPLETE"] * 4
    records = _intervals(log)
    assert len(records) == 8  # 4 trials x 2 workers
    assert _max_overlap(records) <= 4  # 2 trials of 2 workers fit in 5 CPUs, never 3
    trials = sorted(grid.study.get_trials(), key=lambda t: t.number)
    # The first two trials were started together (both fit), before either ended.
    assert trials[1].datetime_start < trials[0].datetime_complete


def test_a_crashing_trial_is_retried_then_recorded_failed_and_the_sweep_goes_on(tmp_path):
    grid = tune.Tuner(
        tune_workloads.regression_fn,
        param_space={
            "lr": 0.1,
            "rounds": 2,
            "crash": tune.grid_search(["never", "once", "always"]),
        },
        tune_config=tune.TuneConfig(metric="score", mode="max", resources={"CPU": 2}),
        run_config=_run_config(tmp_path, "crash", failure_config=rt.FailureConfig(max_failures=1)),
    ).fit()
    by_crash = {r.config["crash"]: (r, s) for r, s in zip(grid, grid.statuses, strict=True)}
    assert by_crash["never"][1] == "COMPLETE" and not by_crash["never"][0].failures
    once, once_status = by_crash["once"]
    assert once_status == "COMPLETE" and len(once.failures) == 1  # retried from its checkpoint
    always, always_status = by_crash["always"]
    assert always_status == "FAILED" and len(always.failures) == 2
    assert "trial crash (always)" in str(always.error)
    assert grid.num_errors == 1
    df = grid.get_dataframe()
    assert "RuntimeError" in df[df["status"] == "FAILED"]["error"].iloc[0]


SWEEP_SCRIPT = """
import ringtrain as rt
from ringtrain import tune
from tune_workloads import regression_fn as train_fn

param_space = {{"lr": tune.grid_search([0.01, 0.05, 0.1]), "rounds": {rounds},
               "sleep_s": {sleep}, "marker": {marker!r}}}
tune_config = tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=1)
run_config = rt.RunConfig(name="cli_sweep", storage_path={storage!r}, progress="plain")
"""


def _script(tmp_path, rounds=2, sleep=0.0, marker=None):
    path = tmp_path / "sweep.py"
    path.write_text(
        textwrap.dedent(
            SWEEP_SCRIPT.format(
                rounds=rounds, sleep=sleep, marker=marker, storage=str(tmp_path / "runs")
            )
        )
    )
    return path


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([HERE, env.get("PYTHONPATH", "")])
    return env


def test_cli_grid_sweep_visits_every_point(tmp_path):
    script = _script(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "ringtrain", "tune", str(script)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cli_sweep finished: 3 complete" in out.stdout
    grid = tune.Tuner.restore(str(tmp_path / "runs" / "cli_sweep")).fit()  # nothing left to run
    assert sorted(r.config["lr"] for r in grid) == [0.01, 0.05, 0.1]
    assert grid.statuses == ["COMPLETE"] * 3


def test_cli_refuses_a_script_without_a_tune_config(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("def train_fn(config):\n    pass\nparam_space = {}\n")
    out = subprocess.run(
        [sys.executable, "-m", "ringtrain", "tune", str(script)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=60,
    )
    assert out.returncode == 2
    assert "tune_config" in out.stderr


def test_sweep_resumes_after_the_driver_is_killed(tmp_path):
    marker = tmp_path / "marker"
    marker.mkdir()
    script = _script(tmp_path, rounds=4, sleep=0.3, marker=str(marker))
    sweep = tmp_path / "runs" / "cli_sweep"
    driver = subprocess.Popen(
        [sys.executable, "-m", "ringtrain", "tune", str(script)],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Kill the driver once trial 1 has a checkpoint (trial 0 is complete by then).
        assert wait_until(
            lambda: (sweep / "trial_0001" / "checkpoint_000001").exists(), timeout_s=120
        )
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    with open(sweep / "trial_0000" / "result.json") as f:
        trial0 = json.load(f)
    assert trial0["status"] == "FINISHED"
    grid = tune.Tuner.restore(str(sweep)).fit()
    assert grid.statuses == ["COMPLETE"] * 3
    with open(sweep / "trial_0000" / "result.json") as f:
        assert json.load(f)["end_time"] == trial0["end_time"]  # a finished trial is kept
    with open(sweep / "trial_0001" / "events.jsonl") as f:
        events = [json.loads(line) for line in f]
    resumes = [e for e in events if e["type"] == "resume"]
    assert resumes and "checkpoint_00000" in resumes[0]["checkpoint"]  # from its checkpoint
    assert [r.metrics["step"] for r in grid] == [16, 16, 16]


# ------------------------------------------------------------------------------ the numbers shown


def _scored_rows():
    """Trial 3 ends at 0.967 after a peak of 0.969; trial 1 ends lower (0.960) after a higher
    peak (0.968); trial 2 failed: the case where "best" by last and by peak differ."""
    from ringtrain.tune.progress import TrialRow

    return [
        TrialRow(0, {"lr": 0.1}, "COMPLETE", 3, 0.951, 0.951, started=0.0, ended=1.0),
        TrialRow(1, {"lr": 0.2}, "COMPLETE", 3, 0.960, 0.968, started=0.0, ended=1.0),
        TrialRow(2, {"lr": 0.3}, "FAILED", 1, None, None, started=0.0, ended=1.0, error="x"),
        TrialRow(3, {"lr": 0.4}, "COMPLETE", 3, 0.967, 0.969, started=0.0, ended=1.0),
    ]


def _cells(text, trial):
    """The header cells and trial ``trial``'s cells of a rendered rich table."""
    lines = text.splitlines()
    header = next(line for line in lines if "trial" in line and "status" in line)
    row = next(line for line in lines if line.strip("│┃ ").startswith(f"{trial:04d}"))
    split = lambda line: [
        c.strip() for c in line.strip().strip("│┃").split("│" if "│" in line else "┃")
    ]
    return split(header), split(row)


def test_the_best_trial_and_its_value_are_the_same_everywhere():
    """One definition of a trial's value (its last report, what Optuna records): the headline,
    the star, the table's cells and ``get_best_result()`` agree, and no column called "best"
    shows another number."""
    import io

    from rich.console import Console

    from ringtrain.result import Result
    from ringtrain.tune.progress import SweepDisplay
    from ringtrain.tune.result import ResultGrid

    rows = _scored_rows()
    display = SweepDisplay("sweep", "val_acc", "max", ["lr"], mode_display="off")
    for row in rows:
        display.add(row)
    headline = display.counts_text()
    assert "best trial 0003: val_acc=0.967" in headline, headline
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(display.table())
    header, cells = _cells(buf.getvalue(), 3)
    assert cells[0] == "0003 *", cells
    assert cells[header.index("val_acc")] == "0.967", (header, cells)
    for name, cell in zip(header, cells, strict=True):
        if "best" in name:  # a "best" column must not contradict the headline
            assert cell == "0.967", (name, cell, buf.getvalue())
    assert cells[header.index("peak val_acc")] == "0.969", (header, cells)

    histories = {0: [0.9, 0.951], 1: [0.968, 0.960], 2: [], 3: [0.969, 0.967]}
    results = [
        Result(
            metrics={"val_acc": histories[r.number][-1]} if histories[r.number] else {},
            path=f"trial_{r.number:04d}",
            metrics_history=[{"val_acc": v} for v in histories[r.number]],
        )
        for r in rows
    ]
    grid = ResultGrid(results, rows, path="sweep", metric="val_acc", mode="max", columns=["lr"])
    assert grid.get_best_result().path == "trial_0003"
    assert grid.get_best_result(scope="all").path == "trial_0003"  # 0.969 is its peak too
    # Minimising: the lowest last value wins, ties go to the lower trial number.
    display_min = SweepDisplay("sweep", "loss", "min", ["lr"], mode_display="off")
    for row in _scored_rows():
        row.last = 0.5 if row.last is not None else None
        display_min.add(row)
    best = display_min.best_row()
    assert best is not None and best.number == 0


@pytest.mark.timeout(240)
def test_the_final_table_is_shown_once_in_a_terminal(tmp_path):
    """In a real terminal (tmux), the live table is replaced by the final one: not both."""
    import pickle
    import shutil
    import time

    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    script = tmp_path / "sweep_screen.py"
    done = tmp_path / "done"
    rows = tmp_path / "rows.pkl"
    rows.write_bytes(pickle.dumps(_scored_rows()))
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            sys.path.insert(0, {os.path.join(HERE, os.pardir, "src")!r})
            import pickle
            from ringtrain.tune.progress import SweepDisplay

            with open({str(rows)!r}, "rb") as f:
                rows = pickle.load(f)
            display = SweepDisplay("sweep", "val_acc", "max", ["lr"], mode_display="rich")
            display.start("4 trials")
            for row in rows:
                display.add(row)
                time.sleep(0.3)  # the live table redraws (4 times a second)
            display.summary()
            display.close()
            print("SWEEP-SCREEN-DONE", flush=True)
            open({str(done)!r}, "w").close()
            time.sleep(300)
            """
        )
    )
    sock = f"ringtrain-test-{os.getpid()}"
    tmux = ["tmux", "-L", sock]
    subprocess.run(
        [*tmux, "new-session", "-d", "-x", "100", "-y", "50", f"{sys.executable} {script}"],
        check=True,
        env={**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"},
    )
    try:
        assert wait_until(done.exists, timeout_s=180), "the sweep screen script did not finish"
        time.sleep(0.2)
        screen = subprocess.run(
            [*tmux, "capture-pane", "-p", "-S", "-200"], check=True, capture_output=True, text=True
        ).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], check=False)
    assert "SWEEP-SCREEN-DONE" in screen, screen
    headers = [line for line in screen.splitlines() if "trial" in line and "status" in line]
    assert len(headers) == 1, screen
    assert screen.count("sweep finished:") == 1, screen
    assert "best trial 0003: val_acc=0.967" in " ".join(screen.split()), screen
