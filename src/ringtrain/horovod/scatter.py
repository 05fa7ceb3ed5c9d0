"""``alltoall`` and ``reducescatter`` (and grouped ``reducescatter``).

Invalid splits are detected before the metadata exchange but raised after it, so that every
rank of the operation raises the same error instead of one rank hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.compression import Compressor, NoneCompressor
from ringtrain.comm.fusion import ReduceOp
from ringtrain.horovod.coordinator import Match
from ringtrain.horovod.gather import allgather_async
from ringtrain.horovod.handles import (
    _as_1d,
    _check_process_set,
    _parse_op,
    _submit,
    _to_wire,
    _view,
    synchronize,
)
from ringtrain.horovod.metadata import HEADER, PAYLOAD
from ringtrain.horovod.process_sets import ProcessSet, global_process_set
from ringtrain.horovod.reduce import _forward_reduction, _reduce_compressed, _submit_allreduce


def _splits_list(splits: Any, dim0: int, size: int) -> tuple[list[int], str | None]:
    """The splits to send, and an error text (raised after the metadata exchange, so that every
    rank raises it)."""
    if splits is None:
        if dim0 % size:
            return [0] * size, (
                f"alltoall: the first dimension ({dim0}) is not divisible by the number of ranks "
                f"({size}); pass splits="
            )
        return [dim0 // size] * size, None
    values = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != size or any(v < 0 for v in values) or sum(values) != dim0:
        return [0] * size, (
            f"alltoall: splits={values} must be {size} non-negative counts summing to the first "
            f"dimension ({dim0})"
        )
    return values, None


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> int:
    """Start an all-to-all: rank r sends ``splits[j]`` rows of ``tensor`` to the j-th rank of the
    set.

    ``synchronize`` returns ``(output, received_splits)`` (int32), as Horovod's.

    Raises:
        ValueError: on every rank, if any rank's splits are invalid.
    """
    view = _view(process_set, "alltoall")
    src = _as_1d(tensor.detach()).contiguous()
    send, problem = _splits_list(splits, src.shape[0], view.size)

    def launch(match: Match) -> tuple[Callable[[], bool], Callable[[], Any]]:
        bad = [view.ranks[i] for i, row in enumerate(match.rows) if row[PAYLOAD]]
        if problem is not None:
            raise ValueError(problem)
        if bad:
            raise ValueError(f"alltoall: rank(s) {bad} passed invalid splits (they raise why)")
        rows = match.rows
        received = [row[HEADER + view.rank] for row in rows] if len(rows) > 1 else list(send)
        out = src.new_empty((sum(received), *src.shape[1:]))
        recv_splits = torch.tensor(received, dtype=torch.int32)
        if view.size == 1:
            out.copy_(src)
            return (lambda: True), (lambda: (out, recv_splits))
        wire_in, wire_out = _to_wire(src), _to_wire(out)
        work = dist.all_to_all_single(
            wire_out,
            wire_in,
            output_split_sizes=received,
            input_split_sizes=send,
            group=view.group,
            async_op=True,
        )

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            work.wait()
            if wire_out is not out:
                out.copy_(wire_out)
            return out, recv_splits

        return work.is_completed, finish

    return _submit(
        "alltoall",
        name,
        [src],
        launch,
        view,
        vary_first_dim=True,
        splits=send,
        extra=16 * view.process_set_id,
        payload=int(problem is not None),
    )


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any, ps: Any) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name=name, process_set=ps))
        ctx.received = received
        ctx.ps = ps
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> Any:
        out, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, process_set=ctx.ps))
        return out, None, None, None


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> Any:
    """Scatter slices of ``tensor`` to every rank and gather theirs; differentiable.

    Args:
        tensor: shape ``(d, *rest)``.
        splits: ``n`` row counts summing to ``d`` (a list or an int tensor; default: ``d / n``
            each, n the number of ranks of the set).

    Returns:
        As Horovod 0.28: the received rows (rank order) when ``splits`` is ``None``; otherwise
        ``(output, received_splits)``, the rows and how many came from each rank (int32).

    Raises:
        ValueError: on every rank, for bad splits.
        RuntimeError: on every rank, if dtypes or trailing dimensions differ.
    """
    _check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AlltoallFn.apply(tensor, splits, name, process_set)
    out, received = synchronize(alltoall_async(tensor, splits, name=name, process_set=process_set))
    return out if splits is None else (out, received)


def _scatter_counts(dim0: int, size: int) -> list[int]:
    base, extra = divmod(dim0, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = ReduceOp.Average,
    process_set: ProcessSet | None = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` across ranks and keeping this rank's slice of the first dimension
    (as even as possible, earlier ranks one row more). Implemented as an allreduce followed by a
    slice: correct on every backend, twice the bytes of a ring reduce-scatter."""
    view = _view(process_set, "reducescatter")
    rop = _parse_op(op)
    work_tensor = _as_1d(tensor.detach()).clone(memory_format=torch.contiguous_format)

    counts = _scatter_counts(work_tensor.shape[0], view.size)
    offset = sum(counts[: view.rank])

    def mine() -> torch.Tensor:
        return work_tensor.narrow(0, offset, counts[view.rank]).clone()

    return _submit_allreduce(
        "reducescatter",
        [work_tensor],
        rop,
        name,
        prescale_factor,
        postscale_factor,
        view,
        mine,
        scalar=tensor.dim() == 0,
    )


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Any, ps: Any
    ) -> Any:
        return _forward_reduction(ctx, reducescatter_async, tensor, op, pre, post, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod's ReducescatterOp gradient: the allgather of the upstream gradient, times the
        # set's size for Sum (for Average, as is), times the pre- and postscale factors.
        op, pre, post, ps = ctx.args
        full = synchronize(allgather_async(grad.contiguous(), process_set=ps))
        n = _view(ps, "reducescatter").size
        scale = pre * post * (n if op == ReduceOp.Sum else 1)
        return full * scale, None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = ReduceOp.Average,
    process_set: ProcessSet | None = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` (shape ``(d, *rest)``) and return this rank's rows of the result;
    differentiable.

    Returns:
        Shape ``(d_r, *rest)``: ``d_r = d // n``, plus one on the first ``d % n`` ranks of the
        set (n ranks).
    """
    _check_process_set(process_set)
    rop = _parse_op(op)
    return _reduce_compressed(
        _ReducescatterFn,
        reducescatter_async,
        tensor,
        rop,
        prescale_factor,
        postscale_factor,
        name,
        compression,
        process_set,
    )


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: Any = ReduceOp.Average,
    process_set: ProcessSet | None = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start a reducescatter of each tensor of the list as one fused allreduce; ``synchronize``
    returns the list of this rank's slices."""
    view = _view(process_set, "grouped_reducescatter")
    rop = _parse_op(op)
    works = [_as_1d(t.detach()).clone(memory_format=torch.contiguous_format) for t in tensors]
    if not works:
        raise ValueError("grouped_reducescatter: the list of tensors is empty")

    def mine() -> list[torch.Tensor]:
        out = []
        for w in works:
            counts = _scatter_counts(w.shape[0], view.size)
            out.append(w.narrow(0, sum(counts[: view.rank]), counts[view.rank]).clone())
        return out

    return _submit_allreduce(
        "grouped_reducescatter",
        works,
        rop,
        name,
        prescale_factor,
        postscale_factor,
        view,
        mine,
        scalar=any(t.dim() == 0 for t in tensors),
    )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = ReduceOp.Average,
    process_set: ProcessSet | None = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor of the list (fused into one allreduce unless a
    tensor requires grad)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return [
            reducescatter(
                t,
                None if name is None else f"{name}.{i}",
                compression,
                op,
                process_set,
                prescale_factor,
                postscale_factor,
            )
            for i, t in enumerate(tensors)
        ]
    packed = [compression.compress(t) for t in tensors]
    outs = synchronize(
        grouped_reducescatter_async(
            [w for w, _ in packed], name, op, process_set, prescale_factor, postscale_factor
        )
    )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=True)]
