"""ringtrain.horovod and the fused allreduce (ringtrain.comm) in real gloo workers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import hvd_workloads
import ringtrain as rt
import ringtrain.horovod as hvd
from ringtrain.comm.fusion import fusion_threshold_from_env, plan_buckets
from support import run_torchrun_style

ROOT = Path(__file__).resolve().parents[2]


def fit(fn, n, tmp_path, name, config=None, **run_kwargs):
    return rt.Trainer(
        fn,
        rt.ScalingConfig(num_workers=n),
        rt.RunConfig(name=name, storage_path=str(tmp_path), progress="off", **run_kwargs),
        train_loop_config=config or {},
    ).fit()


# ------------------------------------------------------------------ pure logic


def test_plan_buckets_groups_by_key_and_caps_bytes():
    sizes = [100, 100, 100, 500, 40, 40]
    keys = ["f32", "f32", "f32", "f32", "f16", "f16"]
    assert plan_buckets(sizes, keys, 250) == [[0, 1], [2], [3], [4, 5]]
    assert plan_buckets(sizes, keys, 10_000, first_bucket_bytes=150) == [[0], [1, 2, 3], [4, 5]]
    assert plan_buckets(sizes, keys, 0) == [[i] for i in range(6)]
    assert fusion_threshold_from_env({}) == 128 * 1024 * 1024
    assert fusion_threshold_from_env({"HOROVOD_FUSION_THRESHOLD": "0"}) == 0
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD"):
        fusion_threshold_from_env({"HOROVOD_FUSION_THRESHOLD": "-1"})


def test_single_process_api():
    hvd.init()
    try:
        assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.cross_size()) == (1, 0, 1, 1)
        x = torch.arange(3.0, requires_grad=True)
        hvd.allreduce(x, op=hvd.Sum).sum().backward()
        assert torch.equal(x.grad, torch.ones(3))
        model = torch.nn.Linear(3, 1)
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters()
        )
        before = model.weight.detach().clone()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        assert not torch.equal(before, model.weight)
        with pytest.raises(NotImplementedError, match="Average"):
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
        with pytest.raises(NotImplementedError, match=r"torch\.profiler"):
            hvd.start_timeline("/tmp/x.json")
    finally:
        hvd.shutdown()
    with pytest.raises(ValueError, match=r"hvd\.init"):
        hvd.size()


# ------------------------------------------------------------------ real workers


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_errors_syncbn_and_optimizer_match_torch_distributed(tmp_path, world_size):
    result = fit(hvd_workloads.collectives_fn, world_size, tmp_path, f"hvd{world_size}")
    assert set(result.metrics_per_rank) == set(range(world_size))
    for rank, metrics in result.metrics_per_rank.items():
        assert metrics["world_size"] == world_size
        assert metrics["failed"] == [], f"rank {rank}: {metrics['failed']}"


def test_elastic_commit_survives_a_killed_worker_bit_exactly(tmp_path):
    killed = fit(
        hvd_workloads.elastic_fn,
        2,
        tmp_path,
        "killed",
        {"kill": True},
        failure_config=rt.FailureConfig(max_failures=1),
    )
    clean = fit(hvd_workloads.elastic_fn, 2, tmp_path, "clean", {"kill": False})
    assert len(killed.failures) == 1
    final = killed.metrics
    assert final["attempt"] == 1 and final["resets"] == 1
    # resumed at a commit (batch 4 of epoch 0, or batch 2 if the last one was not yet published)
    assert final["resumed_at"] in ([0, 4, 2], [0, 2, 1])
    assert clean.metrics["resumed_at"] == [0, 0, 0] and clean.metrics["resets"] == 0
    for rank in (0, 1):
        assert killed.metrics_per_rank[rank]["params"] == clean.metrics_per_rank[rank]["params"]


def test_init_under_torchrun_environment_and_reinit(tmp_path):
    script = tmp_path / "tr.py"
    script.write_text(
        textwrap.dedent(
            """
            import json, torch
            import ringtrain.horovod as hvd
            hvd.init()
            a = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
            hvd.shutdown()
            hvd.init()
            b = hvd.allgather(torch.tensor([hvd.rank()])).tolist()
            print(json.dumps({"rank": hvd.rank(), "size": hvd.size(), "a": a, "b": b}))
            hvd.shutdown()
            """
        )
    )
    outs = [
        json.loads(out.strip().splitlines()[-1])
        for out in run_torchrun_style([str(script)], 2, timeout_s=120)
    ]
    assert [o["rank"] for o in outs] == [0, 1]
    for o in outs:
        assert o["size"] == 2 and o["a"] == 1.0 and o["b"] == [0, 1]


def test_horovod_mnist_example_runs_under_ringtrain_run(tmp_path):
    example = ROOT / "examples" / "horovod_mnist.py"
    imports = [x for x in example.read_text().splitlines() if x.startswith("import ringtrain")]
    assert imports == ["import ringtrain.horovod as hvd  # was: import horovod.torch as hvd"]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ringtrain.cli",
            "run",
            "-np",
            "2",
            "--storage-path",
            str(tmp_path),
            "--progress",
            "plain",
            str(example),
            "--epochs",
            "1",
            "--max-batches",
            "30",
            "--lr",
            "0.05",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert "hvd.size()=2" in text
    line = next(x for x in text.splitlines() if "Test set: Average loss" in x)
    accuracy = float(line.rsplit("Accuracy:", 1)[1].strip().rstrip("%"))
    assert accuracy > 40.0, line  # chance is 10%
