"""FSDP2 sharded data parallelism and sharded, reshardable checkpoints (issue 10).

Real gloo worker processes through ``rt.Trainer(...).fit()``: FSDP matches DDP; a sharded
checkpoint resumes bit-exactly at the same world size and continuously at 1 and 3 ranks; each
rank holds about 1/W of the parameters and optimizer state; ``export_model`` consolidates the
shards into a plain state dict. (The clear errors, without processes:
tests/unit/test_fsdp_errors.py.)
"""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

import fsdp_workloads as fw
import ringtrain as rt
from ringtrain.cli import main as cli_main
from support import run_job

STEPS, CKPT_AT = 20, 13  # 2 epochs of 10 steps; the checkpoint is mid-epoch (epoch 1, batch 3)


def _fit(root, name, strategy="fsdp", workers=2, storage=None, **config):
    """Run ``name`` (its files named after it) in ``root/runs``, or, with ``storage``, as the
    run ``stop`` copied to ``storage`` (a checkpoint's manifest is bound to its run's name)."""
    files = {
        "loss_file": str(root / f"{name}.losses.jsonl"),
        "probe_file": str(root / f"{name}.probe.pt"),
        "out": str(root / f"{name}.final.pt"),
    }
    cfg = {"strategy": strategy, "steps": STEPS, "ckpt_at": CKPT_AT, **files, **config}
    result = run_job(
        fw.fsdp_fn,
        workers,
        storage_path=storage or root / "runs",
        name="stop" if storage else name,
        train_loop_config=cfg,
    )
    assert result.error is None, result.error
    return result, files


def _losses(path) -> dict[int, float]:
    with open(path) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted FSDP and DDP runs at W=2, and an FSDP run stopped at its checkpoint."""
    root = tmp_path_factory.mktemp("fsdp")
    fsdp = _fit(root, "fsdp", checks=True)
    ddp = _fit(root, "ddp", strategy="ddp")
    stop = _fit(root, "stop", stop=True)
    return {"root": root, "fsdp": fsdp, "ddp": ddp, "stop": stop}


def _resume_copy(runs, name, workers):
    """Copy the stopped run (under its own name: a copy renamed would be refused and start
    afresh) and finish it with ``workers`` ranks."""
    root = runs["root"]
    shutil.copytree(root / "runs" / "stop", root / "copies" / name / "stop")
    shutil.copy(runs["stop"][1]["loss_file"], root / f"{name}.losses.jsonl")
    return _fit(root, name, workers=workers, storage=root / "copies" / name)


def _lines(path) -> int:
    with open(path) as f:
        return sum(1 for _ in f)


def test_fsdp_matches_ddp_and_holds_a_shard_of_the_state(runs):
    (res_f, files_f), (res_d, files_d) = runs["fsdp"], runs["ddp"]
    full_f = torch.load(files_f["out"], weights_only=True)
    full_d = torch.load(files_d["out"], weights_only=True)
    assert full_f["step"] == full_d["step"] == STEPS
    assert full_f["model"].keys() == full_d["model"].keys()
    for key in full_f["model"]:
        torch.testing.assert_close(full_f["model"][key], full_d["model"][key], rtol=1e-5, atol=1e-6)
    for key in full_f["optimizer"]:
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(
                full_f["optimizer"][key][moment],
                full_d["optimizer"][key][moment],
                rtol=1e-4,
                atol=1e-8,
            )
    lf, ld = _losses(files_f["loss_file"]), _losses(files_d["loss_file"])
    assert sorted(lf) == sorted(ld) == list(range(1, STEPS + 1))
    assert lf[STEPS] < lf[1]
    for step in lf:
        assert abs(lf[step] - ld[step]) <= 1e-5 * abs(ld[step]) + 1e-6

    # Memory: each rank holds its shard; the shards add up to DDP's full copy.
    per_f, per_d = res_f.metrics_per_rank, res_d.metrics_per_rank
    full_params = per_d[0]["params"]
    assert per_d[1]["params"] == full_params  # DDP: every rank has everything
    assert per_f[0]["params"] + per_f[1]["params"] == full_params
    for rank in (0, 1):
        for kind in ("params", "grads"):
            assert per_f[rank][kind] <= 0.55 * per_d[rank][kind], (rank, kind)
        # Adam's moments are sharded; its per-parameter step counters (one scalar each) are not.
        assert per_f[rank]["optimizer"] <= 0.55 * per_d[rank]["optimizer"], rank
        assert per_f[rank]["total"] <= 0.55 * per_d[rank]["total"]

    # bf16 compute + activation checkpointing + CPU offload + the size policy train too.
    extra = per_f[0]
    assert extra["bf16_out_dtype"] == "torch.float32"  # the root casts its output back
    assert extra["shard_dtypes"] == ["torch.float32"]  # shards and optimizer stay fp32
    assert extra["bf16_losses"][-1] < 0.8 * extra["bf16_losses"][0]
    assert "build it after prepare_model(parallel_strategy='fsdp')" in extra["stale_error"]


def test_sharded_checkpoint_layout_is_in_the_manifest(runs):
    ckpt = runs["stop"][0].checkpoint
    with open(f"{ckpt.path}/manifest.json") as f:
        manifest = json.load(f)
    files = set(manifest["files"])
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.pt"} <= files
    state = torch.load(f"{ckpt.path}/train_state.pt", weights_only=True)
    assert state["sharded"] == ["model", "optimizer"]
    assert "model" not in state["objects"] and "optimizer" not in state["objects"]


def test_resume_at_the_same_world_size_is_bit_exact(runs):
    _, files = _resume_copy(runs, "resume2", workers=2)
    resumed = torch.load(files["out"], weights_only=True)
    clean = torch.load(runs["fsdp"][1]["out"], weights_only=True)
    assert resumed["step"] == clean["step"] == STEPS
    for key in clean["model"]:
        assert torch.equal(resumed["model"][key], clean["model"][key]), key
    for key in clean["optimizer"]:
        for name, value in clean["optimizer"][key].items():
            assert torch.equal(resumed["optimizer"][key][name], value), (key, name)
    assert _losses(files["loss_file"]) == _losses(runs["fsdp"][1]["loss_file"])
    assert _lines(files["loss_file"]) == STEPS  # resumed at CKPT_AT + 1: no step ran twice


@pytest.mark.parametrize("workers", [1, 3])
def test_resume_at_another_world_size_reshards(runs, workers):
    _, files = _resume_copy(runs, f"resume{workers}", workers=workers)
    resumed = torch.load(files["out"], weights_only=True)
    clean = torch.load(runs["fsdp"][1]["out"], weights_only=True)
    assert resumed["step"] == STEPS
    got, want = _losses(files["loss_file"]), _losses(runs["fsdp"][1]["loss_file"])
    assert sorted(got) == list(range(1, STEPS + 1))  # continues at step 14, nothing replayed
    assert _lines(files["loss_file"]) == STEPS
    for step in range(CKPT_AT + 1, STEPS + 1):  # the same samples: the same losses, up to
        assert abs(got[step] - want[step]) <= 1e-4 * abs(want[step]), step  # summation order
    for key in clean["model"]:
        torch.testing.assert_close(resumed["model"][key], clean["model"][key], rtol=1e-3, atol=1e-5)


def test_export_consolidates_the_shards(runs, tmp_path):
    ckpt = runs["stop"][0].checkpoint
    probe = torch.load(runs["stop"][1]["probe_file"], weights_only=True)
    out = rt.export_model(ckpt, tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    net = fw.TinyNet()
    net.load_state_dict(load_file(out))
    with torch.no_grad():
        assert torch.equal(net(fw.probe_input()), probe)

    # The CLI, from the run directory (its newest checkpoint), as torch.save, in bf16.
    run_dir = runs["root"] / "runs" / "stop"
    assert cli_main(["export", str(run_dir), str(tmp_path / "model.pt"), "--dtype", "bf16"]) == 0
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert state.keys() == net.state_dict().keys()
    assert all(t.dtype == torch.bfloat16 for t in state.values())

    # A DDP checkpoint exports the same way.
    ddp_ckpt = runs["ddp"][0].checkpoint
    net.load_state_dict(load_file(rt.export_model(ddp_ckpt, tmp_path / "ddp.safetensors")))
    with torch.no_grad():
        assert torch.equal(net(fw.probe_input()), torch.load(runs["ddp"][1]["probe_file"]))


def test_a_metadata_file_that_would_run_code_is_refused(runs, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(runs["stop"][0].checkpoint.path, bad)
    with open(bad / ".metadata", "wb") as f:
        pickle.dump(print, f)  # any global outside DCP's metadata classes
    with pytest.raises(ValueError, match=r"\.metadata has 33 bytes"):  # the manifest notices
        rt.export_model(str(bad), tmp_path / "x.pt")
    from ringtrain.checkpoint.sharded import load_full

    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print"):  # and so does the reader
        load_full(str(bad))
