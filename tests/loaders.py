"""The prepared loader's helpers and checks shared by tests/unit/test_data.py (in-process
loading) and tests/multiprocess/test_data_workers.py (the same checks with DataLoader worker
processes)."""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt
from ringtrain.prepare import PreparedDataLoader


def dataset(n: int = 23) -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    return TensorDataset(torch.arange(n), torch.randn(n, 3, generator=g))


def prepared(
    num_workers: int = 0, batch_size: int = 4, seed: int = 7, shuffle: bool = True, n: int = 23
) -> PreparedDataLoader:
    dl = DataLoader(dataset(n), batch_size=batch_size, shuffle=shuffle, num_workers=num_workers)
    return rt.prepare_data_loader(dl, seed=seed)


def take(loader: PreparedDataLoader, k: int | None = None) -> list[list[torch.Tensor]]:
    """``k`` batches of ``loader`` (all of the epoch when None); the iterator is closed after, so
    loader worker processes end."""
    it = iter(loader)
    try:
        return [list(b) for b in (it if k is None else itertools.islice(it, k))]
    finally:
        it.close()


def assert_same_batches(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert len(x) == len(y)
        for tx, ty in zip(x, y, strict=True):
            assert torch.equal(tx, ty)


def check_state_dict_resumes(num_workers: int, k: int) -> None:
    """A loader saved after ``k`` batches of epoch 1 resumes at batch ``k`` with the batches an
    uninterrupted loader gives, then goes on into epoch 2."""
    # Reference: an uninterrupted loader, epoch 0 (skipped) then epochs 1 and 2.
    ref = prepared(num_workers)
    take(ref)
    ref_e1 = take(ref)
    ref_e2 = take(ref)
    assert len(ref_e1) == 6  # 23 samples, batches of 4

    # Interrupted: k batches of epoch 1, then save.
    first = prepared(num_workers)
    first.set_epoch(1)
    head = take(first, k)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["batch"] == k
    assert state["samples"] == min(4 * k, 23)
    assert_same_batches(head, ref_e1[:k])

    resumed = prepared(num_workers)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and resumed.batch == k
    rest = take(resumed)
    assert_same_batches(rest, ref_e1[k:])
    assert resumed.epoch == 2 and resumed.batch == 0
    assert_same_batches(take(resumed), ref_e2)


def check_global_rng_untouched(num_workers: int) -> None:
    """Iterating a prepared loader never draws from the global torch RNG."""
    loader = prepared(num_workers)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    take(loader)  # a full epoch
    take(loader, 2)  # and part of the next one
    assert torch.equal(torch.get_rng_state(), before)


class Augmented(torch.utils.data.Dataset):
    """A dataset with a random augmentation, drawn from the torch RNG of the process that loads
    the sample (a loader worker's, with ``num_workers > 0``)."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.rand(1)


def check_resume_reproduces_augmentations() -> None:
    """With 2 loader workers, a resumed loader gives the same samples and the same random
    augmentations as an uninterrupted one."""

    def make() -> PreparedDataLoader:
        dl = DataLoader(Augmented(), batch_size=4, shuffle=True, num_workers=2)
        return rt.prepare_data_loader(dl, seed=1)

    full = take(make())
    first = make()
    take(first, 3)
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    rest = take(resumed)
    assert [b[0].tolist() for b in rest] == [b[0].tolist() for b in full[3:]]  # same samples
    assert_same_batches(rest, full[3:])  # ... and the same augmentations
