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
from ringtrain.horovod.process_sets import SetView, global_process_set
from ringtrain.horovod.runtime import HorovodInternalError, Pending, negotiate, runtime

Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)


def _parse_op(op: Any) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`; Adasum passes here and is refused by :func:`_negotiate_op`
    after the metadata exchange, so that every rank raises."""
    try:
        return ReduceOp(int(op))
    except (ValueError, TypeError):
        return check_op(op)  # raises ValueError naming the valid ops


def _resolve_op(average: bool | None, op: Any) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated) or op=, not both")
    if op is None:
        return ReduceOp.Average if average is None or average else ReduceOp.Sum
    return _parse_op(op)


def _view(process_set: Any, what: str) -> SetView:
    """The set an operation runs on; ``ValueError`` (on this rank only: it is no participant)
    if this rank is not a member."""
    view = runtime().set_view(None if process_set is None else process_set)
    view.require_member(what)
    return view


def _check_process_set(process_set: Any) -> None:
    """Validate ``process_set`` (registered, this rank a member)."""
    _view(process_set, "collective")


#: gloo and NCCL have no 16-bit integer type: such tensors travel as int32 (exact).
_TRANSPORT = {torch.int16: torch.int32}


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    wire = _TRANSPORT.get(t.dtype)
    return t if wire is None else t.to(wire)


def _from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


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
    # A duplicate name is not refused here: the flag travels in the metadata exchange and
    # every rank of the operation raises the same ValueError (Horovod's coordinator does too).
    rt.duplicate_pending = rt.name_in_flight(name)
    try:
        is_completed, finish = launch()
    except RuntimeError as exc:
        if _is_peer_failure(exc) and not isinstance(exc, HorovodInternalError):
            raise HorovodInternalError(f"{kind} failed: {exc}") from exc
        raise
    finally:
        rt.duplicate_pending = False
    rt.claim_name(name)
    return rt.add(Pending(name=name, is_completed=is_completed, finish=finish))


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` will not block)."""
    if callable(handle):  # sparse_allreduce_async's handle (as in Horovod)
        return True
    return bool(runtime().take(handle).is_completed())


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output.

    Raises:
        HorovodInternalError: if the collective failed because a peer is gone.
        ValueError: for an unknown (or already synchronized) handle.
    """
    if callable(handle):  # sparse_allreduce_async returns a function (as in Horovod)
        return handle()
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
    view: SetView,
    compression: type[Compressor] = NoneCompressor,
) -> tuple[Callable[[], bool], Callable[[], None]]:
    negotiate(kind, name, tensors, extra=int(op) + 16 * view.process_set_id, view=view)
    check_op(op)  # Adasum: NotImplementedError, on every rank (all passed the same op)
    work = launch_fused_allreduce(
        tensors,
        outputs,
        op=op,
        world_size=view.size,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        compression=compression,
        threshold_bytes=max(1, fusion_threshold_from_env()),
        group=view.group,
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
        NotImplementedError: on every rank, for Adasum.
    """
    view = _view(process_set, "allreduce")
    rop = _resolve_op(average, op)

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "allreduce", [tensor], [tensor], rop, name, prescale_factor, postscale_factor, view
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
    view = _view(process_set, "allreduce")
    rop = _resolve_op(average, op)
    output = tensor.detach().clone()

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "allreduce", [output], [output], rop, name, prescale_factor, postscale_factor, view
        )
        return done, lambda: (wait(), output)[1]

    return _submit(name, "allreduce", launch)


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Any, ps: Any
    ) -> Any:
        ctx.args = (op, pre, post, ps)
        return synchronize(
            allreduce_async(
                tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
            )
        )

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
    process_set: Any,
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
    view = _view(process_set, "grouped_allreduce")
    rop = _resolve_op(average, op)
    tensors = list(tensors)
    if not tensors:
        raise ValueError("grouped_allreduce: the list of tensors is empty")

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "grouped_allreduce",
            tensors,
            tensors,
            rop,
            name,
            prescale_factor,
            postscale_factor,
            view,
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
    view = _view(process_set, "grouped_allreduce")
    rop = _resolve_op(average, op)
    inputs = [t.detach() for t in tensors]
    if not inputs:
        raise ValueError("grouped_allreduce: the list of tensors is empty")
    outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in inputs]

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "grouped_allreduce", inputs, outputs, rop, name, prescale_factor, postscale_factor, view
        )
        return done, lambda: (wait(), outputs)[1]

    return _submit(name, "grouped_allreduce", launch)


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
    process_set: Any = None,
) -> list[torch.Tensor]:
    """Reduce a list of tensors in place as one fused operation and return them."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str, op: Any, process_set: Any = global_process_set
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


# ------------------------------------------------------------------ allgather


def _as_1d(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor


def _launch_allgather(
    src: torch.Tensor, name: str | None, view: SetView, kind: str = "allgather"
) -> tuple[Callable[[], bool], Callable[[], torch.Tensor]]:
    rows = negotiate(
        kind, name, [src], vary_first_dim=True, extra=16 * view.process_set_id, view=view
    )
    dims = [row[5] for row in rows] if len(rows) == view.size else [src.shape[0]] * view.size
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


def allgather_async(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
) -> int:
    """Start concatenating every rank's ``tensor`` along the first dimension; returns a handle.

    The first dimension may differ across ranks; the others and the dtype must match. Every
    dtype Horovod supports works on gloo (int16 travels as int32).
    """
    view = _view(process_set, "allgather")
    src = _as_1d(tensor.detach()).contiguous()
    return _submit(name, "allgather", lambda: _launch_allgather(src, name, view))


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
        summed = synchronize(allreduce_async(grad.contiguous(), op=Average, process_set=ctx.ps))
        dims = synchronize(
            allgather_async(torch.tensor([ctx.dim0], dtype=torch.int64), process_set=ctx.ps)
        )
        offset = int(dims[: _view(ctx.ps, "allgather").rank].sum())
        out = summed.narrow(0, offset, ctx.dim0)
        return (out.reshape(()) if ctx.scalar else out), None, None


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set
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
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
) -> int:
    """Start an allgather of each tensor of the list, under one handle (``synchronize`` returns
    the list of results). One metadata exchange checks the whole list."""
    view = _view(process_set, "grouped_allgather")
    srcs = [_as_1d(t.detach()).contiguous() for t in tensors]
    if not srcs:
        raise ValueError("grouped_allgather: the list of tensors is empty")

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        negotiate(
            "grouped_allgather",
            name,
            srcs,
            extra=16 * view.process_set_id,
            view=view,
            vary_first_dim=True,
        )
        launched = [_launch_allgather(s, None, view, "grouped_allgather.part") for s in srcs]
        return (
            lambda: all(done() for done, _ in launched),
            lambda: [finish() for _, finish in launched],
        )

    return _submit(name, "grouped_allgather", launch)


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: Any = global_process_set
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


def _broadcast_launch(
    tensor: torch.Tensor, output: torch.Tensor, root_rank: int, name: str | None, view: SetView
) -> tuple[Callable[[], bool], Callable[[], Any]]:
    negotiate(
        "broadcast", name, [tensor], extra=root_rank + (1 << 20) * view.process_set_id, view=view
    )
    view.require_root(root_rank, "broadcast")
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


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
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
    return _submit(
        name, "broadcast", lambda: _broadcast_launch(tensor, tensor, root_rank, name, view)
    )


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
) -> int:
    """As :func:`broadcast_async_`, into a new tensor."""
    view = _view(process_set, "broadcast")
    output = tensor.detach().clone(memory_format=torch.contiguous_format)
    return _submit(
        name, "broadcast", lambda: _broadcast_launch(output, output, root_rank, name, view)
    )


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Any, ps: Any) -> Any:
        ctx.root = root_rank
        ctx.ps = ps
        return synchronize(broadcast_async(tensor, root_rank, name=name, process_set=ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Horovod >= 0.22 (PR #2687): the averaged gradient on the root, zero elsewhere
        summed = synchronize(allreduce_async(grad.contiguous(), op=Average, process_set=ctx.ps))
        if runtime().rank != ctx.root:
            summed = summed * 0
        return summed, None, None, None


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: Any = global_process_set,
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
    process_set: Any = global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` in place with ``root_rank``'s and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ------------------------------------------------------------------ alltoall and reducescatter


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
    process_set: Any = global_process_set,
) -> int:
    """Start an all-to-all: rank r sends ``splits[j]`` rows of ``tensor`` to the j-th rank of the
    set.

    ``synchronize`` returns ``(output, received_splits)`` (int32), as Horovod's.

    Raises:
        ValueError: on every rank, if any rank's splits are invalid.
    """
    view = _view(process_set, "alltoall")
    src = _as_1d(tensor.detach()).contiguous()

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        send, problem = _splits_list(splits, src.shape[0], view.size)
        rows = negotiate(
            "alltoall",
            name,
            [src],
            vary_first_dim=True,
            splits=send,
            extra=16 * view.process_set_id,
            view=view,
            payload=int(problem is not None),
        )
        bad = [view.ranks[i] for i, row in enumerate(rows) if row[9]]
        if problem is not None:
            raise ValueError(problem)
        if bad:
            raise ValueError(f"alltoall: rank(s) {bad} passed invalid splits (they raise why)")
        received = [row[10 + view.rank] for row in rows] if len(rows) > 1 else list(send)
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

    return _submit(name, "alltoall", launch)


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
    process_set: Any = global_process_set,
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
    process_set: Any = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> int:
    """Start reducing ``tensor`` across ranks and keeping this rank's slice of the first dimension
    (as even as possible, earlier ranks one row more). Implemented as an allreduce followed by a
    slice: correct on every backend, twice the bytes of a ring reduce-scatter."""
    view = _view(process_set, "reducescatter")
    rop = _parse_op(op)
    work_tensor = _as_1d(tensor.detach()).clone(memory_format=torch.contiguous_format)

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "reducescatter",
            [work_tensor],
            [work_tensor],
            rop,
            name,
            prescale_factor,
            postscale_factor,
            view,
        )
        counts = _scatter_counts(work_tensor.shape[0], view.size)
        offset = sum(counts[: view.rank])

        def finish() -> torch.Tensor:
            wait()
            return work_tensor.narrow(0, offset, counts[view.rank]).clone()

        return done, finish

    return _submit(name, "reducescatter", launch)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, pre: float, post: float, name: Any, ps: Any
    ) -> Any:
        ctx.args = (op, pre, post, ps)
        return synchronize(
            reducescatter_async(
                tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps
            )
        )

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, pre, post, ps = ctx.args
        full = synchronize(allgather_async(grad.contiguous(), process_set=ps))
        n = _view(ps, "reducescatter").size
        scale = pre * post / (n if op == ReduceOp.Average else 1)
        return full * scale, None, None, None, None, None


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = ReduceOp.Average,
    process_set: Any = global_process_set,
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
    process_set: Any = global_process_set,
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

    def launch() -> tuple[Callable[[], bool], Callable[[], Any]]:
        done, wait = _launch_allreduce(
            "grouped_reducescatter",
            works,
            works,
            rop,
            name,
            prescale_factor,
            postscale_factor,
            view,
        )

        def finish() -> list[torch.Tensor]:
            wait()
            out = []
            for w in works:
                counts = _scatter_counts(w.shape[0], view.size)
                out.append(w.narrow(0, sum(counts[: view.rank]), counts[view.rank]).clone())
            return out

        return done, finish

    return _submit(name, "grouped_reducescatter", launch)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = NoneCompressor,
    op: Any = ReduceOp.Average,
    process_set: Any = global_process_set,
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


# ------------------------------------------------------------------ barrier and join


def barrier(process_set: Any = global_process_set) -> None:
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
