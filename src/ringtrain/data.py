"""The resumable distributed sampler: a ``DistributedSampler`` that can start mid-epoch.

The shuffle order of an epoch is a function of ``(seed, epoch)`` only: the same permutation of the
dataset as ``torch.utils.data.DistributedSampler`` (``randperm(len(dataset))`` drawn from a
generator seeded with ``seed + epoch``, padded by wrapping around, or truncated with ``drop_last``),
and rank ``r`` of ``W`` takes every ``W``-th index starting at ``r``. Resuming at a global sample
offset ``s`` (a multiple of ``W``: every rank consumed the same number of samples) takes
``indices[s + r :: W]``, exactly the continuation of what that rank would have seen had it never
stopped. Within one epoch no sample is seen twice and none is skipped across the whole job.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler[int]):
    """``DistributedSampler`` plus a start offset into the epoch.

    Args:
        dataset: a map-style dataset (``len(dataset)`` samples).
        num_replicas: the world size ``W``.
        rank: this rank, ``0 <= rank < W``.
        shuffle: shuffle each epoch with ``seed + epoch``.
        seed: the shuffle seed; identical on every rank.
        drop_last: drop the tail that does not divide evenly by ``W`` (else pad by wrapping).

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

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())  # this rank's share of the whole epoch
        return iter(indices[self.start_sample // self.num_replicas :])

    def __len__(self) -> int:
        return self.num_samples - self.start_sample // self.num_replicas
