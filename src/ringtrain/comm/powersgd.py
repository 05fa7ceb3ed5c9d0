"""PowerSGD for DDP: options, the state that an exact resume needs, and the bytes on the wire.

``prepare_model(comm_hook="powersgd")`` uses torch's ``powerSGD_hook`` (Vogels et al., "PowerSGD:
Practical Low-Rank Gradient Compression for Distributed Optimization", NeurIPS 2019): after
``start_powerSGD_iter`` plain allreduce steps, each gradient matrix (n x m) is replaced by two
rank-r factors P (n x r) and Q (m x r) that are allreduced instead, with error feedback (the
compression residual is added to the next step's gradient) and warm start (Q is reused across
steps).

PowerSGD keeps state between steps (the per-rank error-feedback residuals, the P and Q memories,
the iteration count and the seed stream for Q): :class:`PowerSGDStateDict` exposes it as a
Stateful object, attached to the prepared model, which :class:`ringtrain.TrainState` saves in
each rank's file, so that an exact resume continues PowerSGD where it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

logger = logging.getLogger("ringtrain")

POWERSGD_DEFAULTS: dict[str, Any] = {
    "matrix_approximation_rank": 1,
    "start_powerSGD_iter": 1000,
    "min_compression_rate": 2.0,
    "use_error_feedback": True,
    "warm_start": True,
    "orthogonalization_epsilon": 0.0,
    "random_seed": 0,
}
"""``comm_hook_options`` accepted with ``comm_hook="powersgd"`` and their defaults (torch's
``PowerSGDState`` defaults)."""


def check_powersgd(options: Mapping[str, Any]) -> None:
    rank = options["matrix_approximation_rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(
            f"PowerSGD matrix_approximation_rank must be an integer >= 1, got {rank!r} "
            "(1 to 4 is usual)"
        )
    start = options["start_powerSGD_iter"]
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"PowerSGD start_powerSGD_iter must be an integer >= 0, got {start!r}")
    if (options["use_error_feedback"] or options["warm_start"]) and start <= 1:
        raise ValueError(
            f"PowerSGD start_powerSGD_iter={start} must be >= 2 with use_error_feedback or "
            "warm_start (DDP rebuilds its buckets after the first step)"
        )


def make_hook(
    comm_hook: str, options: Mapping[str, Any] | None
) -> tuple[Callable[[Any, Any], Any], Any]:
    """The torch hook and its state for ``comm_hook`` (default process group)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if comm_hook == "bf16":
        return default_hooks.bf16_compress_hook, None
    if comm_hook == "fp16":
        return default_hooks.fp16_compress_hook, None
    opts = {**POWERSGD_DEFAULTS, **(options or {})}
    state = powerSGD_hook.PowerSGDState(process_group=None, **opts)
    return powerSGD_hook.powerSGD_hook, state


# ---------------------------------------------------------------------------------- wire bytes


def _powersgd_elements(shapes: Iterable[torch.Size], rank: int, min_rate: float) -> int:
    """Elements allreduced per step by ``powerSGD_hook`` for gradients of these shapes: the
    tensors not worth compressing whole, plus P (n x r) and Q (m x r) for the others (torch's
    ``_should_compress`` rule)."""
    total = 0
    for shape in shapes:
        numel = 1
        for s in shape:
            numel *= int(s)
        if len(shape) == 0:
            total += 1
            continue
        n = int(shape[0])
        m = numel // n if n else 0
        r = min(n, m, rank)
        if (n + m) * r * min_rate < n * m:
            total += (n + m) * r
        else:
            total += numel
    return total


def wire_bytes(
    comm_hook: str | None,
    shapes: Iterable[torch.Size],
    dtype: torch.dtype = torch.float32,
    *,
    powersgd_rank: int = 1,
    min_compression_rate: float = 2.0,
    warm_up: bool = False,
) -> int:
    """Bytes one rank contributes to allreduce per step for gradients of ``shapes``.

    ``None``: the gradients in ``dtype``; ``"bf16"``/``"fp16"``: 2 bytes per element;
    ``"powersgd"``: with ``warm_up`` (the first ``start_powerSGD_iter`` steps) the full
    gradients, after it the rank-``powersgd_rank`` P and Q factors plus the tensors not worth
    compressing (torch's ``min_compression_rate`` rule). A ring allreduce moves about
    ``2 (W-1)/W`` times this per rank.
    """
    shapes = list(shapes)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    if comm_hook is None:
        return numel * itemsize
    if comm_hook in ("bf16", "fp16"):
        return numel * 2
    if warm_up:
        return numel * itemsize
    return _powersgd_elements(shapes, powersgd_rank, min_compression_rate) * itemsize


def hook_wire_bytes(
    comm_hook: str, shapes: Iterable[torch.Size], dtype: torch.dtype, state: Any
) -> int:
    if comm_hook != "powersgd" or state is None:
        return wire_bytes(comm_hook, shapes, dtype)
    return wire_bytes(
        comm_hook,
        shapes,
        dtype,
        powersgd_rank=state.matrix_approximation_rank,
        min_compression_rate=state.min_compression_rate,
        warm_up=state.iter < state.start_powerSGD_iter,
    )


# ---------------------------------------------------------------------------------- PowerSGD state


F = TypeVar("F", bound=Callable[..., Any])


def as_comm_hook(hook: F) -> F:
    """``hook`` (a DDP communication hook) with its annotations cleared: DDP's
    ``register_comm_hook`` compares them with the objects ``dist.GradBucket`` and
    ``Future[Tensor]``, and in a module with ``from __future__ import annotations`` they are
    strings, which it would refuse. The annotations still type-check the source."""
    hook.__annotations__ = {}
    return hook


def overflow_guarded(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """``powerSGD_hook`` for fp16 loss scaling: when a bucket's gradients overflowed (the
    GradScaler will skip this step), forget the bucket's error-feedback residual and its P/Q
    memories, which would otherwise hold inf/NaN and poison every later step. The bucket's next
    compression starts afresh (zero residual, new random Q), as on its first step. Costs one
    ``isfinite`` pass and one device-to-host sync per bucket per step."""

    @as_comm_hook
    def guarded(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index = bucket.index()

        def check(f: torch.futures.Future[Any]) -> torch.Tensor:
            result = f.value()
            tensor = result[0] if isinstance(result, list) else result
            if not bool(torch.isfinite(tensor).all()):
                for memory in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                    memory.pop(index, None)
            return tensor

        return hook(state, bucket).then(check)

    return guarded


class PowerSGDStateDict:
    """The resumable part of a ``PowerSGDState`` as a Stateful object (this rank's).

    ``state_dict()`` holds ``iter`` (steps seen), the seed stream (NumPy ``RandomState``, as
    tensors), and the per-bucket ``error`` residuals and ``p``/``q`` memories. The residuals
    differ across ranks, so TrainState saves it in each rank's file. After a restore, PowerSGD
    continues where it stopped (no second warm-up), bit-exactly with :class:`FixedOrderDDP`
    (the default), whose buckets are the same from the first step on; with
    ``bucket_order="rebuild"`` only when torch's initial layout equals its rebuilt one.
    """

    def __init__(self, state: Any) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        s = self.state
        name, key, pos, has_gauss, gauss = s.rng.get_state()
        return {
            "iter": int(s.iter),
            "rng": {
                "name": str(name),
                "key": torch.from_numpy(key.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            },
            "error": {int(k): v for k, v in s.error_dict.items()},
            "p": {int(k): v for k, v in s.p_memory_dict.items()},
            "q": {int(k): v for k, v in s.q_memory_dict.items()},
            "numel_before": int(s.total_numel_before_compression),
            "numel_after": int(s.total_numel_after_compression),
            "next_stats_report": int(s.next_stats_report),
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        import numpy as np

        s = self.state
        s.iter = int(sd["iter"])
        rng = sd["rng"]
        s.rng.set_state(
            (
                rng["name"],
                rng["key"].numpy().astype(np.uint32),
                int(rng["pos"]),
                int(rng["has_gauss"]),
                float(rng["gauss"]),
            )
        )
        for attr, key in (("error_dict", "error"), ("p_memory_dict", "p"), ("q_memory_dict", "q")):
            getattr(s, attr).clear()
            getattr(s, attr).update({int(k): v.clone() for k, v in sd[key].items()})
        s.total_numel_before_compression = int(sd["numel_before"])
        s.total_numel_after_compression = int(sd["numel_after"])
        s.next_stats_report = int(sd["next_stats_report"])


def single_bucket_mb(model: torch.nn.Module, requested: float | None) -> float:
    """``bucket_cap_mb`` that puts every gradient of ``model`` in one DDP bucket (an explicit cap
    also caps DDP's first bucket, so there is one bucket from the first step on).

    Why, for PowerSGD on gloo: ``powerSGD_hook`` issues a bucket's second allreduce (of Q) from
    the completion callback of its first (of P), on gloo's thread, while the autograd thread
    issues the next bucket's allreduce. With two or more buckets the two ranks can issue these
    collectives in different orders, and gloo aborts ("Received data size doesn't match expected
    size") or hangs: measured with torch 2.13 on a 10M-parameter MLP at W=2 (two 25 MB buckets),
    in plain torch as well. One bucket leaves a single collective chain per step.
    """
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    needed = grad_bytes / 2**20 + 1.0
    if requested is not None and requested < needed:
        logger.warning(
            "prepare_model(comm_hook='powersgd'): bucket_cap_mb=%s raised to %.0f so that all "
            "gradients form one DDP bucket (torch's PowerSGD hook can issue collectives in a "
            "different order on each rank with several buckets on gloo)",
            requested,
            needed,
        )
    return max(needed, requested or 0.0)
