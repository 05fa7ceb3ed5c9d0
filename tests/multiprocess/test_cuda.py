"""On a CUDA machine (skipped without one): the GPU paths for real, one GPU, NCCL.

Each case runs :func:`exact_workloads.exact_resume_fn` on ``cuda:0`` twice, once unbroken and
once SIGKILLed mid-epoch and then again half-way through a checkpoint write, and compares every
parameter and optimizer tensor with ``torch.equal``: the promise that a run which survives
failures ends with exactly the parameters of one that never failed, on the GPU. Along the way it
exercises NCCL's process group with ``device_id``, DDP with ``device_ids`` and its timed
allreduce hook (``comm_timing="auto"`` times per bucket on CUDA), autocast and the GradScaler,
FSDP2, the Horovod API's fused allreduce on CUDA tensors, pinned non-blocking checkpoint copies
and the CUDA RNG state in checkpoints. One GPU means world size 1: the host check refuses more
GPU workers than devices before any process starts (the last test)."""

from __future__ import annotations

import csv
import json

import pytest
import torch

import exact_workloads as ew
from support import run_job

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = {
    "ddp_fp32": {},
    "ddp_bf16_mixed": {"precision": "bf16-mixed"},
    "ddp_fp16_loss_scaling": {"precision": "16-mixed", "model": "300k", "bucket_cap_mb": 0.25},
    "ddp_fp16_compression_hook": {"comm_hook": "fp16", "model": "300k", "bucket_cap_mb": 0.25},
    "fsdp2": {"strategy": "fsdp"},
    "horovod_fused_allreduce": {"strategy": "hvd", "model": "300k", "fusion_bytes": 65536},
}
# Attempt 0 dies after step 7 (between checkpoints 4 and 8); attempt 1 dies 300 bytes into a
# file of checkpoint round 2 (written in the background, from pinned host copies).
KILLS = [[0, 0, "step", 7], [1, 0, "write", 2, 300]]


def _gpu_run(tmp_path, name, config, kills=()):
    job = {"use_gpu": True, "max_failures": len(kills)}
    return ew.run_exact(tmp_path, name, 1, epochs=3, job=job, kills=list(kills), **config)


@needs_cuda
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_a_gpu_run_killed_twice_ends_with_the_parameters_of_an_unbroken_one(tmp_path, case):
    config = CASES[case]
    clean_result, clean = _gpu_run(tmp_path, "clean", config)
    assert clean_result.failures == []
    assert clean["device"] == "cuda:0", clean["device"]
    result, final = _gpu_run(tmp_path, "killed", config, KILLS)
    assert [(f.attempt, f.kind) for f in result.failures] == [(0, "signal"), (1, "signal")]
    ew.assert_final_states_equal(clean, final, f"({case})")
    if config.get("precision") == "16-mixed":  # the loss scale resumed too, not just the weights
        assert final["grad_scaler"] == clean["grad_scaler"], (final["grad_scaler"], clean)
    # The timing windows carry the CUDA caching allocator's peak (monitor/memory.memory_stats).
    with open(tmp_path / "runs" / "clean" / "timing.csv", newline="") as f:
        peaks = [row["gpu_peak_bytes"] for row in csv.DictReader(f)]
    assert peaks and all(p and int(float(p)) > 0 for p in peaks), peaks


def test_more_gpu_workers_than_gpus_is_refused_before_any_process_starts(tmp_path):
    """Runs on any machine: with no GPU the message says "none" and the fix is use_gpu=False."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    has = gpus or "none"
    with pytest.raises(ValueError, match=rf"needs {gpus + 1} CUDA devices, this machine has {has}"):
        run_job(
            ew.exact_resume_fn,
            gpus + 1,
            storage_path=tmp_path / "runs",
            use_gpu=True,
            train_loop_config={"epochs": 1, "out": str(tmp_path / "x.pt")},
        )
    assert not (tmp_path / "runs" / "run" / "events.jsonl").exists()


@needs_cuda
@pytest.mark.timeout(600)
def test_lightning_on_a_gpu_worker_resumes_from_its_epoch_checkpoint_exactly(tmp_path):
    """The Lightning bridge on a GPU worker (``accelerator="auto"`` picks ``cuda:0``): killed
    after step 7, it resumes from the epoch-end checkpoint and ends like the unbroken run."""
    pytest.importorskip("lightning")
    import lightning_workloads as lw

    finals = {}
    for name, kill in (("clean", None), ("killed", [0, 7])):
        out = tmp_path / f"{name}.pt"
        config = {"epochs": 2, "out": str(out), "starts": str(tmp_path / f"{name}.starts")}
        result = run_job(
            lw.train_fn,
            1,
            storage_path=tmp_path / "runs",
            name=name,
            use_gpu=True,
            max_failures=1 if kill else 0,
            train_loop_config={**config, "kill": kill},
        )
        assert result.error is None, result.error
        assert [f.kind for f in result.failures] == (["signal"] if kill else [])
        finals[name] = torch.load(out, weights_only=True)
        starts = (tmp_path / f"{name}.starts").read_text().splitlines()
        # Every attempt trained on the GPU (Lightning moves the module back to the CPU after fit).
        assert [json.loads(line)["device"] for line in starts] == ["cuda:0"] * (2 if kill else 1)
    lw.assert_same_parameters(finals["killed"], finals["clean"])
