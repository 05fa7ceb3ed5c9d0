"""Wrapping a module in ``DistributedDataParallel``: communication hooks, buckets, step timing.

``prepare_model(comm_hook=...)`` lands here. The hooks are torch's own
(``torch.distributed.algorithms.ddp_comm_hooks``):

- ``"bf16"`` / ``"fp16"``: ``bf16_compress_hook`` / ``fp16_compress_hook`` cast each bucket to
  16 bits, allreduce it (half the bytes on the wire), divide by the world size and cast back.
- ``"powersgd"``: ``powerSGD_hook``, low-rank compression with error feedback
  (:mod:`ringtrain.comm.powersgd`: its options, its resumable state, its bytes on the wire).

Bucket order (``prepare_model(bucket_order=...)``, docs/comm.md "Bit-exact resume at any world
size"): by default the model is wrapped in :class:`FixedOrderDDP`, whose gradient buckets are laid
out once, at construction, in reverse registration order with DDP's own caps, and never rebuilt.
Plain DDP reduces its first step in one bucket in registration order and then rebuilds its
buckets in the first backward's gradient-ready order; an element's position in its bucket decides
the summation order of gloo's ring allreduce at 3 or more ranks, so a DDP built by a restarted
worker would reduce its first step in another order than the long-lived one did (ULP-level
differences that then grow). ``bucket_order="rebuild"`` keeps torch's behaviour.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.cluster.env import DistributedContext
from ringtrain.comm.powersgd import (
    POWERSGD_DEFAULTS,
    PowerSGDStateDict,
    as_comm_hook,
    check_powersgd,
    hook_wire_bytes,
    make_hook,
    overflow_guarded,
    single_bucket_mb,
    wire_bytes,
)
from ringtrain.worker.hooks import SYNC_TOKEN_ATTR, CommObserver

logger = logging.getLogger("ringtrain")

COMM_HOOKS = ("bf16", "fp16", "powersgd")
"""The values of ``prepare_model(comm_hook=...)`` besides ``None`` (DDP's own allreduce)."""

DDP_OPTIONS = ("bucket_cap_mb", "static_graph", "find_unused_parameters")
"""``prepare_model``'s own DDP options, which are also ``DistributedDataParallel`` arguments."""

BUCKET_ORDERS = ("fixed", "rebuild")
"""The values of ``prepare_model(bucket_order=...)``: ``"fixed"`` (default,
:class:`FixedOrderDDP`: one layout from construction on, the same in every process that builds
the model, so a resumed run reduces exactly as the uninterrupted one) or ``"rebuild"`` (torch's
DDP: one bucket in registration order for the first step, then rebuilt in the first backward's
gradient-ready order)."""


def validate_comm_options(
    comm_hook: str | None,
    comm_hook_options: Mapping[str, Any] | None,
    ddp_options: Mapping[str, Any],
    ddp_kwargs: Mapping[str, Any] | None,
    where: str = "prepare_model",
) -> dict[str, Any]:
    """Check ``prepare_model``'s communication arguments and merge them into DDP's kwargs.

    Args:
        comm_hook: ``None`` or one of :data:`COMM_HOOKS`.
        comm_hook_options: options of the hook (only ``"powersgd"`` has any, see
            :data:`POWERSGD_DEFAULTS`).
        ddp_options: ``bucket_cap_mb`` (MB, > 0), ``static_graph``, ``find_unused_parameters``
            (bools); ``None`` values are left to DDP's defaults.
        ddp_kwargs: the caller's extra ``DistributedDataParallel`` arguments.
        where: how errors name the caller (``"prepare_model"``, ``"DDPStrategy"``).

    Returns:
        The keyword arguments for ``DistributedDataParallel``.

    Raises:
        ValueError: for an unknown hook or option, an option of the wrong type or range, or an
            option given both directly and in ``ddp_kwargs`` with different values.
    """
    if comm_hook is not None and comm_hook not in COMM_HOOKS:
        raise ValueError(
            f"{where}(comm_hook={comm_hook!r}) is not supported (use None for DDP's "
            f"allreduce, or one of {', '.join(repr(h) for h in COMM_HOOKS)})"
        )
    if comm_hook_options:
        if comm_hook != "powersgd":
            raise ValueError(
                f"{where}(comm_hook_options=...) only applies to comm_hook='powersgd', "
                f"got comm_hook={comm_hook!r} (drop comm_hook_options)"
            )
        unknown = sorted(set(comm_hook_options) - set(POWERSGD_DEFAULTS))
        if unknown:
            raise ValueError(
                f"{where}(comm_hook_options=...): unknown PowerSGD option(s) {unknown} "
                f"(accepted: {', '.join(POWERSGD_DEFAULTS)})"
            )
        check_powersgd({**POWERSGD_DEFAULTS, **comm_hook_options})
    merged = dict(ddp_kwargs or {})
    for name in DDP_OPTIONS:
        value = ddp_options.get(name)
        if value is None:
            continue
        if name == "bucket_cap_mb":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(
                    f"{where}(bucket_cap_mb={value!r}) must be a number of megabytes > 0 "
                    "(DDP's default is 25)"
                )
        elif not isinstance(value, bool):
            raise ValueError(f"{where}({name}={value!r}) must be True or False")
        if name in merged and merged[name] != value:
            raise ValueError(
                f"{where}({name}={value!r}) contradicts ddp_kwargs[{name!r}]="
                f"{merged[name]!r} (give it once)"
            )
        merged[name] = value
    if "bucket_order" in merged:
        raise ValueError(
            f"{where}(ddp_kwargs={{'bucket_order': ...}}): bucket_order is ringtrain's, not a "
            f"DistributedDataParallel argument; pass {where}(bucket_order=...)"
        )
    if "device_ids" in merged:
        raise ValueError(
            f"{where}(ddp_kwargs={{'device_ids': ...}}): ringtrain sets device_ids from the "
            "worker's local rank; drop it"
        )
    return merged


def check_bucket_order(bucket_order: str, where: str = "prepare_model") -> None:
    """Raise ``ValueError`` unless ``bucket_order`` is one of :data:`BUCKET_ORDERS` (the error
    names ``where``)."""
    if bucket_order not in BUCKET_ORDERS:
        raise ValueError(
            f"{where}(bucket_order={bucket_order!r}) is not supported (use 'fixed', the "
            "default, for bit-exact resume at any world size, or 'rebuild' for torch's "
            "gradient-ready-order rebuild after the first step)"
        )


def _timed_hook(
    timer: CommObserver, hook: Callable[[Any, Any], Any], comm_hook: str
) -> Callable[[Any, Any], Any]:
    """``hook``, timed per bucket from launch to completion like
    :func:`timed_comm_hook`, but reporting the bytes the hook puts on
    the wire (compressed), not the bucket's fp32 size."""

    @as_comm_hook
    def timed(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        shapes = [g.shape for g in bucket.gradients()]
        nbytes = hook_wire_bytes(comm_hook, shapes, bucket.buffer().dtype, state)
        started = time.perf_counter()
        fut = hook(state, bucket)

        def done(f: torch.futures.Future[Any]) -> torch.Tensor:
            timer.comm_done(started, nbytes)
            return f.value()

        return fut.then(done)

    return timed


def timed_comm_hook(
    timer: CommObserver, hook: Callable[[Any, Any], Any]
) -> Callable[[Any, Any], Any]:
    """Wrap a DDP communication hook ``hook(state, bucket) -> Future[Tensor]`` so that each
    bucket's communication, from launch to completion, and its size in bytes reach ``timer`` (a
    :class:`~ringtrain.worker.hooks.CommObserver`: the step timer)."""

    # No annotations (hence the type: ignores): DDP checks them against dist.GradBucket and
    # Future, and with ``from __future__ import annotations`` they would be strings.
    def timed(state, bucket):  # type: ignore[no-untyped-def, unused-ignore]
        buf = bucket.buffer()
        nbytes = buf.numel() * buf.element_size()
        started = time.perf_counter()
        fut = hook(state, bucket)

        def done(f: Any) -> Any:
            timer.comm_done(started, nbytes)
            return f.value()

        return fut.then(done)

    return timed


def timed_allreduce_hook(timer: CommObserver) -> Callable[[Any, Any], Any]:
    """DDP's default averaging allreduce (as ``torch.distributed.algorithms.ddp_comm_hooks.
    default_hooks.allreduce_hook``: divide by the world size, then sum), timed, with a single
    completion callback per bucket (wrapping torch's hook with :func:`timed_comm_hook` would run
    two)."""

    def timed(process_group, bucket):  # type: ignore[no-untyped-def, unused-ignore]
        group = process_group if process_group is not None else dist.group.WORLD
        buf = bucket.buffer()
        nbytes = buf.numel() * buf.element_size()
        started = time.perf_counter()
        buf.div_(dist.get_world_size(group))
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

        def done(f):  # type: ignore[no-untyped-def, unused-ignore]
            timer.comm_done(started, nbytes)
            return f.value()[0]

        return fut.then(done)

    return timed


# ---------------------------------------------------------------------------------- wrapping


class FixedOrderDDP(torch.nn.parallel.DistributedDataParallel):
    """``DistributedDataParallel`` whose gradient bucket layout is fixed at construction.

    The layout is the one torch's DDP rebuilds after its first step when gradients become ready
    in reverse registration order (the usual case: the last layer's gradients come first):
    parameters in reverse registration order, a first bucket of at most 1 MiB (or
    ``bucket_cap_mb`` when given) and then buckets of at most ``bucket_cap_mb`` (25 MiB), one
    dtype and device per bucket; ``bucket_cap_mb_list`` is honoured. It is built in the
    constructor (the reducer's own rebuild, fed every parameter in that order, then marked
    done, so it never rebuilds again) and is a function of the model alone: every process that
    wraps the same model, a long-lived one or one restarted from a checkpoint, reduces every
    step with the same buckets, hence in the same summation order on every backend (gloo's ring
    allreduce sums an element in an order set by its position in the bucket at 3+ ranks; NCCL's
    ring and tree orders are set by the buffer size and offset too).

    Cost against plain DDP: none per step (one broadcast of the bucket indices from rank 0 at
    construction, which DDP's own rebuild does after the first step). A model whose gradients
    become ready in a very different order than reverse registration order overlaps less of its
    communication with backward than torch's rebuilt layout would; use
    ``prepare_model(bucket_order="rebuild")`` for it (and lose bit-exact resume at 3+ ranks).

    Not applied (a plain DDP is built, whose layout is fixed already) with
    ``find_unused_parameters=True`` and no ``static_graph``: torch's reducer never rebuilds
    its buckets then. Relies on torch 2.13's private ``_build_params_for_reducer``,
    ``reducer._push_all_rebuilt_params`` and ``reducer._rebuild_buckets`` (tested in
    tests/test_exact_resume.py, which fails if torch changes them).
    """

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        super().__init__(module, *args, **kwargs)
        self._fix_bucket_layout()

    def _build_params_for_reducer(self) -> Any:
        # The reducer's parameter index order: reversed, so that the rebuild below (which takes
        # the parameters in index order, as if their gradients became ready in that order)
        # puts the last layers in the first bucket, launched first during backward.
        parameters, expect_sparse_gradient = super()._build_params_for_reducer()
        return parameters[::-1], expect_sparse_gradient[::-1]

    def _fix_bucket_layout(self) -> None:
        reducer = getattr(self, "reducer", None)
        if reducer is None or getattr(self, "_use_python_reducer", False):
            return  # every parameter's allreduce is delayed, or compiled autograd's reducer
        reducer._push_all_rebuilt_params()
        if reducer._rebuild_buckets():  # a broadcast of rank 0's indices: every rank is here
            self._has_rebuilt_buckets = True

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._fix_bucket_layout()


def sync_unless_restored(ddp: torch.nn.Module, generation: int) -> None:
    """Stand in for the initial broadcast of a DDP built with ``init_sync=False`` on re-entering
    the train function after an elastic resize (a ``before_wrap`` hook set
    :attr:`ringtrain.worker.hooks.ModelSetup.sync_token` to ``generation``). At the first forward,
    the ranks agree (one allreduce MIN of a flag) on whether every one of them loaded that state
    into the module (its :data:`ringtrain.worker.hooks.SYNC_TOKEN_ATTR` equals ``generation``): then
    the parameters already agree and only the buffers are broadcast from rank 0 (they may differ per
    rank under ``broadcast_buffers=False``, as after a restart from disk they would not);
    otherwise every parameter and buffer is, as DDP's constructor would have done.
    """
    import torch.distributed as dist

    module: Any = ddp.module
    device = next(iter(module.parameters()), torch.empty(0)).device
    handle: Any = None

    def first_forward(_ddp: Any, _args: Any) -> None:
        handle.remove()
        restored = module.__dict__.get(SYNC_TOKEN_ATTR) == generation
        flag = torch.tensor([int(restored)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        tensors = list(module.buffers())
        if not bool(flag.item()):
            logger.info(
                "elastic: the model was not restored from the snapshot on every rank; "
                "broadcasting rank 0's parameters as DDP does on construction"
            )
            tensors = list(module.parameters()) + tensors
        with torch.no_grad():
            for tensor in tensors:
                dist.broadcast(tensor, src=0)

    handle = ddp.register_forward_pre_hook(first_forward)


def wrap_ddp(
    model: torch.nn.Module,
    ctx: DistributedContext,
    timer: CommObserver | None,
    *,
    ddp_kwargs: Mapping[str, Any] | None = None,
    comm_hook: str | None = None,
    comm_hook_options: Mapping[str, Any] | None = None,
    loss_scaling: bool = False,
    defer_sync_generation: int | None = None,
    bucket_order: str = "fixed",
) -> torch.nn.Module:
    """Wrap ``model`` (already on ``ctx.device``) in DDP; the process group must be initialised.

    Args:
        model: the module to wrap.
        ctx: this worker's context (``cuda:{local_rank}`` becomes DDP's ``device_ids`` on GPU).
        timer: who times the gradient allreduce (the step timer, offered by the timing plug-in
            in ``ModelSetup.comm_observer``), or None when timing is off.
        ddp_kwargs: ``DistributedDataParallel`` arguments, already validated by
            :func:`validate_comm_options`.
        comm_hook: ``None`` (DDP's built-in allreduce) or one of :data:`COMM_HOOKS`.
        comm_hook_options: PowerSGD options (see :data:`POWERSGD_DEFAULTS`).
        loss_scaling: the loop uses fp16 loss scaling (``precision="16-mixed"``): PowerSGD is
            then :func:`overflow_guarded`.
        defer_sync_generation: the ``sync_token`` of a ``before_wrap`` hook (re-entering after
            an elastic resize with this generation's snapshot): skip DDP's initial broadcast and
            check at the first forward instead (:func:`sync_unless_restored`). Ignored when
            ``ddp_kwargs`` sets ``init_sync`` or this torch's DDP has no ``init_sync``.
        bucket_order: ``"fixed"`` (:class:`FixedOrderDDP`) or ``"rebuild"`` (torch's DDP); see
            :data:`BUCKET_ORDERS`.

    Step timing: without a hook, ``comm_timing="hook"`` (``"auto"`` on CUDA) registers a timed
    allreduce hook, and ``"wait"`` (``"auto"`` on CPU) measures the step's wait for DDP's built-in
    allreduce. With a compression hook a Python hook runs anyway, so ``"auto"`` times it per
    bucket on every device (one completion callback per bucket, nothing else) and reports the
    compressed bytes; ``"wait"`` leaves the hook untimed and counts the gap between the last
    gradient and ``optimizer.step()`` as communication, with the steady-state compressed bytes.
    """
    from ringtrain.worker.state import attach_rank_state

    device = ctx.device
    device_ids = [device.index] if device.type == "cuda" else None
    module = model
    kwargs = dict(ddp_kwargs or {})
    if comm_hook == "powersgd" and device.type != "cuda":
        kwargs["bucket_cap_mb"] = single_bucket_mb(model, kwargs.get("bucket_cap_mb"))
    defer = (
        defer_sync_generation is not None
        and "init_sync" not in kwargs
        and "init_sync" in inspect.signature(torch.nn.parallel.DistributedDataParallel).parameters
    )
    if defer:
        kwargs["init_sync"] = False
    ddp_class = torch.nn.parallel.DistributedDataParallel
    rebuilds = kwargs.get("static_graph", False) or not kwargs.get("find_unused_parameters", False)
    if bucket_order == "fixed" and rebuilds:
        ddp_class = FixedOrderDDP
    ddp = ddp_class(model, device_ids=device_ids, **kwargs)
    if defer:
        assert defer_sync_generation is not None
        sync_unless_restored(ddp, defer_sync_generation)
    grads = [p for p in module.parameters() if p.requires_grad]
    if comm_hook is not None:
        hook, state = make_hook(comm_hook, comm_hook_options)
        if comm_hook == "powersgd" and loss_scaling:
            hook = overflow_guarded(hook)
        mode = timer.comm_timing if timer is not None else None
        if timer is not None and mode in ("hook", "auto"):
            ddp.register_comm_hook(state, _timed_hook(timer, hook, comm_hook))
        else:
            ddp.register_comm_hook(state, hook)
            if timer is not None:
                # After PowerSGD's warm-up (steady state).
                timer.wait_comm_bytes = wire_bytes(
                    comm_hook,
                    [p.shape for p in grads],
                    grads[0].dtype,
                    powersgd_rank=getattr(state, "matrix_approximation_rank", 1),
                    min_compression_rate=getattr(state, "min_compression_rate", 2.0),
                )
        if state is not None:
            attach_rank_state(ddp, "powersgd", PowerSGDStateDict(state))
    elif timer is not None:
        mode = timer.comm_timing
        if mode == "hook" or (mode == "auto" and device.type == "cuda"):
            # DDP's averaging allreduce, timed per bucket (launch to completion).
            ddp.register_comm_hook(None, timed_allreduce_hook(timer))
        else:
            # DDP's built-in allreduce (it averages while bucketing: no extra pass); the
            # step's wait for it after the last gradient is the exposed communication.
            timer.wait_comm_bytes = sum(p.numel() * p.element_size() for p in grads)
    return ddp
