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
:mod:`~ringtrain.horovod.scatter` (alltoall, reducescatter), :mod:`~ringtrain.horovod.joiner`
(``join``); ``barrier`` is here.
"""

from __future__ import annotations

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
from ringtrain.horovod.joiner import join
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
from ringtrain.horovod.runtime import negotiate
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


# ------------------------------------------------------------------ barrier


def barrier(process_set: ProcessSet | None = global_process_set) -> None:
    """Block until every rank of the set has called ``barrier()`` (the exchange is the barrier).

    Raises:
        RuntimeError: on every rank, when the ranks wait for operations that can never meet
            (a rank blocked in another operation: Horovod would hang), or a rank has joined.
    """
    view = _view(process_set, "barrier")
    negotiate("barrier", None, [], extra=view.process_set_id, view=view)


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
