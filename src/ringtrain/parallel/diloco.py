"""Low-communication training: DiLoCo and streaming DiLoCo as a ``prepare_model`` strategy.

``prepare_model(model, parallel_strategy="diloco", diloco_config=rt.DiLoCoConfig(...))`` (or
``strategy=rt.DiLoCoStrategy(...)``) makes every worker a replica that trains alone; with
``ScalingConfig(parallel=rt.ParallelConfig(dp_replicate=R, dp_shard=S))`` the replicas are R
islands of S workers each, DDP inside an island (its gradients all-reduced every step over the
island) and DiLoCo across islands. Every ``sync_every`` inner steps the replicas average their
outer gradients and an outer optimizer moves the global parameters (Douillard et al., "DiLoCo:
Distributed Low-Communication Training of Language Models", arXiv:2311.08105, Algorithm 1);
with ``fragments``, ``sync_delay`` and a low-precision ``outer_dtype`` it is streaming DiLoCo
(Douillard et al., "Streaming DiLoCo with overlapping communication", arXiv:2501.18512). The
outer loop is :mod:`ringtrain.parallel.diloco_outer`; its collective
:mod:`ringtrain.parallel.diloco_exchange`; the fragments :mod:`ringtrain.parallel.diloco_fragments`.

How it plugs in (the worker's core imports none of it): ``wrap`` registers a
:class:`DiLoCoPlugin` on the worker's hooks (:mod:`ringtrain.worker.hooks`). The inner optimizer
must be prepared (``rt.prepare_optimizer(...)``): the plug-in adopts it in
``on_prepare_optimizer`` and runs the outer loop in ``on_optimizer_step``, after each inner step;
it checks in ``on_step`` that one was prepared. The outer loop's state is attached to the model
as per-rank state (``attach_rank_state``), so a ``TrainState`` holding the model saves and
restores it in each rank's own file; ``on_restore`` gives a rank that has none (a worker that
joined an elastic run) the global parameters and outer optimizer state of a peer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ringtrain.cluster.distributed import broadcast_state
from ringtrain.cluster.env import DistributedContext
from ringtrain.config.diloco import DiLoCoConfig
from ringtrain.parallel.diloco_exchange import Topology, check_outer_dtype
from ringtrain.parallel.diloco_fragments import split_fragments
from ringtrain.parallel.diloco_outer import OuterSync
from ringtrain.parallel.strategy import DDPStrategy, WrapContext
from ringtrain.worker.hooks import CommObserver, StepState, WorkerPlugin
from ringtrain.worker.precision import normalize_precision
from ringtrain.worker.state_files import attach_rank_state, model_rank_state

logger = logging.getLogger("ringtrain")

STATE_NAME = "diloco"
"""The name of the outer loop's per-rank state on the model (``model_rank_state``)."""


@dataclass(frozen=True)
class DiLoCoStrategy:
    """DiLoCo across replicas (workers, or islands of ``dp_shard`` workers); see the module docs.

    Attributes:
        config: the :class:`ringtrain.DiLoCoConfig`.
        island: the DDP inside an island (its ``comm_hook``, ``bucket_cap_mb``...), used only
            when the run has islands (``ParallelConfig(dp_replicate=R, dp_shard=S)``, S > 1).

    Raises:
        TypeError: ``config`` is not a :class:`ringtrain.DiLoCoConfig` or ``island`` not a
            :class:`ringtrain.DDPStrategy`.
    """

    config: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    island: DDPStrategy = field(default_factory=DDPStrategy)

    name: ClassVar[str] = "diloco"

    def __post_init__(self) -> None:
        if not isinstance(self.config, DiLoCoConfig):
            raise TypeError(
                f"DiLoCoStrategy.config must be a ringtrain.DiLoCoConfig, got "
                f"{type(self.config).__name__} (e.g. DiLoCoConfig(sync_every=50))"
            )
        if not isinstance(self.island, DDPStrategy):
            raise TypeError(
                f"DiLoCoStrategy.island must be a ringtrain.DDPStrategy, got "
                f"{type(self.island).__name__}"
            )

    def check(self, precision: object) -> str:
        return normalize_precision(precision)

    def place(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        return model.to(ctx.device) if ctx.move_to_device else model

    def wrap(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        """Check the fragments, form the groups, start every replica from rank 0's parameters
        and buffers, wrap an island's ranks in DDP, and register the outer loop.

        Raises:
            ValueError: the fragments do not fit the model, the mesh is not one of islands
                (``tp``/``pp`` > 1, or ``dp_replicate == 1``), or the backend cannot reduce
                ``outer_dtype``; naming the field.
        """
        fragments = split_fragments(model, self.config.fragments)  # before any collective
        topology = make_topology(ctx.context)
        if dist.is_initialized():
            check_outer_dtype(self.config.outer_dtype, str(dist.get_backend()))
            if ctx.sync_token is None:
                _broadcast_module(model)
        if (
            self.config.outer_dtype == "int8"
            and topology.replicas >= 4
            and ctx.context.world_rank == 0
        ):
            logger.warning(
                "DiLoCoConfig(outer_dtype='int8') is all-gathered: %d replicas each send %d "
                "bytes per byte of outer gradient, as many or more than bf16's all-reduce "
                "(4 (R - 1) / R); use outer_dtype='bf16' at 4 replicas or more",
                topology.replicas,
                topology.replicas - 1,
            )
        wrapped = model
        if topology.island_size > 1:
            from ringtrain.comm.ddp import wrap_ddp

            wrapped = wrap_ddp(
                model,
                ctx.context,
                ctx.comm_observer,
                ddp_kwargs={**self.island.ddp_arguments(), "process_group": topology.island_group},
                comm_hook=self.island.comm_hook,
                comm_hook_options=self.island.comm_hook_options,
                loss_scaling=ctx.precision == "16-mixed",
                bucket_order=self.island.bucket_order,
            )
        sync = OuterSync(model, self.config, topology, fragments)
        attach_rank_state(wrapped, STATE_NAME, sync)
        elastic = ctx.context.config.elastic
        _register(sync, elastic is not None and elastic.joining, ctx.comm_observer)
        _agree_at_syncs(self.config if self.config.preempt_at_sync else None)
        return wrapped


def diloco_strategy(
    diloco_config: DiLoCoConfig | None,
    fsdp_config: object,
    ddp_options: Mapping[str, Any],
    islands: bool,
) -> DiLoCoStrategy:
    """The :class:`DiLoCoStrategy` that ``prepare_model(parallel_strategy="diloco", ...)``'s
    keywords describe.

    Args:
        diloco_config: ``prepare_model(diloco_config=...)`` (default ``DiLoCoConfig()``).
        fsdp_config: ``prepare_model(fsdp_config=...)``: refused.
        ddp_options: the DDP keywords (``comm_hook``, ``bucket_cap_mb``, ...; ``None`` and
            ``bucket_order="fixed"`` mean "not given"): for the DDP inside an island.
        islands: the run has islands (``ParallelConfig(dp_replicate=R, dp_shard=S)``, S > 1).

    Raises:
        ValueError: ``fsdp_config`` given; DDP options without islands (no gradient is
            all-reduced between outer steps, so there is nothing for them to configure).
        TypeError: ``diloco_config`` is not a :class:`ringtrain.DiLoCoConfig`.
    """
    if diloco_config is not None and not isinstance(diloco_config, DiLoCoConfig):
        raise TypeError(
            f"prepare_model(diloco_config=...) must be a ringtrain.DiLoCoConfig, got "
            f"{type(diloco_config).__name__}"
        )
    if fsdp_config is not None:
        raise ValueError(
            "prepare_model(parallel_strategy='diloco', fsdp_config=...): FSDP over every rank "
            "all-reduces at every step, which DiLoCo exists to avoid, and FSDP inside a DiLoCo "
            "island is not supported yet (islands use DDP); drop fsdp_config"
        )
    given = {
        k: v
        for k, v in ddp_options.items()
        if v is not None and not (k == "bucket_order" and v == "fixed")
    }
    if given and not islands:
        raise ValueError(
            f"prepare_model(parallel_strategy='diloco'): {', '.join(given)} configure a "
            "gradient all-reduce at every step, and DiLoCo replicas have none; they apply "
            "inside islands only (ScalingConfig(parallel=rt.ParallelConfig(dp_replicate=R, "
            "dp_shard=S))): drop them, or use DiLoCoConfig(outer_dtype=...) to compress the "
            "outer gradients"
        )
    island = DDPStrategy(**given)
    return DiLoCoStrategy(diloco_config if diloco_config is not None else DiLoCoConfig(), island)


def make_topology(ctx: DistributedContext) -> Topology:
    """The replicas of this run: every rank (no ``ParallelConfig``), or the mesh's
    ``dp_replicate`` islands of ``dp_shard`` ranks. Forms the process groups (a collective:
    every rank calls it, from ``prepare_model``).

    Raises:
        ValueError: ``tp`` or ``pp`` above 1, or a single island (``dp_replicate == 1``),
            naming the ``ParallelConfig`` field.
    """
    if ctx.config.elastic is not None and ctx.config.mesh is None:
        raise ValueError(
            "DiLoCo in an elastic run (ScalingConfig(num_workers=(min, max))) resizes its "
            "replica axis: add parallel=rt.ParallelConfig(dp_replicate=-1, dp_shard=1) (or "
            "dp_shard=S for islands of S workers), so that a resize resumes every survivor from "
            "its own state at the oldest step they all hold"
        )
    if ctx.world_size == 1:
        return Topology(replicas=1)
    if ctx.config.mesh is None:
        from ringtrain.cluster.distributed import init_process_group

        init_process_group(ctx)
        return Topology(
            replicas=ctx.world_size, replica=ctx.world_rank, outer_group=dist.new_group()
        )
    shape = ctx.config.mesh
    if shape.tp > 1 or shape.pp > 1:
        raise ValueError(
            f"DiLoCo runs on islands of data-parallel ranks: ParallelConfig(tp={shape.tp}, "
            f"pp={shape.pp}) must have tp=1 and pp=1 (use dp_replicate=R, dp_shard=S)"
        )
    mesh = ctx.mesh  # every rank builds it (its groups): a collective
    replicas = mesh["dp_replicate"].size()
    if replicas == 1:
        raise ValueError(
            "DiLoCo averages over islands, but ParallelConfig(dp_replicate=1) makes one island "
            "of every rank: set dp_replicate to the number of islands (e.g. "
            "ParallelConfig(dp_replicate=2, dp_shard=2)), or drop the ParallelConfig to make "
            "each worker a replica"
        )
    size = mesh["dp_shard"].size()
    return Topology(
        replicas=replicas,
        replica=mesh["dp_replicate"].get_local_rank(),
        island_size=size,
        island_rank=mesh["dp_shard"].get_local_rank(),
        outer_group=mesh["dp_replicate"].get_group(),
        island_group=mesh["dp_shard"].get_group() if size > 1 else None,
    )


def _broadcast_module(model: nn.Module) -> None:
    """Rank 0's parameters and buffers to every rank (as DDP does on construction), so that
    replicas built with different seeds start from one point."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if isinstance(tensor, torch.Tensor):
                dist.broadcast(tensor, src=0)


def _register(sync: OuterSync, joining: bool, observer: CommObserver | None = None) -> None:
    """Register the plug-in of ``sync`` on this worker's hooks, replacing the plug-in of an
    earlier ``prepare_model`` (one DiLoCo model per worker: a train function re-entered after an
    elastic resize prepares its model again). ``joining``: this process was started to join a
    running elastic group; it is a joiner until its first restore, unless it prepared a DiLoCo
    model before (then it is a member re-entering after a later resize). ``observer``: the step
    timer the outer loop reports its cost to (``None``: timing is off)."""
    from ringtrain.worker.session import current_hooks

    hooks = current_hooks()
    old = hooks.find(DiLoCoPlugin)
    if old is not None:
        hooks.unregister(old)
    hooks.register(DiLoCoPlugin(sync, joining=joining and old is None, observer=observer))


def _agree_at_syncs(config: DiLoCoConfig | None) -> None:
    """Make the preemption agreement (:mod:`ringtrain.worker.preempt`) run only at the steps
    where a fragment leaves (``config``; ``None``: at every step, as without DiLoCo)."""
    from ringtrain.worker.preempt import PreemptionPlugin
    from ringtrain.worker.session import current_hooks

    plugin = current_hooks().find(PreemptionPlugin)
    if plugin is None:
        return
    if config is None:
        plugin.agree_when = None
        return
    offsets = frozenset(config.offset(f) for f in range(config.fragments))
    every = config.sync_every
    plugin.agree_when = lambda step: step % every in offsets


def outer_sync(model: nn.Module) -> OuterSync:
    """The outer loop of a model prepared with ``parallel_strategy="diloco"`` (its global
    parameters ``global_params``, ``inner_steps``, ``outer_steps``, ``stats``...).

    Raises:
        ValueError: ``model`` was not prepared with DiLoCo.
    """
    sync = model_rank_state(model).get(STATE_NAME)
    if not isinstance(sync, OuterSync):
        raise ValueError("this model was not prepared with parallel_strategy='diloco'")
    return sync


class DiLoCoPlugin(WorkerPlugin):
    """The outer loop on the worker's hooks (see the module docs).

    Args:
        sync: the rank's :class:`~ringtrain.parallel.diloco_outer.OuterSync`.
        joining: this process joins a running elastic group: the state its first restore loads
            is a member's (the elastic snapshot it received), so it keeps only the global part.
        observer: the step timer (``ModelSetup.comm_observer``), told after each inner step
            what the outer loop cost (:meth:`~ringtrain.worker.hooks.CommObserver.
            outer_sync_done`): its windows carry it to the driver; ``None``: timing is off.
    """

    def __init__(
        self, sync: OuterSync, joining: bool = False, observer: CommObserver | None = None
    ) -> None:
        self.sync = sync
        self.joining = joining
        self.observer = observer

    def on_prepare_optimizer(self, optimizer: object) -> None:
        self.sync.adopt(optimizer)

    def on_optimizer_step(self, optimizer: object) -> None:
        if not self.sync.adopt(optimizer):
            return
        stats = self.sync.stats
        before = (stats.seconds, stats.bytes_sent, stats.exchanges)
        self.sync.after_inner_step()
        if self.observer is not None:
            self.observer.outer_sync_done(
                stats.seconds - before[0],
                stats.bytes_sent - before[1],
                stats.exchanges - before[2],
                self.sync.outer_steps,
            )

    def on_step(self, state: StepState) -> None:
        """Refuse a loop whose optimizer was not prepared (no outer step would ever run).

        Raises:
            RuntimeError: no prepared optimizer over the model's parameters stepped.
        """
        if self.sync.inner is None:
            raise RuntimeError(
                "prepare_model(parallel_strategy='diloco'): the outer sync runs inside the "
                "inner optimizer's step(); wrap it with rt.prepare_optimizer(torch.optim.AdamW("
                "model.parameters(), ...)) before training"
            )

    def on_restore(self, state: object, checkpoint: object) -> None:
        """A joining replica keeps only the global part of the member state it received (its
        local parameters become the global ones: :meth:`OuterSync.join`); ranks without DiLoCo
        state get the global parameters and outer optimizer state of the lowest rank that has
        them (a collective of every rank; every rank restores)."""
        if self.joining and self.sync.restored:
            self.sync.join()
            logger.info(
                "DiLoCo: joined at inner step %d from a member's state", self.sync.inner_steps
            )
        self.joining = False
        share_missing_state(self.sync)

    def on_worker_stop(self, error: BaseException | None) -> None:
        if error is None:
            self.sync.drain()


def share_missing_state(sync: OuterSync) -> None:
    """After a restore: if some rank loaded no DiLoCo state (it joined, or the checkpoint
    predates DiLoCo), the lowest rank that has it broadcasts its shared part (counters, global
    parameters, outer optimizer) and the others set their local parameters to the global ones;
    if no rank has it, every rank starts the outer loop from its (restored, identical) model."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if not sync.restored:
            sync.reset_from_local()
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    device = _collective_device()
    # MIN of: (rank if it has state else world): the source; -(has none): whether one lacks
    # it; the inner step of those that have it, and its negation: they must all be equal.
    have = sync.restored
    big = 2**62
    box = torch.tensor(
        [
            rank if have else world,
            -int(not have),
            sync.inner_steps if have else big,
            -sync.inner_steps if have else big,
        ],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(box, op=dist.ReduceOp.MIN)
    source, missing, low, high = int(box[0]), -int(box[1]), int(box[2]), -int(box[3])
    if source < world and low != high:
        raise RuntimeError(
            f"DiLoCo: the ranks restored states of different inner steps ({low} to {high}); "
            "their outer syncs would not line up (an elastic resize without a ParallelConfig "
            "takes the newest snapshot: use ParallelConfig(dp_replicate=-1, dp_shard=1))"
        )
    if not missing:
        return
    if source == world:
        sync.reset_from_local()
        return
    # Not a pickle (gloo is not authenticated): torch.save, read with weights_only=True.
    shared = broadcast_state(sync.shared_state() if rank == source else None, source)
    if not sync.restored:
        assert shared is not None
        sync.load_shared_state(shared)
        sync.join(shared.get("in_flight"))
        logger.info("rank %d: DiLoCo global state received from rank %d", rank, source)


def _collective_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if (dist.get_backend() == "nccl")
        else torch.device("cpu")
    )
