"""``allreduce`` and its variants (in place, grouped, async) for :mod:`ringtrain.horovod`.

Dense reductions go through ringtrain's fused asynchronous allreduce
(:func:`ringtrain.comm.fusion.launch_fused_allreduce`, fusion threshold from
``HOROVOD_FUSION_THRESHOLD``); the differentiable forms' gradient is the allreduce of the
gradient with the same op. See :mod:`ringtrain.horovod.ops` for the conventions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringtrain.comm.compression import Compressor, NoneCompressor
from ringtrain.comm.fusion import (
    ReduceOp,
    check_op,
    fusion_threshold_from_env,
    launch_fused_allreduce,
)
from ringtrain.horovod.coordinator import Match
from ringtrain.horovod.handles import (
    _check_process_set,
    _resolve_op,
    _submit,
    _view,
    synchronize,
)
from ringtrain.horovod.joiner import layout_length, send_layout
from ringtrain.horovod.metadata import PAYLOAD
from ringtrain.horovod.process_sets import ProcessSet, SetView
from ringtrain.horovod.runtime import runtime


def _submit_allreduce(
    kind: str,
    tensors: Sequence[torch.Tensor],
    rop: ReduceOp,
    name: str | None,
    prescale_factor: float,
    postscale_factor: float,
    view: SetView,
    result: Callable[[], Any],
    outputs: Sequence[torch.Tensor] | None = None,
    scalar: bool = False,
) -> int:
    """Submit a fused allreduce of ``tensors`` into ``outputs`` (default: in place) under
    ``name``; ``synchronize`` waits for it, then returns ``result()``. The one submit path of
    every allreduce and reducescatter form.

    Args:
        scalar: (reducescatter) a tensor had no dimension: every participant raises
            ``RuntimeError`` once matched, as Horovod refuses to scatter a rank-zero tensor.
    """
    into = tensors if outputs is None else outputs
    threshold = max(1, fusion_threshold_from_env())
    scatters = kind.endswith("reducescatter")

    def launch(match: Match) -> tuple[Callable[[], bool], Callable[[], Any]]:
        check_op(rop)  # Adasum: NotImplementedError, on every rank (all passed the same op)
        if scatters:
            scalars = [view.ranks[i] for i, row in enumerate(match.rows) if row[PAYLOAD]]
            if scalars:
                raise RuntimeError(
                    f"{kind}: rank(s) {scalars} passed a rank-zero tensor (a scalar), which "
                    "cannot be scattered; pass a tensor with at least one dimension"
                )
        send_layout(match, view, tensors, rop, threshold)
        work = launch_fused_allreduce(
            tensors,
            into,
            op=rop,
            world_size=view.size,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            threshold_bytes=threshold,
            group=view.group,
            pool=runtime().pool,
        )

        def finish() -> Any:
            work.wait()
            return result()

        return work.is_completed, finish

    return _submit(
        kind,
        name,
        tensors,
        launch,
        view,
        extra=int(rop) + 16 * view.process_set_id,
        payload=int(scalar) if scatters else layout_length(tensors),
    )


def _forward_reduction(
    ctx: Any,
    launch_async: Callable[..., int],
    tensor: torch.Tensor,
    op: ReduceOp,
    pre: float,
    post: float,
    name: Any,
    ps: Any,
) -> Any:
    """The forward of a differentiable reduction (allreduce, reducescatter): keeps the
    arguments for the backward and reduces ``tensor`` with ``launch_async``."""
    ctx.args = (op, pre, post, ps)
    return synchronize(
        launch_async(
            tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
        )
    )


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> int:
    """Start reducing ``tensor`` in place across all ranks; returns a handle.

    Args:
        tensor: any shape and dtype, the same on every rank.
        average: deprecated; ``True`` is ``op=Average``, ``False`` is ``op=Sum``.
        name: unique among in-flight operations.
        op: Average (default: the sum divided by ``size()``), Sum, Min, Max or Product.
        prescale_factor: multiply the input by this before reducing.
        postscale_factor: multiply the result by this after reducing.

    Raises:
        ValueError: for a duplicate in-flight name or conflicting ``average``/``op``.
        RuntimeError: on every rank, if the ranks' tensors differ in dtype or shape.
        NotImplementedError: on every rank, for Adasum.
    """
    view = _view(process_set, "allreduce")
    rop = _resolve_op(average, op)

    return _submit_allreduce(
        "allreduce", [tensor], rop, name, prescale_factor, postscale_factor, view, lambda: tensor
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> int:
    """As :func:`allreduce_async_`, into a new tensor (the input is left unchanged)."""
    view = _view(process_set, "allreduce")
    rop = _resolve_op(average, op)
    output = tensor.detach().clone()
    return _submit_allreduce(
        "allreduce", [output], rop, name, prescale_factor, postscale_factor, view, lambda: output
    )


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Any, ps: Any
    ) -> Any:
        return _forward_reduction(ctx, allreduce_async, tensor, op, pre, post, name, ps)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        out = synchronize(
            allreduce_async(
                grad.contiguous(), op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
            )
        )
        return out, None, None, None, None, None


def _reduce_compressed(
    fn: Any,
    launch_async: Callable[..., int],
    tensor: torch.Tensor,
    op: ReduceOp,
    pre: float,
    post: float,
    name: str | None,
    compression: type[Compressor],
    process_set: ProcessSet | None,
) -> torch.Tensor:
    """A blocking reduction (allreduce, reducescatter) with wire compression: through the
    differentiable ``fn`` when autograd records, else ``launch_async`` + :func:`synchronize`."""
    wire, ctx = compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        out = fn.apply(wire, op, pre, post, name, process_set)
    else:
        out = synchronize(
            launch_async(
                wire,
                name=name,
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=process_set,
            )
        )
    return compression.decompress(out, ctx)


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` across all ranks and return the result (a new tensor); differentiable.

    Args:
        tensor: any shape and dtype; the same shape and dtype on every rank.
        average: deprecated; ``True`` is ``op=Average``, ``False`` is ``op=Sum``.
        name: unique among in-flight operations.
        compression: ``Compression.fp16``/``bf16`` cast floating tensors for the wire and back.
        op: Average (default), Sum, Min, Max or Product.
        prescale_factor: multiply the input by this before reducing.
        postscale_factor: multiply the result by this after reducing.

    Returns:
        A tensor of the same shape and dtype.

    Raises:
        RuntimeError: on every rank, if shapes or dtypes differ across ranks.
        ValueError: on every rank, for a duplicate in-flight name.
        NotImplementedError: on every rank, for Adasum.
    """
    _check_process_set(process_set)
    rop = _resolve_op(average, op)
    return _reduce_compressed(
        _AllreduceFn,
        allreduce_async,
        tensor,
        rop,
        prescale_factor,
        postscale_factor,
        name,
        compression,
        process_set,
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across all ranks and return it (see :func:`allreduce`)."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set)
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> int:
    """Start reducing a list of tensors in place, as one fused operation; returns a handle.

    The tensors are packed (in list order) into fusion buffers of at most
    ``HOROVOD_FUSION_THRESHOLD`` bytes (default 128 MiB) per dtype, each reduced with one
    collective; the metadata check runs once for the whole group.
    """
    view = _view(process_set, "grouped_allreduce")
    rop = _resolve_op(average, op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce: the list of tensors is empty")

    return _submit_allreduce(
        "grouped_allreduce",
        tensors,
        rop,
        name,
        prescale_factor,
        postscale_factor,
        view,
        lambda: tensors,
    )


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> int:
    """As :func:`grouped_allreduce_async_`, into new tensors."""
    view = _view(process_set, "grouped_allreduce")
    rop = _resolve_op(average, op)
    inputs = [t.detach() for t in tensors]
    if not inputs:
        raise ValueError("grouped_allreduce: the list of tensors is empty")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]

    return _submit_allreduce(
        "grouped_allreduce",
        inputs,
        rop,
        name,
        prescale_factor,
        postscale_factor,
        view,
        lambda: outputs,
        outputs,
    )


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, op: ReduceOp, pre: float, post: float, name: Any, ps: Any, *tensors: torch.Tensor
    ) -> Any:
        ctx.args = (op, pre, post, ps)
        return tuple(
            synchronize(
                grouped_allreduce_async(
                    tensors,
                    name=name,
                    op=op,
                    prescale_factor=pre,
                    postscale_factor=post,
                    process_set=ps,
                )
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        out = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads],
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=ps,
            )
        )
        return (None, None, None, None, None, *out)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused operation; returns new tensors; differentiable.

    Raises:
        RuntimeError: on every rank, if the lists differ across ranks (length, dtypes, shapes).
    """
    _check_process_set(process_set)
    rop = _resolve_op(average, op)
    packed = [compression.compress(t) for t in tensors]
    wires = [w for w, _ in packed]
    if torch.is_grad_enabled() and any(w.requires_grad for w in wires):
        outs = list(
            _GroupedAllreduceFn.apply(
                rop, prescale_factor, postscale_factor, name, process_set, *wires
            )
        )
    else:
        outs = synchronize(
            grouped_allreduce_async(
                wires,
                name=name,
                op=rop,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                process_set=process_set,
            )
        )
    return [compression.decompress(o, c) for o, (_, c) in zip(outs, packed, strict=False)]


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place as one fused operation and return them."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )
