"""Horovod conformance: ``ringtrain.horovod`` against ``horovod.torch`` 0.28.1.

1. Names: every public name of horovod.torch 0.28.1 exists here, with Horovod's argument names
   (data below, copied from Horovod's source at the v0.28.1 tag: horovod/torch/__init__.py,
   horovod/torch/mpi_ops.py, horovod/torch/functions.py, horovod/common/process_sets.py,
   horovod/torch/elastic/__init__.py).
2. Behaviour: one job per world size (2 and 3) runs the battery of
   tests/hvd_conformance_workloads.py in real gloo processes (every dtype Horovod supports on CPU,
   variable first dimensions, async handles, grouped ops, gradients, process sets, error
   symmetry, optimizer state); each check is then asserted on its own. A hang fails the job at
   its timeout instead of blocking the suite.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

import ringtrain.horovod as hvd
from support import run_torchrun_style

SHARES_RUNS = True  # its tests share cached runs: one pytest worker runs them all (conftest)

HERE = Path(__file__).resolve().parents[1]

#: ``horovod/torch/__init__.py`` (v0.28.1): the names it imports when the extension loads.
HOROVOD_TORCH_0_28_1 = [
    "elastic",
    "Compression",
    "allgather_object",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "allreduce",
    "allreduce_async",
    "allreduce_",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "grouped_allreduce_",
    "grouped_allreduce_async_",
    "sparse_allreduce_async",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "broadcast",
    "broadcast_async",
    "broadcast_",
    "broadcast_async_",
    "alltoall",
    "alltoall_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "barrier",
    "poll",
    "synchronize",
    "init",
    "shutdown",
    "is_initialized",
    "start_timeline",
    "stop_timeline",
    "size",
    "local_size",
    "cross_size",
    "rank",
    "local_rank",
    "cross_rank",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "HorovodInternalError",
    "DistributedOptimizer",
    "SyncBatchNorm",
]

#: ``horovod/torch/elastic/__init__.py`` (v0.28.1) ``__all__`` (plus the ``State`` classes of
#: ``horovod.common.elastic`` that user code subclasses).
HOROVOD_ELASTIC_0_28_1 = ["TorchState", "ElasticSampler", "run", "ObjectState", "State"]

#: Argument names, in order, of Horovod 0.28.1's functions (mpi_ops.py, functions.py,
#: process_sets.py); ringtrain may add keyword-only arguments after them, never others.
SIGNATURES = {
    "allreduce": "tensor average name compression op prescale_factor postscale_factor process_set",
    "allreduce_async": "tensor average name op prescale_factor postscale_factor process_set",
    "allreduce_": "tensor average name op prescale_factor postscale_factor process_set",
    "allreduce_async_": "tensor average name op prescale_factor postscale_factor process_set",
    "grouped_allreduce": "tensors average name compression op prescale_factor postscale_factor "
    "process_set",
    "grouped_allreduce_async": "tensors average name op prescale_factor postscale_factor "
    "process_set",
    "grouped_allreduce_": "tensors average name op prescale_factor postscale_factor process_set",
    "grouped_allreduce_async_": "tensors average name op prescale_factor postscale_factor "
    "process_set",
    "sparse_allreduce_async": "tensor name op process_set",
    "allgather": "tensor name process_set",
    "allgather_async": "tensor name process_set",
    "grouped_allgather": "tensors name process_set",
    "grouped_allgather_async": "tensors name process_set",
    "broadcast": "tensor root_rank name process_set",
    "broadcast_async": "tensor root_rank name process_set",
    "broadcast_": "tensor root_rank name process_set",
    "broadcast_async_": "tensor root_rank name process_set",
    "alltoall": "tensor splits name process_set",
    "alltoall_async": "tensor splits name process_set",
    "reducescatter": "tensor name compression op process_set prescale_factor postscale_factor",
    "reducescatter_async": "tensor name op process_set prescale_factor postscale_factor",
    "grouped_reducescatter": "tensors name compression op process_set prescale_factor "
    "postscale_factor",
    "grouped_reducescatter_async": "tensors name op process_set prescale_factor postscale_factor",
    "join": "device",
    "barrier": "process_set",
    "poll": "handle",
    "synchronize": "handle",
    "init": "comm process_sets",
    "broadcast_parameters": "params root_rank process_set",
    "broadcast_optimizer_state": "optimizer root_rank process_set",
    "broadcast_object": "obj root_rank name process_set",
    "allgather_object": "obj name process_set",
    "add_process_set": "process_set",
    "remove_process_set": "process_set",
    "DistributedOptimizer": "optimizer named_parameters compression backward_passes_per_step op "
    "gradient_predivide_factor groups sparse_as_dense process_set",
}


def test_every_horovod_0_28_1_name_exists():
    missing = [name for name in HOROVOD_TORCH_0_28_1 if not hasattr(hvd, name)]
    assert missing == [], f"missing from ringtrain.horovod: {missing}"
    missing_elastic = [n for n in HOROVOD_ELASTIC_0_28_1 if not hasattr(hvd.elastic, n)]
    assert missing_elastic == []
    assert [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product] == list(range(6))
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.global_process_set.process_set_id == 0


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_argument_names_match_horovod(name):
    params = inspect.signature(getattr(hvd, name)).parameters.values()
    positional = [p.name for p in params if p.kind != inspect.Parameter.KEYWORD_ONLY]
    assert positional == SIGNATURES[name].split()


def test_process_set_object_without_init():
    ps = hvd.ProcessSet([2, 0])
    assert ps.ranks == [0, 2] and ps.process_set_id is None
    assert (ps.size(), ps.rank(), ps.included()) == (None, None, None)
    assert "ranks=[0, 2]" in str(ps)
    with pytest.raises(ValueError, match="distinct"):
        hvd.ProcessSet([1, 1])
    with pytest.raises(NotImplementedError, match="list of global ranks"):
        hvd.ProcessSet(object())  # an MPI communicator


# ------------------------------------------------------------------ the battery, in real ranks


def _run_battery(world_size: int) -> list[dict]:
    script = str(HERE / "hvd_conformance_workloads.py")
    outs = run_torchrun_style([script], world_size, timeout_s=240, pythonpath=[str(HERE)])
    ranks = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return sorted(ranks, key=lambda o: o["rank"])


_RESULTS: dict[int, list[dict]] = {}


def _battery(world_size: int) -> list[dict]:
    if world_size not in _RESULTS:
        _RESULTS[world_size] = _run_battery(world_size)
    return _RESULTS[world_size]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_conformance_battery(world_size):
    ranks = _battery(world_size)
    assert [o["rank"] for o in ranks] == list(range(world_size))
    failures = []
    names = sorted(set().union(*(o["checks"] for o in ranks)))
    assert len(names) > 150, f"the battery ran only {len(names)} checks"
    for name in names:
        results = [o["checks"].get(name, "not run") for o in ranks]
        if name.startswith("err "):
            # error symmetry: every rank raised, and the same type
            if len(set(results)) != 1 or not results[0].startswith("raised "):
                failures.append(f"{name}: {results}")
        elif name.startswith("ps ") and any(r.startswith("raised") for r in results):
            if any(not r.startswith(("raised ValueError", "ok", "not run")) for r in results):
                failures.append(f"{name}: {results}")
        elif any(r not in ("ok", "not run") for r in results) or all(
            r == "not run" for r in results
        ):
            failures.append(f"{name}: {results}")
    assert failures == [], "\n".join(failures)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_error_types_match_horovod(world_size):
    checks = _battery(world_size)[0]["checks"]
    expected = {
        "err shape": "RuntimeError",
        "err dtype": "RuntimeError",
        "err name differs": "RuntimeError",
        "err duplicate name in flight": "ValueError",
        "err duplicate name allgather": "ValueError",
        "err unknown handle": "ValueError",
        "err broadcast root out of range": "ValueError",
        "err alltoall bad splits on one rank": "ValueError",
        "err adasum": "NotImplementedError",
        "err mpi_threads_supported": "ValueError",
        "err init comm": "NotImplementedError",
        "err allreduce vs barrier": "RuntimeError",
        "err add_process_set differs": "RuntimeError",
        "ps duplicate add": "ValueError",
        "ps use after remove": "ValueError",
    }
    got = {k: checks[k].removeprefix("raised ") for k in expected}
    assert got == expected
