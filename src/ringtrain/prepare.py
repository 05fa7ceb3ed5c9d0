"""Inside the train function: put the model and the data where they belong.

``prepare_model`` applies one strategy (:mod:`ringtrain.parallel`: DDP, FSDP2, or none), in this
order: device placement, precision (the precision plug-in's autocast hooks, :mod:`ringtrain.amp`)
and the other ``before_wrap`` hooks, the wrapping (DDP with its communication hook,
:mod:`ringtrain.comm.ddp`, or FSDP2, :mod:`ringtrain.fsdp`), then the ``after_wrap`` hooks (step
timing). Each step is a plain function of the module.
``prepare_data_loader`` gives each rank a disjoint shard of the data, moves batches to the
device, advances the shuffle each epoch and keeps its position (epoch, batch) as resumable
state; the loader hooks (:mod:`ringtrain.hooks`) let elastic training and step timing see it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from ringtrain.amp import check_precision, precision_plugin
from ringtrain.data import ResumableDistributedSampler, SampleSeeded
from ringtrain.fsdp import FSDPConfig
from ringtrain.hooks import LoaderSetup, ModelSetup
from ringtrain.parallel.strategy import ModelStrategy, WrapContext, strategy_from_kwargs
from ringtrain.session import current_hooks, current_timer, get_context, mark_progress


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
) -> torch.nn.Module:
    """Place ``model`` on this worker's device and wrap it for data parallelism.

    The wrapping is one strategy object (:mod:`ringtrain.parallel`): pass it as ``strategy=``
    (``rt.DDPStrategy(comm_hook="bf16")``, ``rt.FSDPStrategy(rt.FSDPConfig(...))``), or describe
    it with the keywords below (``parallel_strategy=``, ``comm_hook=``, ``fsdp_config=``...),
    which are mapped onto the same objects; not both. The steps, in order: validation (before any
    process group), device placement, precision (autocast hooks, :mod:`ringtrain.amp`), the
    ``before_wrap`` hooks, the wrapping (DDP with its communication hook, FSDP2, or none), the
    ``after_wrap`` hooks (:mod:`ringtrain.hooks`).

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
            for loss scaling (:mod:`ringtrain.amp`).
        parallel_strategy: ``"ddp"`` wraps in ``DistributedDataParallel`` when the world size is
            above 1; ``"fsdp"`` shards parameters, gradients and optimizer state over the ranks
            with FSDP2 ``fully_shard`` (also at world size 1; build the optimizer after this
            call; see docs/fsdp.md); ``None`` returns the placed module unwrapped.
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

    Returns:
        The module to train (``model.module`` is the original when wrapped).

    Raises:
        ValueError: for an unknown ``parallel_strategy``, ``comm_hook`` or ``precision``, a
            precision the device cannot run, a bad DDP option, an option given both directly
            and in ``ddp_kwargs``, or ``strategy=`` together with a strategy keyword; raised
            before any process group is created.
        TypeError: ``strategy`` is not a strategy object.
    """
    if strategy is None:
        strategy = strategy_from_kwargs(
            parallel_strategy,
            fsdp_config,
            ddp_kwargs=ddp_kwargs,
            bucket_order=bucket_order,
            comm_hook=comm_hook,
            comm_hook_options=comm_hook_options,
            bucket_cap_mb=bucket_cap_mb,
            static_graph=static_graph,
            find_unused_parameters=find_unused_parameters,
        )
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
        )
        check_strategy(
            strategy, [k for k, (value, default) in keywords.items() if value != default]
        )
    ctx = get_context()
    precision = strategy.check(precision)
    check_precision(precision, ctx.device)
    target = WrapContext(ctx, move_to_device, precision, current_timer())
    return _wrap(model, strategy, target)


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
    precision_plugin().precision = target.precision  # its before_wrap applies it
    module = strategy.place(model, target)
    setup = ModelSetup(
        module=module, model=module, device=target.device, world_size=target.world_size
    )
    hooks.before_wrap(setup)
    setup.model = strategy.wrap(setup.module, replace(target, sync_token=setup.sync_token))
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

    The loader is rebuilt with a :class:`~ringtrain.data.ResumableDistributedSampler` (also at
    world size 1, so that the shuffle order depends only on ``seed`` and the epoch, never on the
    world size: W workers with batch b see, step by step, exactly the samples that 1 worker with
    batch W*b sees). ``shuffle=True`` is kept as the sampler's shuffle. The returned loader counts
    the batches it has handed out; its ``state_dict()`` (saved by :class:`ringtrain.TrainState`)
    lets a restarted worker continue at the next unseen batch of the same shuffle order, also with
    ``num_workers > 0``. It also gets its own ``torch.Generator``, reseeded from ``(seed, epoch)``
    at every ``iter()``, so that starting an epoch never draws from the global torch RNG (a plain
    DataLoader draws its workers' base seed from it, which would make a resumed run diverge).
    With ``num_workers > 0`` the dataset is wrapped in :class:`~ringtrain.data.SampleSeeded`: a
    loader worker seeds ``random``, NumPy and torch from ``(seed, epoch, index)`` before loading
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
    setup = LoaderSetup(data_loader, world_size=ctx.world_size, world_rank=ctx.world_rank)
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
            num_replicas=ctx.world_size,
            rank=ctx.world_rank,
            shuffle=isinstance(data_loader.sampler, RandomSampler),
            seed=seed,
            drop_last=data_loader.drop_last,
            yield_epoch=seeded,
        )
        dataset = SampleSeeded(data_loader.dataset, seed) if seeded else data_loader.dataset
        generator = torch.Generator() if private else data_loader.generator
        loader = _rebuild(data_loader, dataset, sampler, generator)
    device = ctx.device if move_to_device else None
    prepared = PreparedDataLoader(loader, device, seed=seed, world_size=ctx.world_size)
    prepared.reseed = add_dist_sampler and loader_rng == "private"
    prepared.micro_batch_size = setup.micro_batch_size
    return prepared


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


def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch) % (1 << 63)


class PreparedDataLoader:
    """A DataLoader that knows its epoch and its position within it.

    Iterating it yields the batches of the current epoch (already on the worker's device),
    starting at the next unseen batch after a :meth:`load_state_dict`; running off the end of an
    epoch advances to the next one, so ``for epoch in range(n): for batch in loader: ...`` sees
    a fresh shuffle every epoch. ``set_epoch(e)`` selects an epoch explicitly, as with a
    ``DistributedSampler``. Every batch handed out counts as progress for hang detection.

    Attributes:
        loader: the underlying ``DataLoader``.
        batch: how many batches of the current epoch this rank has handed out.
        micro_batch_size: the largest micro-batch :meth:`micro_batches` cuts a batch into
            (samples): the loader's ``batch_size`` in an elastic run with
            ``elastic_batch_policy="accumulate"``; ``None`` (no splitting) otherwise.
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | None,
        *,
        seed: int = 0,
        world_size: int = 1,
    ) -> None:
        self.loader = loader
        self.device = device
        self.seed = seed
        self.world_size = world_size
        self.batch = 0
        self._epoch = 0
        self._resume_batch: int | None = None
        self.micro_batch_size: int | None = None
        self.reseed = True  # reseed the loader's generator from (seed, epoch) at every iter()

    def micro_batches(
        self, batch: Any, model: Any = None, max_size: int | None = None
    ) -> Iterator[tuple[Any, float]]:
        """Cut one step's ``batch`` into micro-batches and yield ``(micro_batch, weight)``::

            for batch in loader:
                optimizer.zero_grad()
                for (x, y), weight in loader.micro_batches(batch, model):
                    rt.backward(loss_fn(model(x), y) * weight)
                optimizer.step()

        ``weight`` is ``len(micro_batch) / len(batch)``: with a loss that is a mean over the
        batch's samples, the summed gradient is that of the whole batch. With a DDP ``model``
        the gradients are allreduced once, on the last micro-batch (the others run under
        ``no_sync()``; it counts with :func:`ringtrain.accumulate`'s counter, so do not also
        wrap it in ``rt.accumulate``). Without splitting it yields ``(batch, 1.0)`` once.

        Args:
            batch: a batch this loader yielded (tensors with the samples along dim 0, nested in
                tuples, lists, dicts).
            model: the prepared model (``None``: no ``no_sync()``).
            max_size: the largest micro-batch (samples); default :attr:`micro_batch_size`.

        Raises:
            ValueError: ``max_size`` is not an integer >= 1.
        """
        # Imported here: importing the module ringtrain.accumulate first would shadow the
        # function rt.accumulate with the module of the same name (the package's lazy names).
        from ringtrain.accumulate import micro_batches

        size = max_size if max_size is not None else self.micro_batch_size
        return micro_batches(batch, model, size)

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def dataset(self) -> Any:
        ds = self.loader.dataset
        return ds.dataset if isinstance(ds, SampleSeeded) else ds

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def _resumable(self) -> ResumableDistributedSampler | None:
        sampler = self.loader.sampler
        return sampler if isinstance(sampler, ResumableDistributedSampler) else None

    @property
    def epoch(self) -> int:
        """The epoch the next ``iter()`` uses."""
        sampler = self._resumable()
        return sampler.epoch if sampler is not None else self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next ``iter()``; a different epoch starts at its first batch."""
        if epoch != self.epoch:
            self.batch = 0
            self._resume_batch = None
        sampler = self._resumable()
        if sampler is not None:
            sampler.set_epoch(epoch)
        elif isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(epoch)
        self._epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "batch", "samples", "seed", "world_size", "batch_size"}``: ``batch`` is this
        rank's batches handed out in ``epoch``; ``samples`` the global samples consumed
        (``batch * batch_size * world_size``, capped at the epoch's end)."""
        bs = self.loader.batch_size or 1
        sampler = self._resumable()
        per_rank = min(self.batch * bs, sampler.num_samples) if sampler else self.batch * bs
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "samples": per_rank * self.world_size,
            "seed": self.seed,
            "world_size": self.world_size,
            "batch_size": self.loader.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the position ``state`` records: the next ``iter()`` yields the first batch
        of epoch ``state["epoch"]`` this rank has not seen.

        Raises:
            ValueError: if the world size, batch size or seed differ from the saved ones (the
                saved position would then point at different samples).
        """
        for key, mine in (
            ("world_size", self.world_size),
            ("batch_size", self.loader.batch_size),
            ("seed", self.seed),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"cannot resume the data loader: the checkpoint was taken with {key}="
                    f"{state.get(key)}, this run has {key}={mine} (resume with the same "
                    "ScalingConfig and loader settings)"
                )
        self.set_epoch(int(state["epoch"]))
        self.batch = int(state["batch"])
        self._resume_batch = self.batch

    def __len__(self) -> int:
        """Batches per epoch for this rank (the whole epoch, also while resuming mid-epoch)."""
        sampler = self._resumable()
        bs = self.loader.batch_size
        if sampler is None or not bs:
            return len(self.loader)
        if self.loader.drop_last:
            return sampler.num_samples // bs
        return -(-sampler.num_samples // bs)

    def __iter__(self) -> Iterator[Any]:
        hooks = current_hooks()
        start = self._resume_batch or 0
        self._resume_batch = None
        epoch = self.epoch
        sampler = self._resumable()
        skip = 0
        if sampler is not None:
            bs = self.loader.batch_size or 1
            sampler.set_start(min(start * bs, sampler.num_samples) * sampler.num_replicas)
        else:
            skip = start
            if isinstance(self.loader.sampler, DistributedSampler):
                self.loader.sampler.set_epoch(epoch)
        if self.reseed and self.loader.generator is not None and sampler is not None:
            self.loader.generator.manual_seed(_epoch_seed(self.seed, epoch))
        self.batch = start
        non_blocking = bool(self.loader.pin_memory)
        batches = iter(self.loader)
        try:
            while True:
                if not skip:
                    # Step timing: the previous step ends, this one starts; elastic runs: where
                    # the group pauses to grow.
                    hooks.on_batch_start()
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                if skip:
                    skip -= 1
                    continue
                self.batch += 1
                mark_progress()
                if self.device is not None:
                    batch = _to_device(batch, self.device, non_blocking)
                hooks.on_batch(batch)
                yield batch
        finally:
            hooks.on_batches_end()  # end of epoch, or the loop broke out early
        self.set_epoch(epoch + 1)


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return type(batch)({k: _to_device(v, device, non_blocking) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device, non_blocking) for v in batch)
    return batch
