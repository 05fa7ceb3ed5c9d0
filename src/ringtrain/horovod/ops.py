"""The collectives of ``horovod.torch`` on ``torch.distributed``.

Every operation first runs :func:`~ringtrain.horovod.runtime.negotiate` (one small
``all_gather`` that checks all ranks called the same operation on compatible tensors, raising
``RuntimeError`` on every rank otherwise), then launches the ``torch.distributed`` collective with
``async_op=True``. ``*_async`` functions return an integer handle for :func:`poll` and
:func:`synchronize`; the others synchronize at once. The non-in-place functions are
differentiable (``torch.autograd.Function``, with Horovod's gradients: allreduce's gradient is
the allreduce of the gradient with the same op, allgather's its own slice of the *averaged*
gradient, broadcast's the averaged gradient on the root and zero elsewhere: Horovod's
convention since 0.22, horovod PR #2687). Invalid calls raise the same exception on every rank
(see ``negotiate``); operations are matched in program order, not by name.

This module is the façade (``hvd.allreduce`` and friends are imported from here); the
operations live by family: :mod:`~ringtrain.horovod.handles` (argument checks, handles,
``poll``/``synchronize``), :mod:`~ringtrain.horovod.reduce` (allreduce),
:mod:`~ringtrain.horovod.gather` (allgather, broadcast, sparse allreduce) and
:mod:`~ringtrain.horovod.scatter` (alltoall, reducescatter); ``barrier`` and ``join`` are here.
"""

from __future__ import annotations

import time

from ringtrain.comm.fusion import ReduceOp
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
    """Block until every rank of the set has called ``barrier()`` (the metadata exchange is the
    barrier: a rank in another operation makes both raise instead of hanging)."""
    view = _view(process_set, "barrier")
    negotiate("barrier", None, [], extra=view.process_set_id, view=view)


def join(device: int = -1) -> int:
    """Block until every rank has called ``join()``; return the rank that joined last.

    Unlike Horovod, a rank that has joined does not serve its peers' later collectives with
    zeros: call ``join()`` where every rank has finished its collectives (the end of an epoch
    with uneven data); a rank still issuing collectives then meets the joined ranks in the
    metadata exchange and every rank raises ``RuntimeError`` (no hang). The last rank is the one
    with the latest wall-clock arrival (carried by the same exchange).

    Args:
        device: Horovod's GPU for the zero tensors; ignored.
    """
    rt = runtime()
    if rt.size == 1:
        return 0
    rows = negotiate("join", None, [], payload=time.time_ns() // 1000)
    arrivals = [row[9] for row in rows]
    return int(max(range(len(arrivals)), key=lambda i: (arrivals[i], i)))


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
