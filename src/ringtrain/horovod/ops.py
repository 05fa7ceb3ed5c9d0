"""The collectives of ``horovod.torch`` on ``torch.distributed``.

Every operation is first submitted to the coordinator (one small ``all_gather`` per round that
shows every rank each member's queued operations and checks that they agree, raising
``RuntimeError`` on every rank otherwise); once every member has submitted it, its
``torch.distributed`` collective is launched with ``async_op=True``. ``*_async`` functions
return an integer handle for :func:`poll` and :func:`synchronize`; the others synchronize at
once. The non-in-place functions are
differentiable (``torch.autograd.Function``, with Horovod's gradients: allreduce's gradient is
the allreduce of the gradient with the same op, allgather's its own slice of the *averaged*
gradient, broadcast's the averaged gradient on the root and zero elsewhere: Horovod's
convention since 0.22, horovod PR #2687). Operations are matched across ranks by name, as in
Horovod (:mod:`~ringtrain.horovod.coordinator`); invalid calls raise the same exception on every
rank that made them, and ranks that wait for operations that can never meet raise instead of
hanging.

This module is the façade (``hvd.allreduce`` and friends are imported from here); the
operations live by family: :mod:`~ringtrain.horovod.handles` (argument checks, handles,
``poll``/``synchronize``), :mod:`~ringtrain.horovod.reduce` (allreduce),
:mod:`~ringtrain.horovod.gather` (allgather, broadcast, sparse allreduce) and
:mod:`~ringtrain.horovod.scatter` (alltoall, reducescatter); ``barrier`` and ``join`` are here
(a joined rank's zeros: :mod:`~ringtrain.horovod.joiner`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.fusion import ReduceOp
from ringtrain.horovod.coordinator import Match, submit, wait
from ringtrain.horovod.gather import (
    allgather,
    allgather_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    sparse_allreduce_async,
)
from ringtrain.horovod.handles import _view, poll, synchronize
from ringtrain.horovod.process_sets import ProcessSet, global_process_set
from ringtrain.horovod.reduce import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from ringtrain.horovod.runtime import negotiate, runtime
from ringtrain.horovod.scatter import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)

Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)


# ------------------------------------------------------------------ barrier and join


def barrier(process_set: ProcessSet | None = global_process_set) -> None:
    """Block until every rank of the set has called ``barrier()`` (the exchange is the barrier).

    Raises:
        RuntimeError: on every rank, when the ranks wait for operations that can never meet
            (a rank blocked in another operation: Horovod would hang), or a rank has joined.
    """
    view = _view(process_set, "barrier")
    negotiate("barrier", None, [], extra=view.process_set_id, view=view)


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; return the rank that joined last.

    Until every rank has joined, this rank takes part in its peers' allreduces with zero tensors
    (``Average`` divides by the full size); any other collective its peers submit meanwhile
    raises ``RuntimeError`` on them (Horovod's rule). ``DistributedOptimizer`` reduces its
    gradients without this exchange: do not join while peers still step one.

    Args:
        device: the CUDA device for the zero tensors (``-1``: the process group's device, CUDA
            ``local_rank()`` under NCCL, else CPU).

    Returns:
        The global rank that called ``join()`` last (the highest of those that joined in the
        same round), the same on every rank; 0 in a single process.

    Raises:
        HorovodInternalError: if a peer is gone.
    """
    rt = runtime()
    if rt.size == 1:
        return 0
    if device >= 0:
        rt.join_device = torch.device("cuda", device)
    elif dist.is_initialized() and dist.get_backend() == "nccl":
        rt.join_device = torch.device("cuda", rt.ctx.local_rank)
    else:
        rt.join_device = torch.device("cpu")
    rt.join_age = 0
    try:
        request = submit("join", None, [], _never_launched, rt.set_view(None), blocking=True)
        return int(wait(request))
    finally:
        rt.join_age = -1


def _never_launched(match: Match) -> Any:
    raise AssertionError("a join entry is completed by the round plan, never launched")


__all__ = [
    "Adasum",
    "Average",
    "Max",
    "Min",
    "Product",
    "Sum",
    "allgather",
    "allgather_async",
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
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "sparse_allreduce_async",
    "synchronize",
]
