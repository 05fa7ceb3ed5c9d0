"""The README's main job, run as a user runs it: real MNIST digits, 2 worker processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def test_mnist_main_job_reaches_95_percent_on_held_out_digits(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "mnist.py"), "--storage-path", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"held-out accuracy: (\d\.\d+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    accuracy = float(match.group(1))
    assert accuracy >= 0.95
    result = json.loads((tmp_path / "mnist" / "result.json").read_text())
    assert result["status"] == "FINISHED"
    assert result["metrics"]["val_acc"] == accuracy
    assert set(result["metrics_per_rank"]) == {"0", "1"}
    kept = sorted(p.name for p in (tmp_path / "mnist").glob("checkpoint_*"))
    assert 1 <= len(kept) <= 3  # num_to_keep=2 best by val_acc, plus the latest


def _run_example(tmp_path, script, *args):
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), "--storage-path", str(tmp_path), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_gpt_example_trains_with_fsdp_and_exports_a_consolidated_model(tmp_path):
    """examples/gpt.py as documented, shrunk: a character-level LM on Python's own sources,
    FSDP over 2 workers; its validation loss must beat the uniform byte model (ln 256 = 5.55
    nats), and the exported safetensors file loads as one unsharded state dict."""
    out = _run_example(
        tmp_path, "gpt.py", "--epochs", "1", "--corpus-bytes", "40000", "--n-layer", "2",
        "--n-embd", "64", "--block-size", "64", "--sample", "0",
        "--export", str(tmp_path / "model.safetensors"),
    )  # fmt: skip
    match = re.search(r"validation loss (\d+\.\d+) nats/byte", out)
    assert match, out[-2000:]
    assert float(match.group(1)) < 5.0
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights and all(not k.startswith("_fsdp") for k in weights)
    result = json.loads((tmp_path / "gpt" / "result.json").read_text())
    assert result["status"] == "FINISHED"


@pytest.mark.parametrize(
    ("mesh_flags", "mesh"),
    [(("--tp", "2"), "dp_shard=2 x tp=2"), (("--pp", "2"), "pp=2 x dp_shard=2")],
)
def test_gpt_example_trains_on_a_mesh_of_four_workers(tmp_path, mesh_flags, mesh):
    """``examples/gpt.py --tp 2 --dp-shard 2`` and ``--pp 2 --dp-shard 2`` (issue 22): 4 CPU
    workers, the attention and MLP split over TP pairs (or the blocks over two pipeline stages),
    FSDP2 over the pairs; it learns, and the export holds whole tensors."""
    out = _run_example(
        tmp_path, "gpt.py", *mesh_flags, "--dp-shard", "2", "--epochs", "1",
        "--corpus-bytes", "40000", "--n-layer", "2", "--n-embd", "64", "--block-size", "64",
        "--sample", "0", "--export", str(tmp_path / "model.safetensors"),
    )  # fmt: skip
    assert f"mesh {mesh}" in out
    match = re.search(r"validation loss (\d+\.\d+) nats/byte", out)
    assert match, out[-2000:]
    assert float(match.group(1)) < 5.0
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    assert weights["blocks.0.attn.qkv.weight"].shape == (3 * 64, 64)
    assert weights["blocks.1.mlp.fc2.weight"].shape == (64, 4 * 64)


def test_lightning_example_learns_the_digits(tmp_path):
    out = _run_example(tmp_path, "lightning_mnist.py", "--epochs", "1")
    match = re.search(r"held-out accuracy: (\d\.\d+)", out)
    assert match, out[-2000:]
    assert float(match.group(1)) >= 0.85


def test_tune_mnist_example_sweeps_two_worker_trials(tmp_path):
    out = _run_example(
        tmp_path, "tune_mnist.py", "--num-samples", "2", "--epochs", "1", "--search-alg", "random"
    )
    match = re.search(r"best: val_acc=(\d\.\d+) lr=\S+ width=(\d+)", out)
    assert match, out[-2000:]
    assert float(match.group(1)) > 0.5  # one epoch on 4,000 digits, far above chance (0.1)
    sweep = tmp_path / "tune_mnist"
    assert sorted(p.name for p in sweep.glob("trial_*")) == ["trial_0000", "trial_0001"]
    for trial in sweep.glob("trial_*"):
        result = json.loads((trial / "result.json").read_text())
        assert result["world_size"] == 2 and set(result["metrics_per_rank"]) == {"0", "1"}
    assert (sweep / "study.db").is_file()
