"""Inside the train function: put the model and the data where they belong.

``prepare_model`` applies, in this order: device placement, then data parallelism (DDP). Each step
is a plain function of the module. ``prepare_data_loader`` gives each rank a disjoint shard of the
data, moves batches to the device, advances the shuffle each epoch and keeps its position
(epoch, batch) as resumable state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from ringtrain.data import ResumableDistributedSampler, SampleSeeded
from ringtrain.distributed import init_process_group
from ringtrain.monitor.timing import batch_size_of, instrument_model
from ringtrain.session import current_timer, get_context


def get_device() -> torch.device:
    """This worker's device: ``cuda:{local_rank}`` with ``use_gpu=True``, else ``cpu``."""
    return get_context().device


def prepare_model(
    model: torch.nn.Module,
    *,
    move_to_device: bool = True,
    parallel_strategy: str | None = "ddp",
    ddp_kwargs: Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """Place ``model`` on this worker's device and wrap it for data parallelism.

    Args:
        model: the module; its parameters must be identical on every rank (seed the same way
            before building it; DDP also broadcasts rank 0's parameters and buffers on wrap).
        move_to_device: move parameters and buffers to ``get_device()``.
        parallel_strategy: ``"ddp"`` wraps in ``DistributedDataParallel`` when the world size is
            above 1; ``None`` returns the placed module unwrapped.
        ddp_kwargs: extra arguments for ``DistributedDataParallel`` (``bucket_cap_mb``,
            ``find_unused_parameters``, ``static_graph``...).

    Returns:
        The module to train (``model.module`` is the original when wrapped).

    Raises:
        ValueError: for an unknown ``parallel_strategy``.
    """
    if parallel_strategy not in ("ddp", None):
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) is not supported "
            "(use 'ddp', or None to leave the model unwrapped)"
        )
    ctx = get_context()
    timer = current_timer()
    if move_to_device:
        model = model.to(ctx.device)
    module = model
    if parallel_strategy == "ddp" and ctx.world_size > 1:
        from ringtrain.comm.ddp import wrap_ddp

        init_process_group(ctx)
        model = wrap_ddp(model, ctx, timer, ddp_kwargs=ddp_kwargs)
    if timer is not None:
        instrument_model(timer, model, module)
    return model


def prepare_data_loader(
    data_loader: DataLoader,
    *,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    seed: int = 0,
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

    Raises:
        ValueError: if the loader uses a custom ``batch_sampler`` or an IterableDataset while
            ``add_dist_sampler`` is True (shard those yourself and pass ``add_dist_sampler=False``).
    """
    ctx = get_context()
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
        seeded = data_loader.num_workers > 0
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
        loader = _rebuild(data_loader, dataset, sampler, torch.Generator())
    device = ctx.device if move_to_device else None
    return PreparedDataLoader(loader, device, seed=seed, world_size=ctx.world_size)


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
        from ringtrain.session import mark_progress

        timer = current_timer()
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
        if self.loader.generator is not None and sampler is not None:
            self.loader.generator.manual_seed(_epoch_seed(self.seed, epoch))
        self.batch = start
        non_blocking = bool(self.loader.pin_memory)
        batches = iter(self.loader)
        try:
            while True:
                if timer is not None and not skip:
                    timer.loader_fetch_start()  # ends the previous step, starts this one
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
                if timer is not None:
                    timer.loader_fetch_end(batch_size_of(batch))
                yield batch
        finally:
            if timer is not None:
                timer.loader_exhausted()  # end of epoch, or the loop broke out early
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
