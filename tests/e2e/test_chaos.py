"""``ringtrain chaos``: campaigns on real worker processes, and the comparison's logic.

Two campaigns (about 3 minutes together on a busy 2-core machine): an exact training survives a
kill mid-checkpoint-write and a driver kill at world size 2 (EXACT); through the command line and
its JSON report, a training whose noise comes from an RNG outside its TrainState is caught after a
random kill (DIVERGED, from the first checkpoint after the resume), and a SIGSTOP without hang
detection is HUNG and leaves no process behind. The seeds are fixed and printed in every
assertion message.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt
import workloads
from ringtrain.chaos import ChaosConfig, Fault, compare, make_plan, run_campaign
from ringtrain.chaos.campaign import campaign_tag
from ringtrain.chaos.display import Display
from ringtrain.chaos.procs import TAG_ENV, kill_tagged, tagged
from support import pids_with_environ

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def leaky_rng_fn(config):
    """Deterministic when never interrupted, but its input noise comes from a generator that is
    not in the TrainState: a resumed attempt restarts the noise, and diverges at once."""
    if "temp_dirs" in config:  # where each worker's multiprocessing temp dir was
        temp = multiprocessing.util.get_temp_dir()
        Path(config["temp_dirs"], os.path.basename(temp)).write_text(temp)
    torch.manual_seed(0)
    random.seed(0)  # unseeded, Python's and NumPy's RNG states would differ between any 2 runs
    np.random.seed(0)
    x, y = torch.randn(48, 4), torch.randint(0, 2, (48,))
    model = rt.prepare_model(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = rt.prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True))
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    noise = torch.Generator().manual_seed(1)  # the bug: not registered in the TrainState
    for _epoch in state.epochs(config.get("epochs", 3)):
        for xb, yb in loader:
            xb = xb + 0.1 * torch.randn(xb.shape, generator=noise)
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            if state.step % 2 == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)


def _chaos_procs(out_dir) -> list[int]:
    """Processes of the campaign in ``out_dir`` still alive (by their environment marker)."""
    return pids_with_environ(f"{TAG_ENV}={campaign_tag(str(out_dir))}-".encode())


# ------------------------------------------------------------------ campaigns (real processes)


def test_exact_training_survives_a_kill_mid_write_and_a_driver_kill(tmp_path):
    seed = 8  # at W=2 and 20 steps: kill rank 0 mid-write after step 5, driver kill at step 11
    config = ChaosConfig(seed=seed, faults=("write", "driver"), faults_per_run=2)
    kinds = [f.kind for f in make_plan(config, 2, 1, 20)]
    assert kinds == ["write", "driver"], f"seed {seed}: plan changed ({kinds}), pick another seed"
    report = run_campaign(
        workloads.exact_fn,
        train_loop_config={
            "epochs": 2,
            "out": str(tmp_path / "out.pt"),
            "kill": None,
            "kill_rank": 0,
        },
        runs=1,
        seed=seed,
        faults=("write", "driver"),
        faults_per_run=2,
        workers=(2,),
        out_dir=str(tmp_path / "chaos"),
        display=Display("off"),
    )
    [clean], [run] = report.clean, report.runs
    assert clean.last_step == 20 and clean.verdict == "CLEAN"
    assert run.verdict == "EXACT", f"seed {run.seed}: {run.detail}"
    assert report.ok
    assert all(f["injected"] for f in run.faults), f"seed {run.seed}: {run.faults}"
    assert run.drivers == 2  # the driver kill was resumed with Trainer.restore(path).fit()
    write = next(f for f in run.faults if f["kind"] == "write")
    assert write["file"].startswith("checkpoint_") and ".tmp/" in write["file"], write
    assert 0 <= write["failure_seen_s"] <= write["recovery_s"], write
    # the kill mid-write is a failure the controller saw; the driver kill is not one
    assert [f["message"] for f in run.failures if f["kind"] == "signal"] == [
        "rank 0 was killed by SIGKILL"
    ], run.failures
    assert run.orphans == [] and len(run.recovery_s) == 2
    summary = report.summary(2)
    assert summary["exact"] == 1 and summary["mean_recovery_s"] > 0
    assert _chaos_procs(tmp_path / "chaos") == []


def test_cli_reports_divergence_at_the_first_checkpoint_after_the_resume(tmp_path):
    seed = 3  # at W=2 and 18 steps: one kill of rank 0 after step 6 (a checkpoint to resume from)
    [fault] = make_plan(ChaosConfig(seed=seed, faults=("kill",), faults_per_run=1), 2, 1, 18)
    assert fault.step >= 4, f"seed {seed}: plan changed ({fault}), pick another seed"
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path[:0] = [{os.path.dirname(os.path.abspath(__file__))!r}, {TESTS!r}]
            import ringtrain as rt
            from test_chaos import leaky_rng_fn as train_fn
            config = {{"epochs": 3}}
            scaling_config = rt.ScalingConfig(num_workers=2)
            """
        )
    )
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "ringtrain.cli", "chaos", str(script), "--runs", "1"),
            *("--seed", str(seed), "--faults", "kill", "--faults-per-run", "1"),
            *("--out", str(tmp_path / "chaos"), "--json", str(out), "--progress", "plain"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    [run] = data["runs"]
    assert run["verdict"] == "DIVERGED", f"seed {run['seed']}: {run}"
    detail = run["detail"]
    found = re.search(
        r"^model parameter \S+ differs from step (\d+) \(checkpoint_(\d+); step (\d+) was "
        r"equal\): the first checkpoint after resuming from checkpoint_(\d+) at world size 2 "
        r"\(attempt 1\)$",
        detail,
    )
    assert found, detail
    step, round_, equal_step, resumed_round = map(int, found.groups())
    assert step == equal_step + 2 and round_ == resumed_round + 1, detail  # a report every 2 steps
    assert equal_step <= run["faults"][0]["fired_at_step"] + 2, (detail, run["faults"])
    assert "DIVERGED" in proc.stdout and data["ok"] is False
    assert data["summary"][0]["diverged"] == 1
    assert _chaos_procs(tmp_path / "chaos") == []


def test_sigstop_without_hang_detection_is_hung_and_leaves_no_process(tmp_path):
    seed = 0  # at W=2 and --steps 10 (of 12): SIGSTOP of rank 0 at step 2
    [fault] = make_plan(ChaosConfig(seed=seed, faults=("hang",), faults_per_run=1), 2, 1, 10)
    assert fault.step <= 3, f"seed {seed}: plan changed ({fault}), pick another seed"
    temp_dirs = tmp_path / "temp-dirs"
    temp_dirs.mkdir()
    report = run_campaign(
        leaky_rng_fn,
        train_loop_config={"epochs": 2, "temp_dirs": str(temp_dirs)},
        scaling_config=rt.ScalingConfig(num_workers=2),
        steps=10,
        runs=1,
        seed=seed,
        faults=("hang",),
        faults_per_run=1,
        hang_timeout_s=None,
        # Twice a clean run's time, counted from the faulty run's first step: the run is
        # SIGSTOPped at step 2 of 10 and hangs for good, so any budget ends it HUNG. (Counted
        # from the driver's start, a start-up slowed by a CPU burner used the budget up before
        # step 2: "the SIGSTOP never fired".)
        budget_s="2x",
        out_dir=str(tmp_path / "chaos"),
        display=Display("off"),
    )
    [run] = report.runs
    assert report.clean[0].last_step == 10  # stopped cleanly at --steps, 2 steps early
    assert run.verdict == "HUNG", f"seed {run.seed}: {run.detail}"
    assert run.faults[0]["injected"], f"seed {run.seed}: the SIGSTOP never fired: {run.faults}"
    assert "killed with every process of the run" in run.detail and not report.ok
    assert run.faults[0]["detected"] is False  # no FailureConfig.worker_timeout_s: nobody saw it
    assert _chaos_procs(tmp_path / "chaos") == []
    # No file of theirs either: the campaign killed the reaper with the run, so it removed the
    # workers' multiprocessing temp dirs itself (the clean run's zygote removed its workers').
    temps = [p.read_text() for p in temp_dirs.iterdir()]
    assert len(temps) == 4, temps  # 2 ranks of the clean run, 2 of the hung one
    assert [t for t in temps if os.path.exists(t)] == []


# ------------------------------------------------------------------ logic (no processes)


def test_budget_is_seconds_or_a_multiple_of_the_clean_run():
    assert ChaosConfig(budget_s="90").budget_for(10.0) == 90.0
    assert ChaosConfig(budget_s="2.5x").budget_for(10.0) == 25.0
    assert ChaosConfig().budget_for(10.0) == 110.0


def test_plans_are_seeded_ordered_and_in_range():
    config = ChaosConfig(seed=7, faults_per_run=4, workers=(3,))
    plan = make_plan(config, 3, 1, 10)
    assert plan == make_plan(config, 3, 1, 10)
    assert plan != make_plan(config, 3, 2, 10)
    assert [f.step for f in plan] == sorted(f.step for f in plan)
    assert all(1 <= f.step <= 9 and 0 <= f.rank < 3 for f in plan)
    with pytest.raises(ValueError, match="at least 2"):
        make_plan(config, 3, 1, 1)
    assert Fault("driver", 0, 4).describe() == "driver kill @ step 4"


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [
        ("runs", 0, "--runs"),
        ("faults", ("kill", "meteor"), "--faults"),
        ("workers", (2, 0), "--workers"),
        ("steps", 1, "--steps"),
        ("budget_s", -1.0, "--budget"),
        ("budget_s", "fast", "--budget"),
    ],
)
def test_config_errors_name_the_flag(field, value, flag):
    with pytest.raises(ValueError, match=f"ChaosConfig.{field} \\({flag}\\)"):
        ChaosConfig(**{field: value})


def _state(momentum: float, rng_byte: int = 0) -> dict:
    return {
        "train_state.pt": {
            "step": 8,
            "objects": {
                "model": {"w": torch.ones(2)},
                "optimizer": {
                    "state": {
                        0: {"momentum_buffer": torch.ones(2)},
                        3: {"m": torch.tensor([momentum])},
                    },
                    "param_groups": [{"lr": 0.1}],
                },
            },
        },
        "rank_00001.pt": {"rng": {"torch": torch.tensor([rng_byte], dtype=torch.uint8)}},
    }


def test_first_difference_is_named_in_words():
    assert compare.compare_checkpoints(_state(1.0), _state(1.0)) is None
    assert compare.compare_checkpoints(_state(1.0), _state(1.0 + 1e-7)) == (
        "optimizer state of param 3 (m)"
    )
    assert compare.compare_checkpoints(_state(1.0), _state(1.0, 1)) == "RNG state of rank 1 (torch)"
    nan = torch.tensor([float("nan"), 1.0])
    assert compare.first_difference(nan, nan.clone()) is None  # NaNs in the same places
    assert compare.first_difference(torch.zeros(2), torch.zeros(2, dtype=torch.float64)) == ()


def test_cli_refuses_bad_options_and_targets_before_running(tmp_path):
    def chaos(*args):
        return subprocess.run(
            [sys.executable, "-m", "ringtrain.cli", "chaos", *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )

    script = tmp_path / "plain.py"
    script.write_text("print('a per-worker script, no train_fn')\n")
    bad = chaos(str(script), "--faults", "kill,flood")
    assert bad.returncode == 2 and "--faults" in bad.stderr and "flood" in bad.stderr
    bad = chaos(str(script), "--workers", "2,x")
    assert bad.returncode == 2 and "--workers" in bad.stderr
    bad = chaos(str(script))
    assert bad.returncode == 2 and "must define train_fn" in bad.stderr
    bad = chaos(str(tmp_path / "missing"))
    assert bad.returncode == 2 and "neither a script nor a run directory" in bad.stderr
    script_run = tmp_path / "runs" / "script_run"  # a `ringtrain run SCRIPT` run: no train_fn
    script_run.mkdir(parents=True)
    (script_run / "config.json").write_text(json.dumps({"name": "script_run", "script": "t.py"}))
    bad = chaos(str(script_run))
    assert bad.returncode == 2 and f"SCRIPT_OR_RUN {str(script_run)!r}" in bad.stderr, bad.stderr
    assert not (tmp_path / "chaos").exists()


def test_processes_of_a_run_are_found_by_their_tag_and_killed(tmp_path):
    env = dict(os.environ, **{TAG_ENV: "test-orphan"})
    # a detached grandchild, as a worker's leftover would be: its parent exits at once
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import subprocess; subprocess.Popen(['sleep', '60'], start_new_session=True)",
        ],
        env=env,
        check=True,
        timeout=60,
    )
    [orphan] = tagged("test-orphan")
    assert orphan.cmdline == "sleep 60" and tagged("another-run") == []
    kill_tagged("test-orphan")
    assert tagged("test-orphan") == []


def test_each_checkpoint_knows_the_resume_and_driver_before_it(tmp_path):
    events = [
        {"type": "run_start", "world_size": 3, "attempt": 0},
        {"type": "checkpoint", "round": 0},
        {"type": "failure", "rank": 1, "kind": "signal"},
        {"type": "resume", "attempt": 1, "checkpoint": str(tmp_path / "checkpoint_000000")},
        {"type": "run_start", "world_size": 3, "attempt": 1},
        {"type": "checkpoint", "round": 1},
        {"type": "checkpoint", "round": 2},
        # the driver was killed; a new one resumes at attempt 0
        {"type": "resume", "attempt": 0, "checkpoint": str(tmp_path / "checkpoint_000002")},
        {"type": "run_start", "world_size": 3, "attempt": 0},
        {"type": "checkpoint", "round": 3},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    writers = compare.writers_of(str(tmp_path))
    assert "before any resume" in compare.context_of(writers[0])
    assert compare.context_of(writers[1]) == (
        "the first checkpoint after resuming from checkpoint_000000 at world size 3 (attempt 1)"
    )
    assert compare.context_of(writers[2]).startswith("a checkpoint after resuming from ")
    assert compare.context_of(writers[3]) == (
        "the first checkpoint after resuming from checkpoint_000002 at world size 3 "
        "(attempt 0 of driver 2)"
    )


def test_a_bit_flip_campaign_is_caught_by_the_replica_check_and_ends_exact(tmp_path):
    """``--faults bitflip``: the campaign's runs check their replicas every step; a flipped bit
    in one rank's parameters at W=3 is caught, the run rolls back and ends EXACT."""
    seed = 3
    report = run_campaign(
        workloads.exact_fn,
        train_loop_config={
            "epochs": 2,
            "out": str(tmp_path / "out.pt"),
            "kill": None,
            "kill_rank": 0,
        },
        runs=1,
        seed=seed,
        faults=("bitflip",),
        faults_per_run=1,
        workers=(3,),
        out_dir=str(tmp_path / "chaos"),
        display=Display("off"),
    )
    [run] = report.runs
    assert run.verdict == "EXACT", f"seed {run.seed}: {run.detail}"
    [fault] = run.faults
    assert fault["injected"], f"seed {run.seed}: {run.faults}"
    lines = Path(run.run_dir, "events.jsonl").read_text().splitlines()
    caught = [e for e in map(json.loads, lines) if e["type"] == "replica_mismatch"]
    assert caught and caught[0]["ranks"] == [fault["rank"]] and caught[0]["named"], caught
    assert caught[0]["step"] == fault["fired_at_step"] + 1, (fault, caught)  # every step
    assert run.failures == [] or all(f["kind"] == "exception" for f in run.failures)
    with pytest.raises(ValueError, match="bitflip, which replicas detect"):
        ChaosConfig(faults=("bitflip",), workers=(1,))


@pytest.mark.parametrize(
    "scaling",
    [
        {"num_workers": (2, 3)},
        {"num_workers": 2, "spares": 1},
        {"num_workers": 2, "backend": "ray"},
    ],
)
def test_a_target_it_cannot_kill_by_pid_is_refused_before_running(scaling):
    """The campaign compares fixed-size local runs: an elastic run, one with hot spares (a
    spare takes the killed rank in place) or a Ray run is refused, naming the fix."""
    import ringtrain as rt
    from ringtrain.chaos.campaign import run_campaign

    with pytest.raises(ValueError, match=r"spares=0"):
        run_campaign(lambda config: None, scaling_config=rt.ScalingConfig(**scaling))
