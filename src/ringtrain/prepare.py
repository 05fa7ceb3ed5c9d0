"""Inside the train function: put the model and the data where they belong.

``prepare_model`` applies one strategy (:mod:`ringtrain.parallel`: DDP, FSDP2, TP and FSDP2/HSDP
on the device mesh, or none), in this order: device placement, precision (the precision plug-in's
autocast hooks, :mod:`ringtrain.worker.precision`) and the other ``before_wrap`` hooks, the wrapping
(DDP with its communication hook, :mod:`ringtrain.comm.ddp`, FSDP2, :mod:`ringtrain.parallel.fsdp`,
or the mesh, :mod:`ringtrain.parallel.tensor`), then the ``after_wrap`` hooks (step timing). Each
step is a plain function of the module.
``prepare_data_loader`` gives each data-parallel rank a disjoint shard of the data (on a device
mesh, tensor- and pipeline-parallel peers share theirs), moves batches to the device, advances
the shuffle each epoch and keeps its position (epoch, batch) as resumable state; the loader hooks
(:mod:`ringtrain.worker.hooks`) let elastic training and step timing see it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from ringtrain.cluster.env import DistributedContext
from ringtrain.config.diloco import DiLoCoConfig
from ringtrain.parallel.diloco import diloco_strategy
from ringtrain.parallel.fsdp import FSDPConfig
from ringtrain.parallel.strategy import (
    ModelStrategy,
    ParallelStrategy,
    WrapContext,
    strategy_from_kwargs,
)
from ringtrain.worker.data import ResumableDistributedSampler, SampleSeeded
from ringtrain.worker.hooks import LoaderSetup, ModelSetup
from ringtrain.worker.loader import PreparedDataLoader
from ringtrain.worker.precision import check_precision, precision_plugin
from ringtrain.worker.session import current_hooks, get_context


def get_device() -> torch.device:
    """This worker's device: ``cuda:{local_rank}`` with ``use_gpu=True``, else ``cpu``."""
    return get_context().device


def prepare_model(
    model: torch.nn.Module,
    *,
    strategy: ModelStrategy | None = None,
    move_to_device: bool = True,
    precision: str = "32",
    parallel_strategy: str | None = "ddp",
    ddp_kwargs: Mapping[str, Any] | None = None,
    comm_hook: str | None = None,
    comm_hook_options: Mapping[str, Any] | None = None,
    bucket_cap_mb: float | None = None,
    static_graph: bool | None = None,
    find_unused_parameters: bool | None = None,
    fsdp_config: FSDPConfig | None = None,
    bucket_order: str = "fixed",
    tp_plan: Mapping[str, Any] | None = None,
    diloco_config: DiLoCoConfig | None = None,
) -> torch.nn.Module:
    """Place ``model`` on this worker's device and wrap it for data parallelism.

    The wrapping is one strategy object (:mod:`ringtrain.parallel`): pass it as ``strategy=``
    (``rt.DDPStrategy(comm_hook="bf16")``, ``rt.FSDPStrategy(rt.FSDPConfig(...))``), or describe
    it with the keywords below (``parallel_strategy=``, ``comm_hook=``, ``fsdp_config=``...),
    which are mapped onto the same objects; not both. The steps, in order: validation (before any
    process group), device placement, precision (autocast hooks, :mod:`ringtrain.worker.precision`),
    the ``before_wrap`` hooks, the wrapping (DDP with its communication hook, FSDP2, or none), the
    ``after_wrap`` hooks (:mod:`ringtrain.worker.hooks`).

    Args:
        model: the module; its parameters must be identical on every rank (seed the same way
            before building it; DDP also broadcasts rank 0's parameters and buffers on wrap).
        strategy: a :class:`ringtrain.DDPStrategy`, :class:`ringtrain.FSDPStrategy`,
            :class:`ringtrain.parallel.LocalStrategy` or any
            :class:`ringtrain.parallel.ModelStrategy`; default: the one the keywords describe.
        move_to_device: move parameters and buffers to ``get_device()``.
        precision: ``"32"`` (default), ``"bf16-mixed"`` or ``"16-mixed"``: the forward runs under
            ``torch.autocast`` in that dtype and its outputs are cast back to float32; with
            ``"16-mixed"`` use :func:`ringtrain.prepare_optimizer` and :func:`ringtrain.backward`
            for loss scaling (:mod:`ringtrain.worker.precision`).
        parallel_strategy: ``"ddp"`` wraps in ``DistributedDataParallel`` when the world size is
            above 1; ``"fsdp"`` shards parameters, gradients and optimizer state over the ranks
            with FSDP2 ``fully_shard`` (also at world size 1; build the optimizer after this
            call; see docs/fsdp.md); ``"diloco"``: low-communication training, each worker (or
            island of ``dp_shard`` workers) a replica that syncs every ``sync_every`` steps
            (:class:`ringtrain.DiLoCoConfig`, docs/slow-links.md); ``None`` returns the placed
            module unwrapped.
        ddp_kwargs: extra arguments for ``DistributedDataParallel`` (``gradient_as_bucket_view``,
            ``broadcast_buffers``...).
        comm_hook: how DDP allreduces gradients: ``None`` (its built-in fp32 allreduce),
            ``"bf16"`` / ``"fp16"`` (cast each bucket to 16 bits on the wire: half the bytes),
            ``"powersgd"`` (low-rank compression with error feedback); see docs/comm.md.
        comm_hook_options: PowerSGD options (``matrix_approximation_rank``,
            ``start_powerSGD_iter``...; :data:`ringtrain.comm.ddp.POWERSGD_DEFAULTS`).
        bucket_cap_mb: DDP's gradient bucket size in megabytes (default 25).
        static_graph: tell DDP the set of used parameters and the graph do not change between
            steps (enables its static-graph optimisations).
        find_unused_parameters: let DDP find parameters that get no gradient in a step (costs a
            graph traversal per step).
        fsdp_config: a :class:`ringtrain.FSDPConfig` for ``parallel_strategy="fsdp"`` (units,
            mixed precision, CPU offload, activation checkpointing); default ``FSDPConfig()``.
        bucket_order: ``"fixed"`` (default): DDP's gradient buckets are laid out once, at
            construction, in reverse registration order, so that a worker restarted from a
            checkpoint reduces every step in the same order as the uninterrupted run (bit-exact
            resume at any world size; :class:`ringtrain.comm.ddp.FixedOrderDDP`);
            ``"rebuild"``: torch's DDP, which rebuilds its buckets in the first backward's
            gradient-ready order (only differs for models whose gradients become ready far from
            reverse registration order; see docs/comm.md).
        tp_plan: tensor parallelism on the device mesh (``ScalingConfig(parallel=
            rt.ParallelConfig(tp=...))``): module-name pattern -> ``"colwise"``, ``"rowwise"``,
            ``"sequence"`` or a ``ParallelStyle`` (docs/parallelism.md). With a ``tp_plan``, or
            whenever the run has a ``ParallelConfig`` (and ``parallel_strategy`` is ``"ddp"``
            or ``"fsdp"``), the strategy is :class:`ringtrain.ParallelStrategy`: the plan on
            ``mesh["tp"]``, then FSDP2 (with ``fsdp_config``) over the data-parallel dimensions.
        diloco_config: a :class:`ringtrain.DiLoCoConfig` for ``parallel_strategy="diloco"``
            (default ``DiLoCoConfig()``); the DDP keywords then configure the DDP inside an
            island and are refused without islands.

    Returns:
        The module to train (``model.module`` is the original when wrapped).

    Raises:
        ValueError: for an unknown ``parallel_strategy``, ``comm_hook`` or ``precision``, a
            precision the device cannot run, a bad DDP option, an option given both directly
            and in ``ddp_kwargs``, or ``strategy=`` together with a strategy keyword; raised
            before any process group is created.
        TypeError: ``strategy`` is not a strategy object.
    """
    ctx = get_context()
    ddp_options: dict[str, Any] = dict(
        ddp_kwargs=ddp_kwargs,
        bucket_order=bucket_order,
        comm_hook=comm_hook,
        comm_hook_options=comm_hook_options,
        bucket_cap_mb=bucket_cap_mb,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
    )
    if strategy is None and (parallel_strategy == "diloco" or diloco_config is not None):
        strategy = _diloco(ctx, parallel_strategy, diloco_config, fsdp_config, tp_plan, ddp_options)
    elif strategy is None and (
        tp_plan is not None or (ctx.config.mesh is not None and parallel_strategy is not None)
    ):
        strategy = mesh_strategy(parallel_strategy, fsdp_config, tp_plan, ddp_options)
    elif strategy is None:
        strategy = strategy_from_kwargs(parallel_strategy, fsdp_config, **ddp_options)
    else:
        keywords = dict(
            parallel_strategy=(parallel_strategy, "ddp"),
            ddp_kwargs=(ddp_kwargs, None),
            comm_hook=(comm_hook, None),
            comm_hook_options=(comm_hook_options, None),
            bucket_cap_mb=(bucket_cap_mb, None),
            static_graph=(static_graph, None),
            find_unused_parameters=(find_unused_parameters, None),
            fsdp_config=(fsdp_config, None),
            bucket_order=(bucket_order, "fixed"),
            tp_plan=(tp_plan, None),
            diloco_config=(diloco_config, None),
        )
        check_strategy(
            strategy, [k for k, (value, default) in keywords.items() if value != default]
        )
    precision = strategy.check(precision)
    check_precision(precision, ctx.device)
    mesh = ctx.mesh if getattr(strategy, "uses_mesh", False) else None
    target = WrapContext(ctx, move_to_device, precision, mesh=mesh)
    return _wrap(model, strategy, target)


def _diloco(
    ctx: DistributedContext,
    parallel_strategy: str | None,
    diloco_config: DiLoCoConfig | None,
    fsdp_config: FSDPConfig | None,
    tp_plan: Mapping[str, Any] | None,
    ddp_options: Mapping[str, Any],
) -> ModelStrategy:
    """``prepare_model``'s keywords for DiLoCo as a strategy (:func:`diloco_strategy`)."""
    if parallel_strategy != "diloco":
        raise ValueError(
            f"prepare_model(diloco_config=...) needs parallel_strategy='diloco', got "
            f"parallel_strategy={parallel_strategy!r}"
        )
    if tp_plan is not None:
        raise ValueError(
            "prepare_model(parallel_strategy='diloco', tp_plan=...): DiLoCo replicates the "
            "model on each island; drop tp_plan"
        )
    mesh = ctx.config.mesh
    return diloco_strategy(
        diloco_config, fsdp_config, ddp_options, islands=mesh is not None and mesh.dp_shard > 1
    )


def mesh_strategy(
    parallel_strategy: str | None,
    fsdp_config: FSDPConfig | None,
    tp_plan: Mapping[str, Any] | None,
    ddp_options: Mapping[str, Any],
) -> ParallelStrategy:
    """The :class:`ringtrain.ParallelStrategy` that ``prepare_model``'s keywords describe on a
    run with a device mesh (or with ``tp_plan=``).

    Raises:
        ValueError: ``parallel_strategy`` is not ``"ddp"``/``"fsdp"``, or DDP-only options
            were given (the model is sharded on the mesh, not replicated).
    """
    if parallel_strategy not in ("ddp", "fsdp"):
        raise ValueError(
            f"prepare_model(tp_plan=..., parallel_strategy={parallel_strategy!r}): tensor "
            "parallelism shards the model on the mesh; drop parallel_strategy (or tp_plan)"
        )
    given = [
        name
        for name, value in ddp_options.items()
        if value is not None and not (name == "bucket_order" and value == "fixed")
    ]
    if given:
        raise ValueError(
            f"prepare_model: {', '.join(given)} only apply to DDP, but this run shards the model "
            "on its device mesh (ScalingConfig(parallel=...) or tp_plan=): drop them; FSDP's "
            "options go in fsdp_config=ringtrain.FSDPConfig(...)"
        )
    return ParallelStrategy(tp_plan, fsdp_config if fsdp_config is not None else FSDPConfig())


def check_strategy(strategy: object, keywords: list[str]) -> None:
    """Raise unless ``strategy`` is a strategy object given without strategy keywords.

    Raises:
        TypeError: ``strategy`` lacks :class:`~ringtrain.parallel.ModelStrategy`'s methods.
        ValueError: ``keywords`` (the strategy keywords also given) is not empty.
    """
    if not isinstance(strategy, ModelStrategy):
        raise TypeError(
            f"prepare_model(strategy={strategy!r}) must be a strategy object such as "
            "rt.DDPStrategy(...) or rt.FSDPStrategy(...) (for a name, use parallel_strategy=)"
        )
    if keywords:
        raise ValueError(
            f"prepare_model(strategy=...) takes its options from the strategy object; drop "
            f"{', '.join(keywords)} (e.g. rt.DDPStrategy(comm_hook='bf16'), "
            "rt.FSDPStrategy(rt.FSDPConfig(...)))"
        )


def _wrap(model: torch.nn.Module, strategy: ModelStrategy, target: WrapContext) -> torch.nn.Module:
    """Place, apply precision and the ``before_wrap`` hooks, wrap, run the ``after_wrap`` hooks."""
    hooks = current_hooks()
    if target.precision != "32":
        precision_plugin()  # registered on first use; its before_wrap applies the precision
    module = strategy.place(model, target)
    setup = ModelSetup(
        module=module,
        model=module,
        device=target.device,
        world_size=target.world_size,
        precision=target.precision,
    )
    hooks.before_wrap(setup)
    wrap = replace(target, sync_token=setup.sync_token, comm_observer=setup.comm_observer)
    setup.model = strategy.wrap(setup.module, wrap)
    hooks.after_wrap(setup)  # step timing instruments the model here (monitor/timing.py)
    return setup.model


def prepare_data_loader(
    data_loader: DataLoader,
    *,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    seed: int = 0,
    loader_rng: str = "private",
) -> PreparedDataLoader:
    """Shard a DataLoader across ranks, move its batches to the device, and make its position
    part of the training state.

    The loader is rebuilt with a :class:`~ringtrain.worker.data.ResumableDistributedSampler` (also
    at world size 1, so that the shuffle order depends only on ``seed`` and the epoch, never on the
    world size: W workers with batch b see, step by step, exactly the samples that 1 worker with
    batch W*b sees). ``shuffle=True`` is kept as the sampler's shuffle. The returned loader counts
    the batches it has handed out; its ``state_dict()`` (saved by :class:`ringtrain.TrainState`)
    lets a restarted worker continue at the next unseen batch of the same shuffle order, also with
    ``num_workers > 0``. It also gets its own ``torch.Generator``, reseeded from ``(seed, epoch)``
    at every ``iter()``, so that starting an epoch never draws from the global torch RNG (a plain
    DataLoader draws its workers' base seed from it, which would make a resumed run diverge).
    With ``num_workers > 0`` the dataset is wrapped in :class:`~ringtrain.worker.data.SampleSeeded`:
    a loader worker seeds ``random``, NumPy and torch from ``(seed, epoch, index)`` before loading
    each sample, so random augmentations are reproduced exactly after a resume, whichever worker
    loads the sample.

    Args:
        data_loader: a DataLoader over a map-style dataset with ``batch_size`` set.
        add_dist_sampler: shard with the resumable sampler (False: every rank iterates the loader
            as given, e.g. when the dataset shards itself; a resume then skips the consumed
            batches by drawing and discarding them).
        move_to_device: move every tensor in each batch (nested in tuples, lists, dicts) to
            ``get_device()``.
        seed: the shuffle seed, identical on every rank.
        loader_rng: ``"private"`` (the default): the loader gets its own generator, reseeded
            from ``(seed, epoch)``, as described above. ``"global"``: keep the loader's own
            ``generator`` (``None``: each ``iter()`` draws its base seed from the global torch
            RNG, as a plain DataLoader and Ray Train's ``prepare_data_loader`` do) and no
            per-sample seeding: the same random numbers as Ray Train (``ringtrain.train.torch``
            uses it), at the cost of bit-exact resume mid-epoch.

    Raises:
        ValueError: if the loader uses a custom ``batch_sampler`` or an IterableDataset while
            ``add_dist_sampler`` is True (shard those yourself and pass ``add_dist_sampler=False``).
    """
    ctx = get_context()
    shards, shard = data_parallel_rank(ctx)
    setup = LoaderSetup(data_loader, world_size=shards, world_rank=shard)
    if add_dist_sampler:
        # Elastic runs: the per-worker batch follows the world size by the elastic_batch_policy.
        current_hooks().on_prepare_loader(setup)
        data_loader = setup.data_loader
    loader = data_loader
    if add_dist_sampler:
        if isinstance(data_loader.dataset, IterableDataset):
            raise ValueError(
                "prepare_data_loader: an IterableDataset cannot be sharded by a sampler; shard it "
                "by get_context().world_rank yourself and pass add_dist_sampler=False"
            )
        if data_loader.batch_size is None:
            raise ValueError(
                "prepare_data_loader: the loader has a custom batch_sampler; shard it yourself and "
                "pass add_dist_sampler=False"
            )
        if loader_rng not in ("private", "global"):
            raise ValueError(
                f"prepare_data_loader(loader_rng={loader_rng!r}) must be 'private' or 'global'"
            )
        private = loader_rng == "private"
        seeded = data_loader.num_workers > 0 and private
        sampler = ResumableDistributedSampler(
            data_loader.dataset,
            num_replicas=shards,
            rank=shard,
            shuffle=isinstance(data_loader.sampler, RandomSampler),
            seed=seed,
            drop_last=data_loader.drop_last,
            yield_epoch=seeded,
        )
        dataset = SampleSeeded(data_loader.dataset, seed) if seeded else data_loader.dataset
        generator = torch.Generator() if private else data_loader.generator
        loader = _rebuild(data_loader, dataset, sampler, generator)
    device = ctx.device if move_to_device else None
    prepared = PreparedDataLoader(loader, device, seed=seed, world_size=shards)
    prepared.reseed = add_dist_sampler and loader_rng == "private"
    prepared.micro_batch_size = setup.micro_batch_size
    return prepared


def data_parallel_rank(ctx: DistributedContext) -> tuple[int, int]:
    """``(data-parallel size, this rank's data-parallel index)``: ``dp_replicate x dp_shard``
    and the rank's coordinate on them when the run has a device mesh (TP and PP peers share
    it), else ``(world_size, world_rank)``."""
    mesh = ctx.config.mesh
    if mesh is None or mesh.world_size != ctx.world_size:
        return ctx.world_size, ctx.world_rank
    return mesh.dp_size, mesh.dp_rank(ctx.world_rank)


def _rebuild(
    dl: DataLoader, dataset: Any, sampler: DistributedSampler, generator: torch.Generator
) -> DataLoader:
    kwargs: dict[str, Any] = dict(
        batch_size=dl.batch_size,
        sampler=sampler,
        num_workers=dl.num_workers,
        collate_fn=dl.collate_fn,
        pin_memory=dl.pin_memory,
        drop_last=dl.drop_last,
        timeout=dl.timeout,
        worker_init_fn=dl.worker_init_fn,
        multiprocessing_context=dl.multiprocessing_context,
        generator=generator,
        persistent_workers=dl.persistent_workers,
    )
    if dl.num_workers > 0:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    return DataLoader(dataset, **kwargs)
