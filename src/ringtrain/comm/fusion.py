"""Tensor fusion: many tensors reduced as few flat buffers, launched asynchronously.

Where the algorithm comes from:

- **Horovod's tensor fusion** (docs/tensor-fusion.rst): tensors are copied into a fusion buffer of
  at most ``HOROVOD_FUSION_THRESHOLD`` bytes (default 128 MiB since Horovod 0.21; 0 disables
  fusion), of one dtype, reduced with one collective, and copied back out. Horovod decides at
  run time which tensors are ready on every rank (its coordinator's *negotiation*, one round per
  ``HOROVOD_CYCLE_TIME``) and fuses those.
- **DDP's reducer buckets** (``torch/csrc/distributed/c10d/reducer.cpp``): the bucket layout is
  fixed once, from the parameters in *reverse registration order* (gradients of the last layers
  are ready first), with a small first bucket (DDP: 1 MiB) so that communication starts early; a
  bucket is launched when all its gradients are ready, and buckets are launched *strictly in
  order*, so every rank issues the same collectives in the same sequence whatever order its
  gradients became ready in.

ringtrain takes the static layout from DDP (no negotiation round per cycle: in Python a
coordinator would cost more than it saves) and the threshold, dtype grouping, compression and
pre/post-scaling from Horovod. The layout is checked once across ranks (one ``all_gather`` of a
16-byte digest of every tensor's name, dtype and shape), so a mismatch raises ``RuntimeError`` on
every rank instead of hanging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.buckets import (
    DEFAULT_FIRST_BUCKET_BYTES,
    DEFAULT_FUSION_THRESHOLD,
    DIST_OPS,
    ENV_FUSION_THRESHOLD,
    NO_INT16,
    ReduceOp,
    check_op,
    check_same_layout,
    fusion_threshold_from_env,
    layout_digest,
    plan_buckets,
)
from ringtrain.comm.compression import Compressor, NoneCompressor

__all__ = [  # the planning names live in ringtrain.comm.buckets; importable from here too
    "DEFAULT_FIRST_BUCKET_BYTES",
    "DEFAULT_FUSION_THRESHOLD",
    "ENV_FUSION_THRESHOLD",
    "BufferPool",
    "FusedWork",
    "GradientAllreducer",
    "ReduceOp",
    "check_op",
    "check_same_layout",
    "fusion_threshold_from_env",
    "launch_fused_allreduce",
    "layout_digest",
    "plan_buckets",
]

# ------------------------------------------------------------------ packing and launching


class BufferPool:
    """Fusion buffers kept between calls, per (dtype, device), as Horovod keeps its fusion buffer.

    A fresh CPU buffer costs a page fault per 4 KiB page on first touch: measured 37 ms to clone
    64 MiB on this 2-core machine against 7 ms to copy into memory already touched, which is more
    than half of gloo's 46 ms allreduce of the same bytes. A buffer is taken for one in-flight
    fused allreduce and given back once its results are unpacked, so concurrent operations never
    share one. At most ``per_key`` buffers are kept per (dtype, device) (the largest).
    """

    def __init__(self, per_key: int = 4) -> None:
        self.per_key = per_key
        self._free: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined)."""
        with self._lock:
            free = self._free.get((dtype, device), [])
            fits = [i for i, b in enumerate(free) if b.numel() >= numel]
            if fits:
                base = free.pop(min(fits, key=lambda i: free[i].numel()))
                return base[:numel]
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer from :meth:`take` (a view of a pooled one returns its whole base)."""
        base = buf._base if buf._base is not None else buf
        with self._lock:
            free = self._free.setdefault((base.dtype, base.device), [])
            free.append(base)
            free.sort(key=lambda b: b.numel(), reverse=True)
            del free[self.per_key :]

    def clear(self) -> None:
        """Drop every kept buffer."""
        with self._lock:
            self._free.clear()


def _apply_scale(buf: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if buf.is_floating_point():
        buf.mul_(factor)
    else:
        buf.copy_(torch.div(buf * factor, 1, rounding_mode="trunc"))


@dataclass
class FusedWork:
    """An in-flight fused allreduce: call :meth:`wait` once to get the results.

    Attributes:
        post: the factor the reduced buffers are multiplied by.
        divisor: then divided by (Average: the world size). Floating results are divided, not
            multiplied by ``1 / divisor``: the correctly rounded mean, as Horovod's (which scales
            in float64); ``x * float32(1/3)`` is off by one ulp for a third of the values.
        bytes_on_wire: bytes of the buffers reduced (in the wire dtype), per rank.
        pool: where the fusion buffers go back after unpacking (``None``: nowhere).
    """

    parts: list[tuple[Any, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]
    post: float
    finish: Callable[[], None] | None = None
    bytes_on_wire: int = 0
    done: bool = field(default=False)
    pool: BufferPool | None = None
    divisor: int = 1

    def _scale(self, t: torch.Tensor) -> None:
        if not t.is_floating_point():
            _apply_scale(t, self.post / self.divisor)
            return
        _apply_scale(t, self.post)
        if self.divisor != 1:
            t.div_(self.divisor)

    def _scale_into(self, view: torch.Tensor, out: torch.Tensor) -> None:
        if self.post != 1.0:
            torch.mul(view, self.post, out=out)
            if self.divisor != 1:
                out.div_(self.divisor)
        else:
            torch.div(view, self.divisor, out=out)

    def is_completed(self) -> bool:
        """Whether every collective of this work has finished (never blocks)."""
        return all(w is None or w.is_completed() for w, *_ in self.parts)

    def wait(self) -> None:
        """Block until reduced; then unpack (scaled and cast back) into the outputs."""
        if self.done:
            return
        for work, buf, sources, outputs in self.parts:
            if work is not None:
                work.wait()
            in_place = len(outputs) == 1 and outputs[0].data_ptr() == buf.data_ptr()
            scaled = self.post != 1.0 or self.divisor != 1
            fold = scaled and buf.is_floating_point() and not in_place
            if scaled and not fold:
                self._scale(buf)
            if in_place:
                continue
            offset = 0
            for out in outputs:
                n = out.numel()
                view = buf[offset : offset + n].view_as(out)
                if fold and out.dtype == buf.dtype:
                    self._scale_into(view, out)  # scale while unpacking: one pass
                else:
                    out.copy_(view)
                    if fold:
                        self._scale(out)
                offset += n
            del sources
            if not in_place and self.pool is not None:
                self.pool.give(buf)
        self.done = True
        if self.finish is not None:
            self.finish()


def pack(
    tensors: Sequence[torch.Tensor], wire_dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Flatten ``tensors`` into one 1-D buffer of ``wire_dtype`` (``out`` reused if given)."""
    total = sum(t.numel() for t in tensors)
    if out is None or out.numel() != total or out.dtype != wire_dtype:
        out = torch.empty(total, dtype=wire_dtype, device=tensors[0].device)
    if len(tensors) == 1:
        out.copy_(tensors[0].reshape(-1))
    else:
        torch.cat([t.reshape(-1) for t in tensors], out=out)
    return out


def launch_fused_allreduce(
    tensors: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    *,
    op: ReduceOp,
    world_size: int,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    compression: type[Compressor] = NoneCompressor,
    threshold_bytes: int = DEFAULT_FUSION_THRESHOLD,
    group: Any = None,
    pool: BufferPool | None = None,
) -> FusedWork:
    """Reduce ``tensors`` into ``outputs`` (same shapes; may be the same tensors), fused.

    The tensors are grouped, in order, into buffers of one wire dtype and device of at most
    ``threshold_bytes`` (:func:`plan_buckets`), each launched with ``async_op=True``. The result is
    ``postscale * op(prescale * x)`` (Average then divides by ``world_size``, Horovod's
    convention). The fusion buffers come from ``pool`` and go back to it after
    :meth:`FusedWork.wait` (the caller owns the pool: ``ringtrain.horovod``'s runtime keeps one
    per ``hvd.init()``); without one, each call allocates fresh buffers.

    Returns:
        A :class:`FusedWork`; the outputs hold the results after its ``wait()``.
    """
    divisor = world_size if op == ReduceOp.Average else 1
    # gloo and NCCL have no int16: such tensors travel as int32 (exact, wraps like int16 on cast)
    wire = [NO_INT16.get(w, w) for w in (compression.wire_dtype_for(t.dtype) for t in tensors)]
    keys = [(w, t.device) for w, t in zip(wire, tensors, strict=True)]
    sizes = [
        t.numel() * torch.empty((), dtype=w).element_size()
        for t, w in zip(tensors, wire, strict=False)
    ]
    parts = []
    total = 0
    for bucket in plan_buckets(sizes, keys, threshold_bytes):
        ins = [tensors[i] for i in bucket]
        outs = [outputs[i] for i in bucket]
        if (
            len(bucket) == 1
            and ins[0] is outs[0]
            and ins[0].is_contiguous()
            and ins[0].dtype == wire[bucket[0]]
        ):
            buf = ins[0].view(-1)  # in place: no fusion buffer, no copies
        else:
            numel = sum(t.numel() for t in ins)
            reuse = pool.take(numel, wire[bucket[0]], ins[0].device) if pool is not None else None
            buf = pack(ins, wire[bucket[0]], reuse)
        _apply_scale(buf, prescale_factor)
        total += buf.numel() * buf.element_size()
        work = None
        if world_size > 1:
            work = dist.all_reduce(buf, op=DIST_OPS[op], group=group, async_op=True)
        parts.append((work, buf, ins, outs))
    return FusedWork(parts, postscale_factor, bytes_on_wire=total, pool=pool, divisor=divisor)


# ------------------------------------------------------------------ gradients during backward


@dataclass
class _Bucket:
    indices: list[int]
    wire_dtype: torch.dtype
    pending: int = 0
    buffer: torch.Tensor | None = None


class GradientAllreducer:
    """Allreduce gradients as backward produces them, fused into buckets launched in order.

    A ``post_accumulate_grad`` hook on every parameter counts its gradient and, on its last
    pass, copies it into its slot of the bucket's persistent fusion buffer (cast for the wire),
    during backward as DDP's reducer does; when every gradient of a bucket has been accumulated
    ``backward_passes_per_step`` times, the bucket is ready, and every ready bucket is launched
    (scaled, ``all_reduce`` with ``async_op=True``) once all buckets before it are launched.
    :meth:`synchronize` launches what is left (parameters that got no gradient contribute zeros),
    waits, and writes the reduced gradients back into ``param.grad``.

    Args:
        named_parameters: ``(name, parameter)`` pairs, identical on every rank (names, order,
            dtypes, shapes); parameters without ``requires_grad`` are skipped.
        world_size: number of ranks in ``group``.
        op: Average (default) or Sum (Min/Max/Product are allowed, rarely useful for gradients).
        compression: wire format (:mod:`ringtrain.comm.compression`).
        threshold_bytes: bucket cap, bytes (default ``HOROVOD_FUSION_THRESHOLD`` or 128 MiB).
        first_bucket_bytes: the first bucket's cap, bytes (DDP's 1 MiB).
        backward_passes_per_step: backward passes accumulated locally before the allreduce.
        prescale_factor: gradients are multiplied by this before the reduction.
        postscale_factor: and by this after it (Average also divides by ``world_size``).
        group: the process group (default: the default group).

    Raises:
        ValueError: for duplicate names, or ``backward_passes_per_step < 1``.
        RuntimeError: on every rank, if ranks registered different parameters.
    """

    def __init__(
        self,
        named_parameters: Sequence[tuple[str, torch.nn.Parameter]],
        *,
        world_size: int,
        op: ReduceOp = ReduceOp.Average,
        compression: type[Compressor] = NoneCompressor,
        threshold_bytes: int | None = None,
        first_bucket_bytes: int | None = DEFAULT_FIRST_BUCKET_BYTES,
        backward_passes_per_step: int = 1,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        group: Any = None,
    ) -> None:
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}"
            )
        self.op = check_op(op)
        self.world_size = world_size
        self.compression = compression
        self.threshold_bytes = (
            fusion_threshold_from_env() if threshold_bytes is None else int(threshold_bytes)
        )
        self.backward_passes_per_step = backward_passes_per_step
        self.prescale_factor = prescale_factor
        self.postscale_factor = postscale_factor
        self.group = group
        seen: dict[int, str] = {}
        names: set[str] = set()
        params: list[tuple[str, torch.nn.Parameter]] = []
        for name, p in named_parameters:
            if name in names:
                raise ValueError(f"named_parameters: the name {name!r} appears twice")
            names.add(name)
            if not p.requires_grad or id(p) in seen:
                continue
            seen[id(p)] = name
            params.append((name, p))
        # Reverse registration order: the last layers' gradients are ready first (DDP's order).
        params.reverse()
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        check_same_layout(
            [(n, p.dtype, p.shape) for n, p in params],
            "DistributedOptimizer/GradientAllreducer",
            world_size,
            group,
        )
        wire = [compression.wire_dtype_for(p.dtype) for p in self.params]
        sizes = [
            p.numel() * torch.empty((), dtype=w).element_size()
            for p, w in zip(self.params, wire, strict=False)
        ]
        keys = [(w, p.device) for w, p in zip(wire, self.params, strict=False)]
        plan = plan_buckets(sizes, keys, self.threshold_bytes, first_bucket_bytes)
        self.buckets = [_Bucket(b, wire[b[0]]) for b in plan]
        self._bucket_of = [0] * len(self.params)
        self._offset = [0] * len(self.params)  # element offset of each gradient in its bucket
        for bi, bucket in enumerate(self.buckets):
            offset = 0
            for i in bucket.indices:
                self._bucket_of[i] = bi
                self._offset[i] = offset
                offset += self.params[i].numel()
            # The fusion buffer, kept and reused every step.
            first = self.params[bucket.indices[0]]
            bucket.buffer = torch.empty(offset, dtype=bucket.wire_dtype, device=first.device)
        self.bytes_on_wire = 0  # total bytes this rank put into reduced buffers
        self._post = (
            postscale_factor / world_size if self.op == ReduceOp.Average else postscale_factor
        )
        self._handles: list[Any] = []
        self._reset_step()
        for i, p in enumerate(self.params):
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    # -------------------------------------------------------------- step state
    def _reset_step(self) -> None:
        self._counts = [0] * len(self.params)
        self._copied = [False] * len(self.params)
        for b in self.buckets:
            b.pending = len(b.indices)
        self._ready = [False] * len(self.buckets)
        self._next = 0
        self._inflight: list[tuple[_Bucket, Any]] = []

    @property
    def pending(self) -> bool:
        """Whether gradients have been counted or launched since the last synchronize."""
        return any(self._counts) or bool(self._inflight)

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._grad_ready(index)

        return hook

    def _grad_ready(self, index: int) -> None:
        self._counts[index] += 1
        count = self._counts[index]
        if count > self.backward_passes_per_step:
            raise AssertionError(
                f"the gradient of {self.names[index]!r} was computed {count} times before "
                f"step()/synchronize() (backward_passes_per_step="
                f"{self.backward_passes_per_step}); raise backward_passes_per_step or call step()"
            )
        if count < self.backward_passes_per_step:
            return
        # Copy the gradient into its bucket now, while backward goes on (DDP's reducer does the
        # same): launching the bucket then needs no packing pass after its last gradient.
        self._copy_in(index)
        bi = self._bucket_of[index]
        bucket = self.buckets[bi]
        bucket.pending -= 1
        if bucket.pending == 0:
            self._ready[bi] = True
            self._launch_ready()

    def _launch_ready(self) -> None:
        # Strictly in bucket order: every rank issues the same collectives in the same order.
        while self._next < len(self.buckets) and self._ready[self._next]:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _copy_in(self, index: int) -> None:
        p = self.params[index]
        bucket = self.buckets[self._bucket_of[index]]
        assert bucket.buffer is not None
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        off = self._offset[index]
        # A sparse gradient (an Embedding(sparse=True)) travels dense, as Horovod's
        # sparse_as_dense=True: the same sum, in the bucket's one allreduce.
        grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
        bucket.buffer[off : off + p.numel()].copy_(grad.reshape(-1))  # casts for the wire
        self._copied[index] = True

    def _launch(self, bucket: _Bucket) -> None:
        for i in bucket.indices:
            if not self._copied[i]:  # no gradient this step, or launched by synchronize()
                self._copy_in(i)
        buf = bucket.buffer
        assert buf is not None
        _apply_scale(buf, self.prescale_factor)
        self.bytes_on_wire += buf.numel() * buf.element_size()
        work = None
        if self.world_size > 1:
            work = dist.all_reduce(buf, op=DIST_OPS[self.op], group=self.group, async_op=True)
        self._inflight.append((bucket, work))

    # -------------------------------------------------------------- public
    def synchronize(self) -> None:
        """Launch the buckets not launched yet (in order), wait for all, and write the reduced
        gradients into ``param.grad``; then start counting the next step."""
        for bi in range(len(self.buckets)):
            self._ready[bi] = True
        self._launch_ready()
        for bucket, work in self._inflight:
            if work is not None:
                work.wait()
            buf = bucket.buffer
            assert buf is not None
            # Scale while unpacking (one pass over the bucket, not two) when the types allow.
            fold = self._post != 1.0 and buf.is_floating_point()
            if not fold:
                _apply_scale(buf, self._post)
            offset = 0
            for i in bucket.indices:
                grad = self.params[i].grad
                assert grad is not None
                n = grad.numel()
                view = buf[offset : offset + n].view(grad.shape)
                if grad.is_sparse:  # back to a sparse gradient of the same layout
                    dense = (view * self._post if fold else view).to(grad.dtype)
                    self.params[i].grad = dense.to_sparse(grad.sparse_dim())
                elif fold and grad.dtype == buf.dtype:
                    torch.mul(view, self._post, out=grad)
                else:
                    grad.copy_(view)
                    if fold:
                        grad.mul_(self._post)
                offset += n
        self._reset_step()

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
