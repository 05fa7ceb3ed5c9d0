"""``hvd.DistributedOptimizer``: an optimizer whose gradients are averaged across ranks, by the
fused asynchronous allreduce of :class:`ringtrain.comm.fusion.GradientAllreducer`.

As in Horovod, the returned object is an instance of a subclass of the wrapped optimizer's class
(``isinstance(opt, torch.optim.SGD)`` stays true) that shares the wrapped optimizer's param
groups and state. ``loss.backward()`` launches the allreduce of each fusion bucket as soon as its
gradients are accumulated; ``step()`` calls :meth:`synchronize` (wait, write the averaged
gradients back) and then the wrapped optimizer's ``step``.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ringtrain.comm.compression import Compressor, NoneCompressor, resolve
from ringtrain.comm.fusion import GradientAllreducer, ReduceOp, check_op
from ringtrain.horovod.process_sets import ProcessSet, global_process_set
from ringtrain.horovod.runtime import negotiate, runtime


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin placed before the wrapped optimizer's class; see :func:`DistributedOptimizer`."""

    _hvd_engine: GradientAllreducer | None
    _hvd_should_synchronize: bool
    _hvd_synchronized: bool
    _parameter_names: dict[torch.Tensor, str]

    def synchronize(self) -> None:
        """Finish the allreduce of every gradient (launching those not launched yet) and write
        the averaged gradients into ``param.grad``. Call it before gradient clipping, then step
        inside ``with optimizer.skip_synchronize():``. On a rank outside the optimizer's process
        set, nothing is reduced (as Horovod)."""
        if self._hvd_engine is not None:
            self._hvd_engine.synchronize()
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this block, ``step()`` does not synchronize (it was done explicitly)."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() after "
                    "optimizer.synchronize(): the gradients are reduced twice. Call step() "
                    "inside `with optimizer.skip_synchronize():`",
                    stacklevel=2,
                )
            self.synchronize()
        self._hvd_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._hvd_engine is not None and self._hvd_engine.pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients being reduced would "
                "be lost. Call zero_grad() before backward() or after step()."
            )
        super().zero_grad(set_to_none)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Any = None,
    compression: type[Compressor] = NoneCompressor,
    backward_passes_per_step: int = 1,
    op: Any = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet | None = global_process_set,
    *,
    fusion_threshold_bytes: int | None = None,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over all ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; the wrapper shares its param groups and state.
        named_parameters: ``model.named_parameters()``: names that must match across ranks
            (default: ``param_group.idx`` names, identical when every rank builds the same
            optimizer).
        compression: ``Compression.none``, ``Compression.fp16`` or ``Compression.bf16``.
        backward_passes_per_step: backward passes whose gradients are summed locally before one
            allreduce (the loss scaling is yours, as in Horovod).
        op: ``Average`` (default) or ``Sum``. Adasum raises ``NotImplementedError``.
        gradient_predivide_factor: with Average, divide the gradients by this before the sum and
            by ``size() / factor`` after it (Horovod's overflow guard for fp16).
        groups: Horovod's explicit grouping; the fusion buckets replace it (ignored, with a
            warning, unless ``None``).
        sparse_as_dense: accepted either way: sparse gradients (``Embedding(sparse=True)``)
            are always reduced dense, in their bucket, and handed back to the optimizer sparse
            (Horovod's ``sparse_as_dense=True``; its default allgathers indices and values).
        process_set: the ranks whose gradients are averaged (default: all). On a rank outside
            the set the optimizer reduces nothing and steps on the local gradients (as
            Horovod).
        fusion_threshold_bytes: bucket cap in bytes (default: ``HOROVOD_FUSION_THRESHOLD``,
            else 128 MiB; 0 disables fusion).

    Returns:
        The distributed optimizer (an instance of a subclass of ``type(optimizer)``); its
        ``_parameter_names`` maps each parameter to its name, as Horovod's does.

    Raises:
        ValueError: for duplicate or missing parameter names, a bad ``gradient_predivide_factor``
            or ``backward_passes_per_step``, or a predivide factor with ``op != Average``.
        RuntimeError: on every rank, if the ranks' parameters differ (names, dtypes, shapes).
        NotImplementedError: for Adasum.
    """
    rt = runtime()
    rop = check_op(op)
    view = rt.set_view(process_set)
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if gradient_predivide_factor != 1.0 and rop != ReduceOp.Average:
        raise ValueError("gradient_predivide_factor is only supported with op=Average")
    if groups is not None:
        warnings.warn(
            "DistributedOptimizer(groups=...) is ignored: ringtrain fuses gradients into "
            "buckets of HOROVOD_FUSION_THRESHOLD bytes",
            stacklevel=2,
        )
    all_params = [p for group in optimizer.param_groups for p in group["params"]]
    if named_parameters is not None:
        named = list(named_parameters)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dups = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"named_parameters contains duplicate names: {dups}")
        known = {id(p) for _, p in named}
        missing = [i for i, p in enumerate(all_params) if id(p) not in known]
        if missing:
            raise ValueError(
                f"named_parameters lacks {len(missing)} parameter(s) of the optimizer (indices "
                f"{missing[:5]}); pass model.named_parameters() of the model being optimized"
            )
        in_opt = {id(p) for p in all_params}
        named = [(n, p) for n, p in named if id(p) in in_opt]
    else:
        named = [
            (f"allreduce.noname.{gi}.{pi}", p)
            for gi, group in enumerate(optimizer.param_groups)
            for pi, p in enumerate(group["params"])
        ]
    cls = type(
        optimizer.__class__.__name__,
        (_DistributedOptimizer, optimizer.__class__),
        {"__module__": optimizer.__class__.__module__},
    )
    dist_opt: Any = object.__new__(cls)
    dist_opt.__dict__ = optimizer.__dict__  # share param groups, state and hooks
    dist_opt._parameter_names = {p: n for n, p in sorted(named, key=lambda item: item[0])}
    dist_opt._hvd_should_synchronize = True
    dist_opt._hvd_synchronized = False
    dist_opt._hvd_engine = None
    if not view.included:
        return dist_opt  # Horovod: a rank outside the set steps on its own gradients
    # The same metadata exchange as every hvd call first, so that a rank constructing the
    # optimizer while a peer is in another hvd call raises on both instead of hanging; the
    # engine's own layout digest check follows.
    negotiate(
        "DistributedOptimizer",
        None,
        [p for _, p in named if p.requires_grad],
        extra=int(rop) + 16 * view.process_set_id,
        view=view,
        signature=repr([(n, str(p.dtype), tuple(p.shape)) for n, p in named if p.requires_grad]),
    )
    dist_opt._hvd_engine = GradientAllreducer(
        named,
        world_size=view.size,
        group=view.group,
        op=rop,
        compression=resolve(compression),
        threshold_bytes=fusion_threshold_bytes,
        backward_passes_per_step=backward_passes_per_step,
        prescale_factor=1.0 / gradient_predivide_factor,
        postscale_factor=gradient_predivide_factor,
    )
    return dist_opt
