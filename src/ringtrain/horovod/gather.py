"""``allgather`` and ``broadcast`` (and their grouped, in-place and async forms), and the
sparse allreduce built on allgather (Horovod's algorithm for sparse COO gradients).

Gradients follow Horovod since 0.22 (PR #2687): allgather's gradient is this rank's slice of
the *averaged* gradient, broadcast's is the averaged gradient on the root and zero elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.fusion import ReduceOp
from ringtrain.horovod.coordinator import Match
from ringtrain.horovod.handles import (
    _as_1d,
    _check_process_set,
    _from_wire,
    _parse_op,
    _submit,
    _to_wire,
    _view,
    synchronize,
)
from ringtrain.horovod.metadata import DIM0
from ringtrain.horovod.process_sets import ProcessSet, SetView, global_process_set
from ringtrain.horovod.reduce import allreduce_async
from ringtrain.horovod.runtime import runtime


def _launch_allgather(
    src: torch.Tensor, view: SetView, dims: Sequence[int]
) -> tuple[Callable[[], bool], Callable[[], torch.Tensor]]:
    """Start gathering ``src`` (first dimension ``dims[i]`` on the i-th member): every rank
    sends ``max(dims)`` rows (zero-padded), the padding is cut after."""
    if view.size == 1:
        out = src.clone()
        return (lambda: True), (lambda: out)
    wire = _to_wire(src)
    longest = max(dims)
    padded = wire
    if wire.shape[0] < longest:
        pad = wire.new_zeros((longest - wire.shape[0], *wire.shape[1:]))
        padded = torch.cat([wire, pad])
    parts = [wire.new_empty((longest, *wire.shape[1:])) for _ in range(view.size)]
    work = dist.all_gather(parts, padded, group=view.group, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        out = torch.cat([p[:d] for p, d in zip(parts, dims, strict=False)])
        return _from_wire(out, src.dtype)

    return work.is_completed, finish


def _dims(match: Match, view: SetView, own: int) -> list[int]:
    """Every member's first dimension, from the matched rows (each rank's own when the
    exchange was skipped)."""
    if len(match.rows) == view.size:
        return [row[DIM0] for row in match.rows]
    return [own] * view.size


def allgather_async(
    tensor: torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension; returns a handle.

    The first dimension may differ across ranks; the others and the dtype must match. Every
    dtype Horovod supports works on gloo (int16 travels as int32).
    """
    view = _view(process_set, "allgather")
    src = _as_1d(tensor.detach()).contiguous()

    def launch(match: Match) -> tuple[Callable[[], bool], Callable[[], torch.Tensor]]:
        return _launch_allgather(src, view, _dims(match, view, src.shape[0]))

    return _submit(
        "allgather",
        name,
        [src],
        launch,
        view,
        vary_first_dim=True,
        extra=16 * view.process_set_id,
    )


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any, ps: Any) -> Any:
        ctx.dim0 = _as_1d(tensor).shape[0]
        ctx.scalar = tensor.dim() == 0
        ctx.ps = ps
        return synchronize(allgather_async(tensor, name=name, process_set=ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod >= 0.22 (PR #2687): the *averaged* gradient, then this rank's slice
        summed = synchronize(
            allreduce_async(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.ps)
        )
        dims = synchronize(
            allgather_async(torch.tensor([ctx.dim0], dtype=torch.int64), process_set=ctx.ps)
        )
        offset = int(dims[: _view(ctx.ps, "allgather").rank].sum())
        out = summed.narrow(0, offset, ctx.dim0)
        return (out.reshape(()) if ctx.scalar else out), None, None


def allgather(
    tensor: torch.Tensor,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension (rank order); differentiable.

    Args:
        tensor: shape ``(d_r, *rest)``; ``d_r`` may differ per rank, ``rest`` and dtype may not.
        process_set: the ranks taking part (default: all).

    Returns:
        Shape ``(sum_r d_r, *rest)``. The gradient of rank r's input is its slice of the
        gradient *averaged* over the ranks (Horovod's convention since 0.22).

    Raises:
        RuntimeError: on every rank, if dtypes or trailing dimensions differ.
    """
    _check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFn.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name=name, process_set=process_set))


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> int:
    """Start an allgather of each tensor of the list, under one handle (``synchronize`` returns
    the list of results). One exchange checks the whole list; once matched, one small
    ``all_gather`` shares every tensor's first dimension, then each tensor is gathered."""
    view = _view(process_set, "grouped_allgather")
    srcs = [_as_1d(t.detach()).contiguous() for t in tensors]
    if not srcs:
        raise ValueError("grouped_allgather: the list of tensors is empty")

    def launch(match: Match) -> tuple[Callable[[], bool], Callable[[], Any]]:
        own = torch.tensor([s.shape[0] for s in srcs], dtype=torch.int64)
        dims = [own.tolist()] * view.size
        if view.size > 1 and len(match.rows) == view.size:
            gathered = [torch.empty_like(own) for _ in range(view.size)]
            dist.all_gather(gathered, own, group=view.group)
            dims = [g.tolist() for g in gathered]
        launched = [_launch_allgather(s, view, [d[k] for d in dims]) for k, s in enumerate(srcs)]
        return (
            lambda: all(done() for done, _ in launched),
            lambda: [finish() for _, finish in launched],
        )

    return _submit(
        "grouped_allgather",
        name,
        srcs,
        launch,
        view,
        vary_first_dim=True,
        extra=16 * view.process_set_id,
    )


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor of the list (differentiable when a tensor requires
    grad)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return [
            allgather(t, name=None if name is None else f"{name}.{i}", process_set=process_set)
            for i, t in enumerate(tensors)
        ]
    return synchronize(grouped_allgather_async(tensors, name=name, process_set=process_set))


# ------------------------------------------------------------------ broadcast


def _submit_broadcast(output: torch.Tensor, root_rank: int, name: str | None, view: SetView) -> int:
    """Submit a broadcast of ``root_rank``'s ``output`` into ``output`` on every member."""

    def launch(match: Match) -> tuple[Callable[[], bool], Callable[[], Any]]:
        view.require_root(root_rank, "broadcast")  # the same root on every rank: all raise
        if view.size == 1:
            return (lambda: True), (lambda: output)
        wire = _to_wire(output)
        work = dist.broadcast(wire, src=root_rank, group=view.group, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            if wire is not output:
                output.copy_(wire)
            return output

        return work.is_completed, finish

    return _submit(
        "broadcast",
        name,
        [output],
        launch,
        view,
        extra=root_rank + (1 << 20) * view.process_set_id,
    )


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> int:
    """Start overwriting ``tensor`` on every rank with ``root_rank``'s (a global rank, as in
    Horovod); returns a handle.

    Raises:
        ValueError: for a non-contiguous tensor; on every rank, for a ``root_rank`` outside
            the process set.
    """
    view = _view(process_set, "broadcast")
    if not tensor.is_contiguous():
        raise ValueError("broadcast_: the tensor must be contiguous (use broadcast())")
    return _submit_broadcast(tensor, root_rank, name, view)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> int:
    """As :func:`broadcast_async_`, into a new tensor."""
    view = _view(process_set, "broadcast")
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _submit_broadcast(output, root_rank, name, view)


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, ps: Any) -> Any:
        ctx.root = root_rank
        ctx.ps = ps
        return synchronize(broadcast_async(tensor, root_rank, name=name, process_set=ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod >= 0.22 (PR #2687): the averaged gradient on the root, zero elsewhere
        summed = synchronize(
            allreduce_async(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.ps)
        )
        if runtime().rank != ctx.root:
            summed = summed * 0
        return summed, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor``, on every rank (a new tensor); differentiable.

    Args:
        root_rank: a global rank (``hvd.rank()``), a member of ``process_set``.

    Raises:
        ValueError: on every rank, for ``root_rank`` outside the process set.
        RuntimeError: on every rank, if shapes, dtypes or root ranks differ.
    """
    _check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFn.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name=name, process_set=process_set))


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------ sparse allreduce


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: ProcessSet | None = global_process_set
) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO ``tensor``: allgather of its indices and values (Horovod's
    algorithm); returns a *function* that waits and returns the sparse result (pass it to
    :func:`synchronize`, as Horovod's optimizer does, or call it).

    Args:
        tensor: a sparse COO tensor (``tensor.is_sparse``); same dense shape on every rank.
        name: names the two allgathers (``{name}.indices``, ``{name}.values``).
        op: Average divides the values by the set's size; Sum keeps them (duplicate indices are
            summed when the result is coalesced).

    Raises:
        ValueError: for a dense tensor, or an op other than Average or Sum.
    """
    if not getattr(tensor, "is_sparse", False):
        raise ValueError("sparse_allreduce_async expects a sparse COO tensor (tensor.is_sparse)")
    rop = _parse_op(op)
    if rop not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"sparse_allreduce_async supports op=Average or Sum, got {rop.name}")
    view = _view(process_set, "sparse_allreduce_async")
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices_handle = allgather_async(
        t._indices().transpose(0, 1).contiguous(), name=f"{name}.indices", process_set=process_set
    )
    values_handle = allgather_async(t._values(), name=f"{name}.values", process_set=process_set)

    def handle() -> torch.Tensor:
        values = synchronize(values_handle)
        indices = synchronize(indices_handle)
        if rop == ReduceOp.Average:
            values = values / view.size
        return torch.sparse_coo_tensor(
            indices.transpose(0, 1), values, t.size(), check_invariants=False
        )

    return handle
