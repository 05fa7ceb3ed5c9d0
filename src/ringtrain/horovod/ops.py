"""The collectives of ``horovod.torch`` on ``torch.distributed``.

Every operation first runs :func:`~ringtrain.horovod.runtime.negotiate` (one small
``all_gather`` that checks all ranks called the same operation on compatible tensors, raising
``RuntimeError`` on every rank otherwise), then launches the ``torch.distributed`` collective with
``async_op=True``. ``*_async`` functions return an integer handle for :func:`poll` and
:func:`synchronize`; the others synchronize at once. The non-in-place functions are
differentiable (``torch.autograd.Function``, with Horovod's gradients: allreduce's gradient is
the allreduce of the gradient, allgather's the summed gradient's own slice, broadcast's the sum
on the root and zero elsewhere).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.compression import Compressor, NoneCompressor
from ringtrain.comm.fusion import (
    ReduceOp,
    check_op,
    fusion_threshold_from_env,
    launch_fused_allreduce,
)
from ringtrain.horovod.runtime import HorovodInternalError, Pending, negotiate, runtime

Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)


def _resolve_op(average: bool | None, op: Any) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated) or op=, not both")
    if op is None:
        return ReduceOp.Average if average is None or average else ReduceOp.Sum
    return check_op(op)


def _check_process_set(process_set: Any) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise NotImplementedError(
            "process sets are not supported by ringtrain.horovod; use torch.distributed.new_group"
        )


class _GlobalProcessSet:
    """Horovod's ``global_process_set``: all ranks (the only process set supported)."""

    process_set_id = 0

    def size(self) -> int:
        return runtime().size

    def rank(self) -> int:
        return runtime().rank


global_process_set = _GlobalProcessSet()


def _is_peer_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed", "Connection reset", "gloo", "NCCL"))


def _submit(
    name: str | None, kind: str, launch: Callable[[], tuple[Callable[[], bool], Callable[[], Any]]]
) -> int:
    """Launch an operation under ``name`` and register it; returns its handle."""
    rt = runtime()
    rt.claim_name(name)
    try:
        is_completed, finish = launch()
    except RuntimeError as exc:
        rt.release_name(name)
        if _is_peer_failure(exc) and not isinstance(exc, HorovodInternalError):
            raise HorovodInternalError(f"{kind} failed: {exc}") from exc
        raise
    except BaseException:
        rt.release_name(name)
        raise
    return rt.add(Pending(name=name, is_completed=is_completed, finish=finish))


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` will not block)."""
    return bool(runtime().take(handle).is_completed())


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output.

    Raises:
        HorovodInternalError: if the collective failed because a peer is gone.
        ValueError: for an unknown (or already synchronized) handle.
    """
    rt = runtime()
    pending = rt.take(handle)
    try:
        result = pending.finish()
    except RuntimeError as exc:
        if _is_peer_failure(exc) and not isinstance(exc, HorovodInternalError):
            raise HorovodInternalError(f"operation {pending.name or handle} failed: {exc}") from exc
        raise
    finally:
        with rt.lock:
            rt.handles.pop(handle, None)
        rt.release_name(pending.name)
    return result


# ------------------------------------------------------------------ allreduce


def _launch_allreduce(
    kind: str,
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    op: ReduceOp,
    name: str | None,
    prescale_factor: float,
    postscale_factor: float,
    compression: type[Compressor] = NoneCompressor,
) -> tuple[Callable[[], bool], Callable[[], None]]:
    rt = runtime()
    negotiate(kind, name, tensors, extra=int(op))
    work = launch_fused_allreduce(
        tensors,
        outputs,
        op=op,
        world_size=rt.size,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        compression=compression,
        threshold_bytes=max(1, fusion_threshold_from_env()),
    )
    return work.is_completed, work.wait


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
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
        NotImplementedError: for Adasum, or a process set.
    """
    _check_process_set(process_set)
    rop = _resolve_op(average, op)

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "allreduce", [tensor], [tensor], rop, name, prescale_factor, postscale_factor
        )
        return done, lambda: (wait(), tensor)[1]

    return _submit(name, "allreduce", launch)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """As :func:`allreduce_async_`, into a new tensor (the input is left unchanged)."""
    _check_process_set(process_set)
    rop = _resolve_op(average, op)
    output = tensor.detach().clone()

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "allreduce", [output], [output], rop, name, prescale_factor, postscale_factor
        )
        return done, lambda: (wait(), output)[1]

    return _submit(name, "allreduce", launch)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Any
    ) -> Any:
        ctx.args = (op, pre, post)
        return synchronize(
            allreduce_async(tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post)
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post = ctx.args
        out = synchronize(
            allreduce_async(grad.contiguous(), op=op, prescale_factor=pre, postscale_factor=post)
        )
        return out, None, None, None, None


def _reduce_compressed(
    fn: Any,
    launch_async: Callable[..., int],
    tensor: torch.Tensor,
    op: ReduceOp,
    pre: float,
    post: float,
    name: str | None,
    compression: type[Compressor],
) -> torch.Tensor:
    """A blocking reduction (allreduce, reducescatter) with wire compression: through the
    differentiable ``fn`` when autograd records, else ``launch_async`` + :func:`synchronize`."""
    wire, ctx = compression.compress(tensor)
    if wire.requires_grad and torch.is_grad_enabled():
        out = fn.apply(wire, op, pre, post, name)
    else:
        out = synchronize(
            launch_async(wire, name=name, op=op, prescale_factor=pre, postscale_factor=post)
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
    process_set: Any = None,
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
        ValueError: for a duplicate in-flight name.
        NotImplementedError: for Adasum.
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
    )


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
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
    process_set: Any = None,
) -> int:
    """Start reducing a list of tensors in place, as one fused operation; returns a handle.

    The tensors are packed (in list order) into fusion buffers of at most
    ``HOROVOD_FUSION_THRESHOLD`` bytes (default 128 MiB) per dtype, each reduced with one
    collective; the metadata check runs once for the whole group.
    """
    _check_process_set(process_set)
    rop = _resolve_op(average, op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce: the list of tensors is empty")

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "grouped_allreduce", tensors, tensors, rop, name, prescale_factor, postscale_factor
        )
        return done, lambda: (wait(), tensors)[1]

    return _submit(name, "grouped_allreduce", launch)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> int:
    """As :func:`grouped_allreduce_async_`, into new tensors."""
    _check_process_set(process_set)
    rop = _resolve_op(average, op)
    inputs = [t.detach() for t in tensors]
    if not inputs:
        raise ValueError("grouped_allreduce: the list of tensors is empty")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "grouped_allreduce", inputs, outputs, rop, name, prescale_factor, postscale_factor
        )
        return done, lambda: (wait(), outputs)[1]

    return _submit(name, "grouped_allreduce", launch)


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, op: ReduceOp, pre: float, post: float, name: Any, *tensors: torch.Tensor
    ) -> Any:
        ctx.args = (op, pre, post)
        return tuple(
            synchronize(
                grouped_allreduce_async(
                    tensors, name=name, op=op, prescale_factor=pre, postscale_factor=post
                )
            )
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, pre, post = ctx.args
        out = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads], op=op, prescale_factor=pre, postscale_factor=post
            )
        )
        return (None, None, None, None, *out)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
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
        outs = list(_GroupedAllreduceFn.apply(rop, prescale_factor, postscale_factor, name, *wires))
    else:
        outs = synchronize(
            grouped_allreduce_async(
                wires,
                name=name,
                op=rop,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
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
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place as one fused operation and return them."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


# ------------------------------------------------------------------ allgather


def _as_1d(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension; returns a handle.

    The first dimension may differ across ranks; the others and the dtype must match.
    """
    _check_process_set(process_set)
    src = _as_1d(tensor.detach()).contiguous()

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        rt = runtime()
        rows = negotiate("allgather", name, [src], vary_first_dim=True)
        dims = [row[5] for row in rows]
        if rt.size == 1:
            out = src.clone()
            return (lambda: True), (lambda: out)
        longest = max(dims)
        padded = src
        if src.shape[0] < longest:
            pad = src.new_zeros((longest - src.shape[0], *src.shape[1:]))
            padded = torch.cat([src, pad])
        parts = [src.new_empty((longest, *src.shape[1:])) for _ in range(rt.size)]
        work = dist.all_gather(parts, padded, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            return torch.cat([p[:d] for p, d in zip(parts, dims, strict=False)])

        return work.is_completed, finish

    return _submit(name, "allgather", launch)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Any) -> Any:
        ctx.dim0 = _as_1d(tensor).shape[0]
        ctx.scalar = tensor.dim() == 0
        return synchronize(allgather_async(tensor, name=name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        summed = synchronize(allreduce_async(grad.contiguous(), op=Sum))
        dims = synchronize(allgather_async(torch.tensor([ctx.dim0], dtype=torch.int64)))
        offset = int(dims[: runtime().rank].sum())
        out = summed.narrow(0, offset, ctx.dim0)
        return (out.reshape(()) if ctx.scalar else out), None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along the first dimension (rank order); differentiable.

    Args:
        tensor: shape ``(d_r, *rest)``; ``d_r`` may differ per rank, ``rest`` and dtype may not.

    Returns:
        Shape ``(sum_r d_r, *rest)``.

    Raises:
        RuntimeError: on every rank, if dtypes or trailing dimensions differ.
    """
    _check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AllgatherFn.apply(tensor, name)
    return synchronize(allgather_async(tensor, name=name))


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = None
) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor of the list."""
    return [
        allgather(t, name=None if name is None else f"{name}.{i}", process_set=process_set)
        for i, t in enumerate(tensors)
    ]


# ------------------------------------------------------------------ broadcast


def _broadcast_launch(
    tensor: torch.Tensor, output: torch.Tensor, root_rank: int, name: str | None
) -> tuple[Callable[[], bool], Callable[[], Any]]:
    rt = runtime()
    if not 0 <= root_rank < rt.size:
        raise ValueError(f"root_rank={root_rank} is outside [0, size()={rt.size})")
    negotiate("broadcast", name, [tensor], extra=root_rank)
    if rt.size == 1:
        return (lambda: True), (lambda: output)
    work = dist.broadcast(output, src=root_rank, async_op=True)
    return work.is_completed, lambda: (work.wait(), output)[1]


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> int:
    """Start overwriting ``tensor`` on every rank with ``root_rank``'s; returns a handle."""
    _check_process_set(process_set)
    if not tensor.is_contiguous():
        raise ValueError("broadcast_: the tensor must be contiguous (use broadcast())")
    return _submit(name, "broadcast", lambda: _broadcast_launch(tensor, tensor, root_rank, name))


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> int:
    """As :func:`broadcast_async_`, into a new tensor."""
    _check_process_set(process_set)
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _submit(name, "broadcast", lambda: _broadcast_launch(output, output, root_rank, name))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any) -> Any:
        ctx.root = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name=name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        summed = synchronize(allreduce_async(grad.contiguous(), op=Sum))
        if runtime().rank != ctx.root:
            summed = summed * 0
        return summed, None, None


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """``root_rank``'s ``tensor``, on every rank (a new tensor); differentiable.

    Raises:
        ValueError: for ``root_rank`` outside ``[0, size())``.
        RuntimeError: on every rank, if shapes, dtypes or root ranks differ.
    """
    _check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _BroadcastFn.apply(tensor, root_rank, name)
    return synchronize(broadcast_async(tensor, root_rank, name=name))


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: Any = None
) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------ alltoall and reducescatter


def _splits_list(splits: Any, dim0: int, size: int) -> list[int]:
    if splits is None:
        if dim0 % size:
            raise ValueError(
                f"alltoall: the first dimension ({dim0}) is not divisible by size() ({size}); "
                "pass splits="
            )
        return [dim0 // size] * size
    values = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != size or any(v < 0 for v in values) or sum(values) != dim0:
        raise ValueError(
            f"alltoall: splits={values} must be {size} non-negative counts summing to the first "
            f"dimension ({dim0})"
        )
    return values


def alltoall_async(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> int:
    """Start an all-to-all: rank r sends ``splits[j]`` rows of ``tensor`` to rank j.

    ``synchronize`` returns ``(output, received_splits)``.
    """
    _check_process_set(process_set)
    src = _as_1d(tensor.detach()).contiguous()

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        rt = runtime()
        send = _splits_list(splits, src.shape[0], rt.size)
        rows = negotiate("alltoall", name, [src], vary_first_dim=True, splits=send)
        received = [row[8 + rt.rank] for row in rows]
        out = src.new_empty((sum(received), *src.shape[1:]))
        recv_splits = torch.tensor(received, dtype=torch.int32)
        if rt.size == 1:
            out.copy_(src)
            return (lambda: True), (lambda: (out, recv_splits))
        work = dist.all_to_all_single(
            out, src, output_split_sizes=received, input_split_sizes=send, async_op=True
        )
        return work.is_completed, lambda: (work.wait(), (out, recv_splits))[1]

    return _submit(name, "alltoall", launch)


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Any) -> Any:
        out, received = synchronize(alltoall_async(tensor, splits, name=name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _unused: Any) -> Any:
        out, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received))
        return out, None, None


def alltoall(
    tensor: torch.Tensor, splits: Any = None, name: str | None = None, process_set: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter slices of ``tensor`` to every rank and gather theirs; differentiable.

    Args:
        tensor: shape ``(d, *rest)``.
        splits: ``size()`` row counts summing to ``d`` (default: ``d / size()`` each).

    Returns:
        ``(output, received_splits)``: the rows received, in rank order, and how many from each.

    Raises:
        ValueError: for bad splits.
        RuntimeError: on every rank, if dtypes or trailing dimensions differ.
    """
    _check_process_set(process_set)
    if tensor.requires_grad and torch.is_grad_enabled():
        return _AlltoallFn.apply(tensor, splits, name)
    return synchronize(alltoall_async(tensor, splits, name=name))


def _scatter_counts(dim0: int, size: int) -> list[int]:
    base, extra = divmod(dim0, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` across ranks and keeping this rank's slice of the first dimension
    (as even as possible, earlier ranks one row more). Implemented as an allreduce followed by a
    slice: correct on every backend, twice the bytes of a ring reduce-scatter."""
    _check_process_set(process_set)
    rop = check_op(op)
    work_tensor = _as_1d(tensor.detach()).clone(memory_format=torch.contiguous_format)

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        rt = runtime()
        done, wait = _launch_allreduce(
            "reducescatter",
            [work_tensor],
            [work_tensor],
            rop,
            name,
            prescale_factor,
            postscale_factor,
        )
        counts = _scatter_counts(work_tensor.shape[0], rt.size)
        offset = sum(counts[: rt.rank])

        def finish() -> torch.Tensor:
            wait()
            return work_tensor.narrow(0, offset, counts[rt.rank]).clone()

        return done, finish

    return _submit(name, "reducescatter", launch)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Any
    ) -> Any:
        ctx.args = (op, pre, post)
        return synchronize(
            reducescatter_async(
                tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post
            )
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post = ctx.args
        full = synchronize(allgather_async(grad.contiguous()))
        scale = pre * post / (runtime().size if op == ReduceOp.Average else 1)
        return full * scale, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce ``tensor`` (shape ``(d, *rest)``) and return this rank's rows of the result;
    differentiable.

    Returns:
        Shape ``(d_r, *rest)``: ``d_r = d // size()``, plus one on the first ``d % size()`` ranks.
    """
    _check_process_set(process_set)
    rop = check_op(op)
    return _reduce_compressed(
        _ReducescatterFn,
        reducescatter_async,
        tensor,
        rop,
        prescale_factor,
        postscale_factor,
        name,
        compression,
    )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = ReduceOp.Average,
    process_set: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor of the list."""
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


# ------------------------------------------------------------------ barrier and join


def barrier(process_set: Any = None) -> None:
    """Block until every rank has called ``barrier()``."""
    _check_process_set(process_set)
    if runtime().size > 1:
        dist.barrier()


def join(device: int = -1) -> int:
    """Block until every rank has called ``join()``; return the rank that joined last.

    Unlike Horovod, a rank that has joined does not serve its peers' later collectives with
    zeros: call ``join()`` where every rank has finished its collectives (the end of an epoch
    with uneven data); a rank still issuing collectives then times out instead of finishing.
    The last rank is the one with the latest wall-clock arrival (one ``all_gather``).
    """
    rt = runtime()
    if rt.size == 1:
        return 0
    arrival = torch.tensor([time.time()], dtype=torch.float64)
    gathered = [torch.empty_like(arrival) for _ in range(rt.size)]
    dist.all_gather(gathered, arrival)
    return int(torch.cat(gathered).argmax())
