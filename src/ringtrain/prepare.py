"""Inside the train function: put the model and the data where they belong.

``prepare_model`` applies, in this order: device placement, then data parallelism (DDP). Each step
is a plain function of the module. ``prepare_data_loader`` gives each rank a disjoint shard of the
data, moves batches to the device and advances the shuffle each epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler

from ringtrain.distributed import init_process_group
from ringtrain.session import get_context


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
    device = ctx.device
    if move_to_device:
        model = model.to(device)
    if parallel_strategy == "ddp" and ctx.world_size > 1:
        init_process_group(ctx)
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, **dict(ddp_kwargs or {})
        )
    return model


def prepare_data_loader(
    data_loader: DataLoader,
    *,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    seed: int = 0,
) -> PreparedDataLoader:
    """Shard a DataLoader across ranks and move its batches to the device.

    The loader is rebuilt with a ``DistributedSampler`` (also at world size 1, so that the shuffle
    order depends only on ``seed`` and the epoch, never on the world size: W workers with batch b
    see, step by step, exactly the samples that 1 worker with batch W*b sees). ``shuffle=True`` is
    kept as the sampler's shuffle; each ``iter()`` of the returned loader is the next epoch.

    Args:
        data_loader: a DataLoader over a map-style dataset with ``batch_size`` set.
        add_dist_sampler: shard with a DistributedSampler (False: every rank iterates the loader
            as given, e.g. when the dataset shards itself).
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
        sampler: DistributedSampler[Any] = DistributedSampler(
            data_loader.dataset,
            num_replicas=ctx.world_size,
            rank=ctx.world_rank,
            shuffle=isinstance(data_loader.sampler, RandomSampler),
            seed=seed,
            drop_last=data_loader.drop_last,
        )
        loader = _rebuild(data_loader, sampler)
    device = ctx.device if move_to_device else None
    return PreparedDataLoader(loader, device)


def _rebuild(dl: DataLoader, sampler: DistributedSampler) -> DataLoader:
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
        generator=dl.generator,
        persistent_workers=dl.persistent_workers,
    )
    if dl.num_workers > 0:
        kwargs["prefetch_factor"] = dl.prefetch_factor
    return DataLoader(dl.dataset, **kwargs)


class PreparedDataLoader:
    """A DataLoader whose every ``iter()`` starts the next epoch of its DistributedSampler and
    whose batches are already on the worker's device.

    Attributes:
        loader: the underlying ``DataLoader``.
        epoch: the epoch the next ``iter()`` will use; ``set_epoch`` overrides it.
    """

    def __init__(self, loader: DataLoader, device: torch.device | None) -> None:
        self.loader = loader
        self.device = device
        self.epoch = 0

    @property
    def sampler(self) -> Any:
        return self.loader.sampler

    @property
    def dataset(self) -> Any:
        return self.loader.dataset

    @property
    def batch_size(self) -> int | None:
        return self.loader.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.loader.sampler, DistributedSampler):
            self.loader.sampler.set_epoch(self.epoch)
        self.epoch += 1
        non_blocking = bool(self.loader.pin_memory)
        for batch in self.loader:
            yield batch if self.device is None else _to_device(batch, self.device, non_blocking)


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
