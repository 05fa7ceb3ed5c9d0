"""``import ringtrain.horovod as hvd``: the ``horovod.torch`` API on ``torch.distributed``.

Pure Python, no MPI and no C++ extension: ``hvd.init()`` joins the process group of a worker
started by ``ringtrain run -n N``, ``rt.Trainer`` or torchrun (or is rank 0 of 1 in a plain
process); collectives are ``torch.distributed`` calls (gloo on CPU, NCCL on GPU) behind a cheap
cross-rank metadata check; ``DistributedOptimizer`` reduces gradients during backward with
ringtrain's fused asynchronous allreduce (:mod:`ringtrain.comm.fusion`). See docs/horovod.md for
what maps to what and what differs.
"""

from __future__ import annotations

from ringtrain.comm.compression import Compression, Compressor
from ringtrain.horovod import elastic, ray  # ray: horovod.ray's RayExecutor
from ringtrain.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ringtrain.horovod.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from ringtrain.horovod.optimizer import DistributedOptimizer
from ringtrain.horovod.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from ringtrain.horovod.run import run  # horovod.run
from ringtrain.horovod.runtime import (
    HorovodInternalError,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from ringtrain.horovod.sync_batch_norm import SyncBatchNorm


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod raises it when hosts are added or removed; ringtrain never does (a membership
    change is a restart of the worker group). Defined so that ``except`` clauses still work."""


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Not supported: use ``torch.profiler`` (its trace shows every collective) instead."""
    raise NotImplementedError(
        "the Horovod timeline is not supported; record a trace with torch.profiler.profile() "
        "(collectives appear as gloo/nccl ops) or use ringtrain's step timing (MonitorConfig)"
    )


def stop_timeline() -> None:
    """Not supported (see :func:`start_timeline`)."""
    start_timeline("")


__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "ray",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "run",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
