"""The resumable distributed sampler: a ``DistributedSampler`` that can start mid-epoch.

The shuffle order of an epoch is a function of ``(seed, epoch)`` only: the same permutation of the
dataset as ``torch.utils.data.DistributedSampler`` (``randperm(len(dataset))`` drawn from a
generator seeded with ``seed + epoch``, padded by wrapping around, or truncated with ``drop_last``),
and rank ``r`` of ``W`` takes every ``W``-th index starting at ``r``. Resuming at a global sample
offset ``s`` (a multiple of ``W``: every rank consumed the same number of samples) takes
``indices[s + r :: W]``, exactly the continuation of what that rank would have seen had it never
stopped. Within one epoch no sample is seen twice and none is skipped across the whole job.

With DataLoader worker processes (``num_workers > 0``), randomness drawn inside the dataset (random
crops, noise) comes from the workers' RNGs, which no checkpoint holds and which a resumed epoch
restarts in a different state, with batches dealt to workers differently. :class:`SampleSeeded`
removes that dependence: in a loader worker, just before loading sample ``i`` of epoch ``e``, it
seeds Python's ``random``, NumPy's global generator and torch from ``(seed, e, i)``, so every
augmentation is a function of the sample and the epoch alone, whichever worker loads it, and a
resumed run sees exactly the samples an uninterrupted one would.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, get_worker_info


class ResumableDistributedSampler(DistributedSampler[Any]):
    """``DistributedSampler`` plus a start offset into the epoch.

    Args:
        dataset: a map-style dataset (``len(dataset)`` samples).
        num_replicas: the world size ``W``.
        rank: this rank, ``0 <= rank < W``.
        shuffle: shuffle each epoch with ``seed + epoch``.
        seed: the shuffle seed; identical on every rank.
        drop_last: drop the tail that does not divide evenly by ``W`` (else pad by wrapping).
        yield_epoch: yield ``(epoch, index)`` pairs instead of indices, for :class:`SampleSeeded`.

    Attributes:
        start_sample: global offset into the current epoch's (padded) index list at which the next
            ``iter()`` starts; a multiple of ``num_replicas``. Reset to 0 by :meth:`set_epoch` when
            the epoch changes.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        yield_epoch: bool = False,
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.start_sample = 0
        self.yield_epoch = yield_epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch than the current one starts at its beginning."""
        if epoch != self.epoch:
            self.start_sample = 0
        super().set_epoch(epoch)

    def set_start(self, start_sample: int) -> None:
        """Start the next ``iter()`` at global sample ``start_sample`` of the current epoch.

        Raises:
            ValueError: if ``start_sample`` is negative, beyond the epoch, or not a multiple of
                the world size.
        """
        if not 0 <= start_sample <= self.total_size or start_sample % self.num_replicas:
            raise ValueError(
                f"start_sample={start_sample} must be a multiple of num_replicas="
                f"{self.num_replicas} in [0, {self.total_size}]"
            )
        self.start_sample = start_sample

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())  # this rank's share of the whole epoch
        mine = indices[self.start_sample // self.num_replicas :]
        if self.yield_epoch:
            return iter([(self.epoch, i) for i in mine])
        return iter(mine)

    def __len__(self) -> int:
        return self.num_samples - self.start_sample // self.num_replicas


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 32-bit seed for sample ``index`` of ``epoch`` (a splitmix64-style mix of the three)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index) & (2**64 - 1)
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) & 0xFFFFFFFF


class SampleSeeded(Dataset[Any]):
    """Wraps a map-style dataset, indexed by ``(epoch, index)`` pairs from a
    :class:`ResumableDistributedSampler` with ``yield_epoch=True``. In a DataLoader worker
    process it seeds ``random``, ``numpy.random`` and ``torch`` from
    :func:`sample_seed` before loading each sample; in the main process (``num_workers=0``) it
    leaves the RNGs alone (they are the training process's, saved in every checkpoint).

    Attributes:
        dataset: the wrapped dataset.
        seed: the run's data seed.
    """

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if get_worker_info() is not None:
            s = sample_seed(self.seed, epoch, index)
            random.seed(s)
            np.random.seed(s)
            torch.manual_seed(s)
        return self.dataset[index]
