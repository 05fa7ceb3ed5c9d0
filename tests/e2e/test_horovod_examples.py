"""The Horovod-API examples (examples/horovod_*.py) and launch helpers (horovod.run, RayExecutor).

The examples are ringtrain's own scripts written against Horovod's API; each runs here as a user
would run it (``ringtrain run -np 2 SCRIPT`` with the script's own flags, or ``python SCRIPT
--num-proc N`` through ``horovod.run``), with tiny settings. ``examples/horovod_mnist.py`` under
``ringtrain run -np 2`` is tests/multiprocess/test_horovod.py's; ``examples/horovod_ray.py`` on a
Ray cluster is tests/backends/test_ray_horovod.py's.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringtrain.horovod as hvd
from ringtrain.horovod.ray import ElasticRayExecutor, RayExecutor
from ringtrain.result import TrainingFailedError
from support import child_pids

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HOROVOD_IMPORTS = {  # example -> its ringtrain imports, each standing for one Horovod import
    "horovod_mnist.py": 2,
    "horovod_pytorch_mnist_elastic.py": 1,
    "horovod_synthetic_benchmark.py": 1,
    "horovod_ray.py": 2,
}


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


# ---------------------------------------------------------------------------- the examples


@pytest.mark.parametrize("example", sorted(HOROVOD_IMPORTS))
def test_examples_reach_ringtrain_only_through_the_horovod_imports(example):
    lines = (EXAMPLES / example).read_text().splitlines()
    imports = [x for x in lines if re.match(r"^(import|from) ringtrain\b", x)]
    assert len(imports) == HOROVOD_IMPORTS[example], imports
    # each says which Horovod line it stands for, so a Horovod user sees what to change back
    assert all(re.search(r"  # was: (import|from) horovod", x) for x in imports), imports
    # our own code, linted and formatted like the rest of the repository
    assert not [x for x in lines[:3] if "noqa" in x or "fmt: off" in x]


@pytest.mark.timeout(300)
def test_mnist_through_horovod_run_at_three_ranks():
    """``python horovod_mnist.py --num-proc 3``: the script calls ``horovod.run(train, ...)``
    itself and prints what it returned (each rank's test accuracy, by rank)."""
    text = run_cli(
        [
            str(EXAMPLES / "horovod_mnist.py"),
            *("--num-proc", "3", "--epochs", "1", "--lr", "0.05", "--max-batches", "15"),
            *("--fp16-allreduce", "--gradient-predivide-factor", "3"),
        ]
    )
    assert "Running training through horovod.run" in text
    assert "Train Epoch: 1 [0/1334" in text  # ceil(4000 / 3) per rank
    returned = re.search(r"horovod.run returned \[(.*)\]", text)
    assert returned, text[-2000:]
    per_rank = [float(x) for x in returned.group(1).split(",")]
    assert len(per_rank) == 3 and len(set(per_rank)) == 1  # the allreduce-averaged metric
    assert accuracy(text) > 15.0, text[-2000:]  # chance is 10%


def test_adasum_is_refused_by_name():
    """Before anything starts (the synthetic benchmark refuses it with the same message)."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "horovod_mnist.py"), "--use-adasum"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode != 0 and "no Adasum" in proc.stderr, proc.stderr[-2000:]


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        children = child_pids(todo.pop())
        found |= children
        todo.extend(children)
    return found


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return None
    ranks = [int(e[5:]) for e in entries if e.startswith(b"RANK=") and e[5:].isdigit()]
    return ranks[0] if ranks else None


@pytest.mark.timeout(300)
def test_elastic_mnist_resumes_from_its_last_commit_after_a_worker_is_killed(tmp_path):
    """2,000 images per rank in batches of 100: 20 commits, each a ringtrain checkpoint. Rank
    1 is killed after the third commit; the group restarts from the last commit and the
    ElasticSampler skips what was done, so the run still ends after exactly 20 batches."""
    cmd = [
        *(sys.executable, "-m", "ringtrain.cli", "run", "-np", "2", "--max-failures", "1"),
        *("--storage-path", str(tmp_path), "--progress", "plain"),
        str(EXAMPLES / "horovod_pytorch_mnist_elastic.py"),
        *("--epochs", "1", "--batch-size", "100", "--lr", "0.05"),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    lines: list[str] = []
    killed = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if killed is None and "hvd_commit=2 " in line:
                rank_one = [p for p in _descendants(proc.pid) if _rank_of(p) == 1]
                if not rank_one:  # forked by the warm pool: /proc/PID/environ is the zygote's;
                    # it forks the run's store, then the ranks in order: rank 1 is its last child
                    zygotes = [p for p in child_pids(proc.pid) if len(child_pids(p)) >= 2]
                    rank_one = [sorted(child_pids(z))[-1] for z in zygotes]
                assert len(rank_one) == 1, (rank_one, "".join(lines)[-2000:])
                os.kill(rank_one[0], signal.SIGKILL)
                killed = rank_one[0]
        proc.wait(timeout=240)
    finally:
        proc.kill()
    text = "".join(lines)
    assert proc.returncode == 0 and killed is not None, text[-3000:]
    assert "restarting: rank 1" in text, text[-3000:]
    rounds = re.findall(r"hvd_commit=(\d+) batch=(\d+)", text)
    assert rounds[-1] == ("19", "20"), rounds  # no batch repeated, none dropped
    assert "Test set: Average loss" in text
    assert len(list(tmp_path.glob("*/checkpoint_*"))) >= 1


@pytest.mark.timeout(300)
def test_synthetic_benchmark_under_ringtrain_run(tmp_path):
    text = ringtrain_run(
        tmp_path,
        "horovod_synthetic_benchmark.py",
        *("--model", "resnet18", "--batch-size", "2", "--num-warmup-batches", "1"),
        *("--num-batches-per-iter", "1", "--num-iters", "2", "--fp16-allreduce"),
    )
    assert "Model: resnet18" in text and "Number of CPUs: 2" in text
    match = re.search(r"Total img/sec on 2 CPU\(s\): ([0-9.]+)", text)
    assert match and float(match.group(1)) > 0, text[-2000:]


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
