"""The data loader ``prepare_data_loader`` returns: it knows its epoch and its position.

:class:`PreparedDataLoader` hands out the batches of the current epoch on the worker's device,
counts them (its ``state_dict()`` is the loader's part of an exact resume), reseeds its private
generator from ``(seed, epoch)`` at every ``iter()``, and runs the loader hooks
(:mod:`ringtrain.worker.hooks`: elastic training pauses at a batch boundary, step timing measures
the data wait) around each batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ringtrain.worker.data import ResumableDistributedSampler, SampleSeeded
from ringtrain.worker.session import current_hooks, mark_progress


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
        # Imported here: importing the module ringtrain.worker.accumulate first would shadow the
        # function rt.accumulate with the module of the same name (the package's lazy names).
        from ringtrain.worker.accumulate import micro_batches

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
