"""How the optimisation follows the world size of an elastic run (``elastic_batch_policy``).

The loader's ``batch_size`` ``b`` is the per-worker batch at ``max`` workers, so the global batch
at ``max`` is ``G = b * max``. When the run continues at ``W`` workers, the policy
(:attr:`ringtrain.ScalingConfig.elastic_batch_policy`) decides:

- ``"resize_batch"`` (default): ``G`` is kept; each worker's loader yields ``G / W`` samples per
  step. The per-worker batch (and its activation memory) grows as workers are lost.
- ``"accumulate"``: ``G`` is kept and the loader is the same as under ``"resize_batch"``, but
  :meth:`ringtrain.prepare.PreparedDataLoader.micro_batches` splits each worker's step batch into
  ``ceil((G / W) / b)`` micro-batches of at most ``b`` samples, run forward and backward one after
  the other with DDP's allreduce only on the last (:func:`ringtrain.accumulate`): the memory
  of a worker at ``max``, the gradient of the whole step batch. This is DeepSpeed's decomposition
  ``train_batch_size = micro_batch * gradient_accumulation_steps * world_size`` (DeepSpeed
  configuration JSON, "Batch Size Related Parameters"); unlike DeepSpeed's engine, which counts
  micro-steps itself, the loader here still yields one batch per optimizer step, so snapshots,
  the data position and the exactly-once re-partitioning of the epoch are those of
  ``"resize_batch"``, and an epoch's short last batch is weighted exactly.
- ``"scale_lr"``: the per-worker batch ``b`` is kept (the global batch becomes ``b * W``) and the
  learning rate used by every optimizer step is multiplied by ``W / max``: the linear scaling
  rule of Goyal et al. 2017, "Accurate, Large Minibatch SGD" (the rule Horovod's examples apply,
  ``lr * hvd.size()``, in their elastic ``on_state_reset`` callback). The scaling is applied around
  each ``optimizer.step()`` only (a global step pre-hook multiplies every param group's ``lr``,
  the post-hook puts the exact original values back): ``param_groups[i]["lr"]``, LR schedulers,
  snapshots and checkpoints always hold the learning rate at ``max`` workers, so the scaling never
  compounds over resizes, survives any restore, and composes with any schedule.

The global batch must divide by the world size under the first two policies (as DeepSpeed's
elasticity requires ``train_batch_size`` to divide over every valid GPU count, which
``deepspeed.elasticity.compute_elastic_config`` chooses): :func:`plan_batch` raises a
``ValueError`` naming the batch sizes that work and the ``"scale_lr"`` alternative.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.data import DataLoader

from ringtrain.cluster.env import DistributedContext
from ringtrain.config import ELASTIC_BATCH_POLICIES

# Splitting a step's batch is not elastic's own: it lives with gradient accumulation (the names
# are re-exported here, where they were).
from ringtrain.worker.accumulate import batch_length, micro_batches, split_batch
from ringtrain.worker.session import installed_session

__all__ = [
    "BatchPlan",
    "batch_length",
    "compatible_batch_sizes",
    "constant_global_batch",
    "current_lr_scale",
    "install_lr_scaling",
    "lr_scale_of",
    "micro_batches",
    "plan_batch",
    "plan_for_loader",
    "policy_of",
    "split_batch",
]

logger = logging.getLogger("ringtrain")

DEFAULT_POLICY = "resize_batch"


@dataclass(frozen=True)
class BatchPlan:
    """What one optimizer step is made of at world size ``world_size``.

    Attributes:
        policy: the ``elastic_batch_policy``.
        world_size: the world size ``W`` the plan is for.
        max_workers: ``max`` of ``num_workers=(min, max)``.
        batch_size: the loader's ``batch_size`` ``b``: the per-worker batch at ``max`` (samples).
        per_worker_batch: samples each worker trains on per optimizer step.
        accumulation_steps: micro-batches per optimizer step and worker (1: no splitting).
        micro_batch_size: the largest micro-batch (samples); ``<= batch_size`` unless the policy
            is ``"resize_batch"``.
        lr_scale: the factor applied to the learning rate of each optimizer step.
    """

    policy: str
    world_size: int
    max_workers: int
    batch_size: int
    per_worker_batch: int
    accumulation_steps: int
    micro_batch_size: int
    lr_scale: float

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all workers."""
        return self.per_worker_batch * self.world_size


def compatible_batch_sizes(min_workers: int, max_workers: int, count: int = 3) -> list[int]:
    """The smallest ``count`` per-worker batch sizes ``b`` (at ``max`` workers) whose global batch
    ``b * max`` divides by every world size in ``[min_workers, max_workers]``: the multiples of
    ``lcm(min..max) / gcd(lcm(min..max), max)``."""
    lcm = math.lcm(*range(min_workers, max_workers + 1))
    unit = lcm // math.gcd(lcm, max_workers)
    return [unit * k for k in range(1, count + 1)]


def plan_batch(
    policy: str, batch_size: int, world_size: int, min_workers: int, max_workers: int
) -> BatchPlan:
    """The plan of ``policy`` at ``world_size`` workers for a loader ``batch_size`` (pure).

    Args:
        policy: one of ``"resize_batch"``, ``"accumulate"``, ``"scale_lr"``.
        batch_size: the per-worker batch at ``max_workers`` (samples, >= 1).
        world_size: the current world size, in ``[1, max_workers]``.
        min_workers: ``min`` of the elastic range (for the error message).
        max_workers: ``max`` of the elastic range.

    Returns:
        The :class:`BatchPlan`.

    Raises:
        ValueError: an unknown policy, a non-positive size, or (``"resize_batch"``,
            ``"accumulate"``) a global batch that does not divide by ``world_size``; the message
            names the batch sizes every world size divides and the ``"scale_lr"`` policy.
    """
    if policy not in ELASTIC_BATCH_POLICIES:
        raise ValueError(
            f"elastic_batch_policy must be one of {', '.join(map(repr, ELASTIC_BATCH_POLICIES))}, "
            f"got {policy!r}"
        )
    if batch_size < 1 or not 1 <= world_size <= max_workers:
        raise ValueError(
            f"plan_batch: need batch_size >= 1 and 1 <= world_size <= max_workers, got "
            f"batch_size={batch_size}, world_size={world_size}, max_workers={max_workers}"
        )
    if policy == "scale_lr":
        return BatchPlan(
            policy=policy,
            world_size=world_size,
            max_workers=max_workers,
            batch_size=batch_size,
            per_worker_batch=batch_size,
            accumulation_steps=1,
            micro_batch_size=batch_size,
            lr_scale=world_size / max_workers,
        )
    global_batch = batch_size * max_workers
    if global_batch % world_size:
        sizes = compatible_batch_sizes(min_workers, max_workers)
        raise ValueError(
            f"elastic run at {world_size} workers: the global batch {global_batch} "
            f"(batch_size={batch_size} x max {max_workers} workers) does not divide by "
            f"{world_size} (elastic_batch_policy={policy!r} keeps the global batch, split evenly "
            f"over the workers). Use a loader batch_size whose global batch (batch_size x "
            f"{max_workers}) every world size in [{min_workers}, {max_workers}] divides: a "
            f"multiple of {sizes[0]} ({', '.join(map(str, sizes))}, ...); or "
            "ScalingConfig(elastic_batch_policy='scale_lr') to keep the per-worker batch and "
            "scale the learning rate instead"
        )
    per_worker = global_batch // world_size
    steps = 1 if policy == "resize_batch" else -(-per_worker // batch_size)
    return BatchPlan(
        policy=policy,
        world_size=world_size,
        max_workers=max_workers,
        batch_size=batch_size,
        per_worker_batch=per_worker,
        accumulation_steps=steps,
        micro_batch_size=-(-per_worker // steps),
        lr_scale=1.0,
    )


def policy_of(ctx: DistributedContext) -> str:
    """The run's ``elastic_batch_policy`` as the driver passed it (default outside one)."""
    return ctx.config.elastic_batch_policy


def plan_for_loader(data_loader: Any, ctx: DistributedContext) -> BatchPlan | None:
    """The plan for ``data_loader`` at ``ctx.world_size``; ``None`` outside an elastic run or for
    a loader without ``batch_size``. At ``max`` workers (the start), logs a warning on rank 0 when
    a world size of the range would not divide the global batch (a resize there falls back to
    the full restart).

    Raises:
        ValueError: see :func:`plan_batch`.
    """
    settings = ctx.config.elastic
    batch_size = getattr(data_loader, "batch_size", None)
    if settings is None or not batch_size:
        return None
    policy = policy_of(ctx)
    lo, hi = settings.min_workers, settings.max_workers
    if ctx.world_size == hi and ctx.world_rank == 0 and policy != "scale_lr":
        step = ctx.config.mesh.dp_shard if ctx.config.mesh is not None else 1  # whole replicas
        bad = [w for w in range(lo, hi, step) if (batch_size * hi) % w]
        if bad:
            logger.warning(
                "elastic: the global batch %d (batch_size=%d x %d workers) does not divide by "
                "the world sizes %s: losing workers down to those sizes restarts from the disk "
                "checkpoint (batch sizes that work: multiples of %d; or "
                "elastic_batch_policy='scale_lr')",
                batch_size * hi,
                batch_size,
                hi,
                bad,
                compatible_batch_sizes(lo, hi)[0],
            )
    plan = plan_batch(policy, batch_size, ctx.world_size, lo, hi)
    if ctx.world_size != hi and ctx.world_rank == 0:
        logger.info(
            "elastic %s at %d workers: %d samples per worker and step in %d micro-batch(es), "
            "global batch %d, learning rate x %g",
            policy,
            ctx.world_size,
            plan.per_worker_batch,
            plan.accumulation_steps,
            plan.global_batch,
            plan.lr_scale,
        )
    return plan


def constant_global_batch(
    data_loader: DataLoader[Any], ctx: DistributedContext, plan: BatchPlan | None = None
) -> DataLoader[Any]:
    """The loader to shard at world size ``ctx.world_size``: its ``batch_size`` (the per-worker
    batch at ``max`` workers) becomes ``plan.per_worker_batch``, the samples per worker and
    step that the run's ``elastic_batch_policy`` gives (``batch_size * max / world_size`` when
    the global batch is kept; below). Outside an elastic run, or when
    the per-worker batch does not change, ``data_loader`` itself.

    Args:
        data_loader: the user's ``DataLoader``.
        ctx: this worker's context.
        plan: the :class:`BatchPlan` (default: computed here).

    Raises:
        ValueError: if the policy keeps the global batch and it does not divide by the world
            size (the message names the batch sizes that work, and ``"scale_lr"``).
    """
    if plan is None:
        plan = plan_for_loader(data_loader, ctx)
    if plan is None or plan.per_worker_batch == data_loader.batch_size:
        return data_loader
    kwargs: dict[str, Any] = dict(
        batch_size=plan.per_worker_batch,
        sampler=data_loader.sampler,
        num_workers=data_loader.num_workers,
        collate_fn=data_loader.collate_fn,
        pin_memory=data_loader.pin_memory,
        drop_last=data_loader.drop_last,
        timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn,
        multiprocessing_context=data_loader.multiprocessing_context,
        generator=data_loader.generator,
        persistent_workers=data_loader.persistent_workers,
    )
    if data_loader.num_workers > 0:
        kwargs["prefetch_factor"] = data_loader.prefetch_factor
    return DataLoader(data_loader.dataset, **kwargs)


# ---------------------------------------------------------------------- learning rate


def lr_scale_of(ctx: DistributedContext) -> float:
    """The factor the optimizer steps of a worker in ``ctx`` apply to the learning rate: ``W /
    max`` in an elastic run under ``elastic_batch_policy="scale_lr"``, else 1.0 (pure)."""
    settings = ctx.config.elastic
    if settings is None or policy_of(ctx) != "scale_lr":
        return 1.0
    return ctx.world_size / settings.max_workers


def current_lr_scale() -> float:
    """:func:`lr_scale_of` this worker's context now (1.0 outside a worker's session)."""
    session = installed_session()
    return 1.0 if session is None else lr_scale_of(session.context)


def install_lr_scaling(scale: Callable[[], float]) -> list[Any]:
    """Register global ``torch.optim`` step hooks that run every optimizer step with each param
    group's ``lr`` multiplied by ``scale()`` and then put back the exact values it had (nothing
    but the update itself sees the scaled value: no compounding across resizes, nothing scaled
    in a snapshot or checkpoint).

    Returns:
        The hooks' two handles (torch's ``RemovableHandle``): the caller owns them (the elastic
        plug-in installs them once per worker process and removes them when the worker stops).
    """
    saved: dict[int, list[Any]] = {}

    def pre(optimizer: Any, args: Any, kwargs: Any) -> None:
        factor = scale()
        if factor == 1.0:
            return
        saved[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * factor

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        original = saved.pop(id(optimizer), None)
        if original is not None:
            for group, lr in zip(optimizer.param_groups, original, strict=True):
                group["lr"] = lr

    return [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]
