"""``DiLoCoConfig``: low-communication training (``prepare_model(parallel_strategy="diloco")``),
validated when it is built. The method itself is :mod:`ringtrain.parallel.diloco`.

Sources of the defaults:

- **DiLoCo**: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
  Models", arXiv:2311.08105 (2023), Algorithm 1 and §3 (experimental setting): H = 500 inner
  steps, outer optimizer Nesterov momentum with learning rate 0.7 and momentum 0.9, inner
  optimizer AdamW.
- **Streaming DiLoCo**: Douillard et al., "Streaming DiLoCo with overlapping communication:
  Towards a Distributed Free Lunch", arXiv:2501.18512 (2025), §2: the model synchronised in
  fragments at staggered steps (§2.2), each exchange overlapped with ``tau`` inner steps and the
  arriving global fragment merged with the local one with a mixing factor ``alpha`` (§2.3), outer
  gradients exchanged in low precision (§2.4).

This module imports no torch (the config layer never does): the outer optimizer is a factory the
worker calls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringtrain.config.validation import check_int, short_errors

OUTER_DTYPES = ("fp32", "bf16", "fp16", "int8")
"""The values of ``DiLoCoConfig.outer_dtype``: how outer gradients travel. ``"fp32"``, ``"bf16"``
and ``"fp16"`` are all-reduced in that dtype (the backend must reduce it); ``"int8"`` is quantized
per tensor (symmetric, scale = max |x| / 127) and all-gathered as bytes with the float32 scales,
then dequantized and averaged in float32 in rank order on every replica."""

DEFAULT_SYNC_EVERY = 500
"""H, inner steps between outer steps: DiLoCo §3 (H = 500)."""
DEFAULT_OUTER_LR = 0.7
"""The outer Nesterov learning rate: DiLoCo §3 (0.7)."""
DEFAULT_OUTER_MOMENTUM = 0.9
"""The outer Nesterov momentum: DiLoCo §3 (0.9)."""
DEFAULT_MERGE_ALPHA = 0.5
"""Streaming DiLoCo's mixing factor with an overlapped exchange (§2.3): the weight of the local
parameters when the global fragment arrives ``sync_delay`` steps after it left."""


@short_errors
@dataclass(frozen=True)
class DiLoCoConfig:
    """How ``prepare_model(parallel_strategy="diloco")`` trains: each replica (a worker, or an
    island of ``dp_shard`` workers under ``ParallelConfig(dp_replicate=R, dp_shard=S)``) takes
    ``sync_every`` inner optimizer steps alone, then the replicas average their outer gradients
    (global parameters - local parameters) and an outer optimizer updates the global parameters,
    which every replica then continues from (DiLoCo, arXiv:2311.08105, Algorithm 1).

    Attributes:
        sync_every: H, inner steps between two outer steps of a fragment; >= 1. Default 500
            (DiLoCo §3). ``sync_every=1`` with ``outer_lr=1.0, outer_momentum=0.0`` is data
            parallelism (the mean of the replicas' parameters after one step each).
        outer_lr: the outer Nesterov SGD learning rate, > 0; default 0.7 (DiLoCo §3). Not with
            ``outer_optimizer``.
        outer_momentum: the outer Nesterov momentum, in [0, 1); default 0.9 (DiLoCo §3); 0
            gives plain SGD. Not with ``outer_optimizer``.
        outer_optimizer: any factory ``params -> torch.optim.Optimizer`` (e.g.
            ``functools.partial(torch.optim.SGD, lr=0.5, momentum=0.8, nesterov=True)``),
            called once on the global parameters (float32 tensors on the worker's device, a
            list); default ``None``: Nesterov SGD with ``outer_lr`` and ``outer_momentum``.
        fragments: F, streaming DiLoCo's fragments (arXiv:2501.18512 §2.2): the model's layers
            (the children of its largest ``ModuleList``/``Sequential`` that hold parameters) are
            dealt to F fragments in a strided pattern (layer i to fragment i mod F, the paper's
            choice), the other parameters to the lightest fragment; fragment p is exchanged at
            the steps ``t`` with ``t % sync_every == ((p + 1) * sync_every // F) % sync_every``,
            so the largest exchange is about 1/F of the model. Default 1 (plain DiLoCo). The
            number of layers must be a multiple of F (checked on the worker, naming this field).
        sync_delay: tau, inner steps an exchange overlaps (§2.3): the outer gradient of a
            fragment leaves at its sync step ``t`` and is applied at ``t + sync_delay``, the
            local fragment then becoming ``merge_alpha * local + (1 - merge_alpha) * global``.
            Default 0 (blocking exchange, as DiLoCo). Must be below ``sync_every // fragments``
            (one exchange in flight at a time).
        merge_alpha: the mixing factor of an overlapped exchange, in [0, 1]; default 0.5
            (Streaming DiLoCo §2.3) when ``sync_delay > 0``; must be 0 (``None``) without one
            (the local fragment is replaced, as in DiLoCo).
        outer_dtype: how outer gradients travel: one of :data:`OUTER_DTYPES`; default ``"fp32"``
            (DiLoCo). ``"bf16"``/``"fp16"``: half the bytes; ``"int8"``: a quarter, plus one
            float32 scale per tensor (Streaming DiLoCo §2.4 shows outer gradients survive even
            4 bits; INTELLECT-1 used int8). The outer step is always float32.
        preempt_at_sync: in a DiLoCo run the preemption agreement (one small all-reduce of every
            rank, ``ringtrain.worker.preempt``) runs only at the steps where some fragment
            exchanges, instead of at every ``TrainState.step``: no collective between syncs
            (what DiLoCo saves), at the price of a preemption notice stopping up to two sync
            intervals later (``2 * sync_every / fragments`` steps). Default True.

    Raises:
        TypeError: a field of the wrong type (naming it).
        ValueError: a value out of range, or ``outer_optimizer`` together with ``outer_lr`` /
            ``outer_momentum`` (naming the field and the fix).
    """

    sync_every: int = DEFAULT_SYNC_EVERY
    outer_lr: float | None = None
    outer_momentum: float | None = None
    outer_optimizer: Callable[..., Any] | None = None
    fragments: int = 1
    sync_delay: int = 0
    merge_alpha: float | None = None
    outer_dtype: str = "fp32"
    preempt_at_sync: bool = True

    def __post_init__(self) -> None:
        fix = "e.g. DiLoCoConfig(sync_every=50)"
        check_int("DiLoCoConfig", "sync_every", self.sync_every, 1, fix)
        check_int("DiLoCoConfig", "fragments", self.fragments, 1, "1 is plain DiLoCo")
        check_int("DiLoCoConfig", "sync_delay", self.sync_delay, 0, "0: a blocking exchange")
        if self.fragments > self.sync_every:
            raise ValueError(
                f"DiLoCoConfig.fragments={self.fragments} exceeds sync_every={self.sync_every}: "
                "each fragment needs its own sync step within the period (use fragments <= "
                "sync_every)"
            )
        spacing = self.sync_every // self.fragments
        if self.sync_delay >= spacing:
            raise ValueError(
                f"DiLoCoConfig.sync_delay={self.sync_delay} must be below sync_every // "
                f"fragments = {spacing} (one exchange in flight at a time; use sync_delay <= "
                f"{spacing - 1})"
            )
        self._check_outer()
        alpha = self.merge_alpha
        if alpha is not None:
            if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
                raise TypeError(f"DiLoCoConfig.merge_alpha must be a number, got {alpha!r}")
            if not 0.0 <= alpha <= 1.0:
                raise ValueError(f"DiLoCoConfig.merge_alpha must be in [0, 1], got {alpha}")
            if self.sync_delay == 0 and alpha != 0:
                raise ValueError(
                    f"DiLoCoConfig.merge_alpha={alpha} needs an overlapped exchange "
                    "(sync_delay >= 1); without one the local fragment is replaced"
                )
        if self.outer_dtype not in OUTER_DTYPES:
            raise ValueError(
                f"DiLoCoConfig.outer_dtype={self.outer_dtype!r} is not supported (use one of "
                f"{', '.join(repr(d) for d in OUTER_DTYPES)})"
            )
        if not isinstance(self.preempt_at_sync, bool):
            raise TypeError(
                f"DiLoCoConfig.preempt_at_sync must be True or False, got {self.preempt_at_sync!r}"
            )

    def _check_outer(self) -> None:
        if self.outer_optimizer is not None:
            if not callable(self.outer_optimizer):
                raise TypeError(
                    "DiLoCoConfig.outer_optimizer must be a factory params -> "
                    f"torch.optim.Optimizer, got {type(self.outer_optimizer).__name__}"
                )
            given = [n for n in ("outer_lr", "outer_momentum") if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"DiLoCoConfig: {' and '.join(given)} only configure the default Nesterov "
                    "outer optimizer; with outer_optimizer=... put them in its factory"
                )
        lr, momentum = self.outer_lr, self.outer_momentum
        for name, value in (("outer_lr", lr), ("outer_momentum", momentum)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float))
            ):
                raise TypeError(f"DiLoCoConfig.{name} must be a number, got {value!r}")
        if lr is not None and not lr > 0:
            raise ValueError(f"DiLoCoConfig.outer_lr must be > 0, got {lr} (DiLoCo uses 0.7)")
        if momentum is not None and not 0.0 <= momentum < 1.0:
            raise ValueError(
                f"DiLoCoConfig.outer_momentum must be in [0, 1), got {momentum} (DiLoCo uses "
                "0.9; 0 is plain SGD)"
            )

    @property
    def resolved_outer_lr(self) -> float:
        """``outer_lr``, or the default 0.7 (DiLoCo §3)."""
        return float(self.outer_lr) if self.outer_lr is not None else DEFAULT_OUTER_LR

    @property
    def resolved_outer_momentum(self) -> float:
        """``outer_momentum``, or the default 0.9 (DiLoCo §3)."""
        if self.outer_momentum is not None:
            return float(self.outer_momentum)
        return DEFAULT_OUTER_MOMENTUM

    @property
    def resolved_merge_alpha(self) -> float:
        """``merge_alpha``, or its default: 0.5 with ``sync_delay > 0`` (Streaming DiLoCo
        §2.3), else 0."""
        if self.merge_alpha is not None:
            return float(self.merge_alpha)
        return DEFAULT_MERGE_ALPHA if self.sync_delay > 0 else 0.0

    def offset(self, fragment: int) -> int:
        """The step residue (mod ``sync_every``) at which ``fragment`` leaves:
        ``((fragment + 1) * sync_every // fragments) % sync_every`` (fragment F-1 at the end of
        the period, as plain DiLoCo)."""
        return ((fragment + 1) * self.sync_every // self.fragments) % self.sync_every
