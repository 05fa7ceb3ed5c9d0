"""``ringtrain run SCRIPT`` where the script calls ``rt.Trainer(..., run_config=...).fit()``
itself (issue 40): the script's retention and failure settings are honoured, what cannot apply
once the run has started (its name, storage path, callbacks) is said, and the script's
``Result.checkpoint`` is the run's latest checkpoint, also after the run is continued."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import ringtrain as rt

    SCORES = [0.5, 0.9, 0.6, 0.8, 0.7, 0.4]

    def train_fn(config):
        model = rt.prepare_model(torch.nn.Linear(2, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = rt.TrainState(model=model, optimizer=optimizer)
        state.restore()
        for epoch in state.epochs(config["epochs"]):
            loss = model(torch.ones(4, 2)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            rt.report({"val_acc": SCORES[epoch], "epoch": epoch}, checkpoint=state)

    if __name__ == "__main__":
        result = rt.Trainer(
            train_fn,
            train_loop_config={"epochs": int(sys.argv[1])},
            run_config=rt.RunConfig(
                name="the_scripts_name",
                checkpoint_config=rt.CheckpointConfig(
                    num_to_keep=2,
                    checkpoint_score_attribute="val_acc",
                    checkpoint_score_order="max",
                ),
                failure_config=rt.FailureConfig(max_failures=1),
            ),
        ).fit()
        if rt.get_context().world_rank == 0:
            ckpt = result.checkpoint
            print("RESULT", ckpt.path.rsplit("/", 1)[-1] if ckpt else None, result.metrics["epoch"])
    """
)


def _run(tmp_path: Path, *args: str) -> str:
    ringtrain = Path(sys.executable).with_name("ringtrain")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
    done = subprocess.run(
        [str(ringtrain), "run", "-n", "2", "--name", "cfg", "--storage-path", "runs",
         "--progress", "plain", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


@pytest.mark.timeout(600)
def test_the_scripts_run_config_is_honoured_or_said(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    out = _run(tmp_path, "script.py", "6")
    kept = sorted(p.name for p in (tmp_path / "runs" / "cfg").glob("checkpoint_*"))
    # The 2 best by val_acc (epochs 1 and 3) and the latest (5), as the script asks.
    assert kept == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000005"], (kept, out)
    assert "RESULT checkpoint_000005 5" in out, out
    assert re.search(r"script's RunConfig.*num_to_keep=2", out), out
    assert re.search(r"RunConfig\(name='the_scripts_name'\) does not apply", out), out

    # Continued (same name, more epochs): Result.checkpoint is the new latest, not the
    # checkpoint the run was restored from. (The checkpoints are taken inside the epoch, so the
    # continued run repeats epoch 5 as round 6; rounds 7 and 8 are epochs 6 and 7.)
    scores = "0.5, 0.9, 0.6, 0.8, 0.7, 0.4, 0.3, 0.95"
    (tmp_path / "script.py").write_text(SCRIPT.replace("0.5, 0.9, 0.6, 0.8, 0.7, 0.4", scores))
    out = _run(tmp_path, "script.py", "8")
    assert "resuming from" in out and "checkpoint_000005" in out, out
    assert "RESULT checkpoint_000008 7" in out, out
    kept = sorted(p.name for p in (tmp_path / "runs" / "cfg").glob("checkpoint_*"))
    assert kept == ["checkpoint_000001", "checkpoint_000008"], (kept, out)  # 0.9 and 0.95
