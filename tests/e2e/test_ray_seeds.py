"""The seed documents' snippets (``tests/seeds/``, written with Ray's imports) run on ringtrain
with only their import lines changed (issue 40).

Each is ported by ``tests/ray_port.py`` (import lines only, checked) into the test's directory
and run as a user runs a script, ``python seedNNN.py`` in a fresh directory (default storage
``./runs``); the test then reads what it printed and what it wrote.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ray_port import changed_lines, port

SEEDS = Path(__file__).resolve().parents[1] / "seeds"


def _ported(name: str, tmp_path: Path) -> Path:
    original = (SEEDS / name).read_text()
    ported, _ = port(original)  # asserts that it changed import lines only
    for ray_line, ours in changed_lines(original):
        assert re.search(r"\bray\b", ray_line) and "ringtrain" in ours, (ray_line, ours)
    assert not re.search(r"^\s*(from|import) ray\b", ported, re.MULTILINE), ported
    script = tmp_path / name
    script.write_text(ported)
    return script


def _run(script: Path, *args: str, timeout: float = 400) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=script.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


def _events(run_dir: Path) -> list[dict]:
    with open(run_dir / "events.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.timeout(400)
def test_seed001_tuner_over_a_torch_trainer_runs_every_grid_point(tmp_path):
    """``tune.Tuner(trainer, param_space={"train_loop_config": {"lr": tune.grid_search([...])}})``
    with no TuneConfig: every grid point is a 2-worker trial, and each trial's function gets the
    trainer's ``train_loop_config`` with its ``lr`` merged in."""
    pytest.importorskip("optuna")
    out = _run(_ported("seed001_tune.py", tmp_path))
    trials = re.findall(r"^trial (\S+) (\S+)$", out, re.MULTILINE)
    assert sorted(float(lr) for lr, _ in trials) == [1e-5, 1e-4, 1e-3], out
    best = re.search(r"^best lr (\S+)$", out, re.MULTILINE)
    assert best and float(best.group(1)) == 1e-3, out  # the largest step lowers the loss most
    (sweep,) = (tmp_path / "runs").iterdir()
    dirs = sorted(p for p in sweep.iterdir() if p.name.startswith("trial_"))
    assert len(dirs) == 3
    for trial in dirs:
        assert json.loads((trial / "result.json").read_text())["status"] == "FINISHED"
        reports = [e for e in _events(trial) if e.get("type") == "report"]
        assert {e["rank"] for e in reports} == {0, 1}  # 2 workers, the trainer's
        assert sorted({e["metrics"]["epoch"] for e in reports}) == [0, 1, 2]  # epochs=3 kept


@pytest.mark.timeout(400)
def test_seed003_checkpoint_from_dict_resumes_from_to_dict(tmp_path):
    """``report(..., checkpoint=Checkpoint.from_dict({"model", "optimizer", "epoch"}))`` on every
    rank, and ``get_checkpoint().to_dict()`` to resume: run for 2 epochs, then again under the
    same name for 4; the second run starts at epoch 2 from the first one's dict."""
    script = _ported("seed003_checkpoint_dict.py", tmp_path)
    first = _run(script, "2")
    assert "epoch 1 start 0" in first and "checkpoint epoch 1" in first, first
    assert "both wrote" not in first  # every rank's dict.pt is the same bytes: no note
    second = _run(script, "4")
    assert "epoch 3 start 2" in second and "checkpoint epoch 3" in second, second
    run = tmp_path / "runs" / "seed003_dict"
    reports = [e for e in _events(run) if e.get("type") == "report" and e["rank"] == 0]
    assert [e["metrics"]["epoch"] for e in reports] == [0, 1, 2, 3]  # none repeated, none lost
    losses = [e["metrics"]["loss"] for e in reports]
    assert losses[2] < losses[1]  # the optimizer went on from where it was
    for ckpt in run.glob("checkpoint_*"):
        assert sorted(p.name for p in ckpt.iterdir()) == ["dict.pt", "manifest.json"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("seed", "package"),
    [
        ("seed003_lightning.py", "lightning.pytorch"),
        ("seed004_pytorch_lightning.py", "pytorch_lightning"),
    ],
)
def test_seed003_and_004_lightning_on_ray_train_names(tmp_path, seed, package):
    """``strategy=RayDDPStrategy()``, ``plugins=[RayLightningEnvironment()]``,
    ``callbacks=[RayTrainReportCallback()]`` and ``prepare_trainer`` from
    ``ringtrain.train.lightning``, with ``import lightning.pytorch as pl`` (seed 003) and
    ``import pytorch_lightning as pl`` (seed 004): 2 workers train 3 epochs and keep the 2 best
    checkpoints by val_loss; with seed 003, a second run under the same name resumes through
    Ray's own snippet (``checkpoint.as_directory()`` + ``RayTrainReportCallback.CHECKPOINT_NAME``).
    Seed 004 does not repeat the resume: its script is seed 003's with the other package name,
    and the resume goes through the same ringtrain code (its classes' names are checked by the
    first run)."""
    pytest.importorskip(package)
    script = _ported(seed, tmp_path)
    first = _run(script, "3")
    assert re.search(r"^val_loss \S+ epoch 2$", first, re.MULTILINE), first
    name = seed.split("_")[0]
    run = tmp_path / "runs" / name
    kept = sorted(p.name for p in run.glob("checkpoint_*"))
    assert 2 <= len(kept) <= 3, kept  # the 2 best by val_loss, and the latest
    if package == "pytorch_lightning":
        return
    second = _run(script, "5")
    assert re.search(r"^val_loss \S+ epoch 4$", second, re.MULTILINE), second
    reports = [e for e in _events(run) if e.get("type") == "report" and e["rank"] == 0]
    assert [e["metrics"]["epoch"] for e in reports] == [0, 1, 2, 3, 4]  # resumed after epoch 2
    assert {e["rank"] for e in _events(run) if e.get("type") == "report"} == {0, 1}
