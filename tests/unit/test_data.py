"""The resumable sampler and the prepared loader's position, in-process (world size 1 for the
loader; other ranks emulated by building the sampler directly)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ringtrain as rt
from loaders import assert_same_batches as _assert_same_batches
from loaders import check_global_rng_untouched, check_state_dict_resumes
from loaders import dataset as _dataset
from loaders import prepared as _prepared
from loaders import take as _take
from ringtrain.worker.data import ResumableDistributedSampler


class _Sized(torch.utils.data.Dataset[int]):
    """A map-style dataset of ``n`` samples (the samplers only need ``len()``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


SAMPLER_CASES = [
    # (n, world_size, shuffle, drop_last, epoch)
    (12, 3, True, False, 0),
    (13, 3, True, False, 1),  # padded by wrapping
    (13, 3, True, True, 2),  # tail dropped
    (10, 4, False, False, 0),
    (10, 4, False, True, 5),
    (7, 1, True, False, 3),
    (5, 8, True, False, 0),  # fewer samples than ranks: heavy padding
    (31, 2, True, True, 7),
]


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last", "epoch"), SAMPLER_CASES)
def test_start_zero_matches_torch_distributed_sampler(n, world, shuffle, drop_last, epoch):
    ds = _Sized(n)
    for rank in range(world):
        ours = ResumableDistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=17, drop_last=drop_last
        )
        theirs: DistributedSampler[int] = DistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=17, drop_last=drop_last
        )
        ours.set_epoch(epoch)
        theirs.set_epoch(epoch)
        assert list(ours) == list(theirs), (rank, epoch)
        assert len(ours) == len(theirs)


def test_epochs_differ_when_shuffling():
    # Guards the test above against a sampler that ignores the epoch (both would agree trivially
    # only if torch's did too).
    s = ResumableDistributedSampler(_Sized(40), num_replicas=2, rank=0, shuffle=True, seed=3)
    s.set_epoch(0)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last", "epoch"), SAMPLER_CASES)
def test_resume_at_every_offset_is_the_exact_tail(n, world, shuffle, drop_last, epoch):
    ds = _Sized(n)

    def sampler(rank: int) -> ResumableDistributedSampler:
        s = ResumableDistributedSampler(
            ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        s.set_epoch(epoch)
        return s

    full = {rank: list(sampler(rank)) for rank in range(world)}
    full_counts = Counter(itertools.chain.from_iterable(full.values()))
    per_rank = len(full[0])
    for k in range(per_rank + 1):
        consumed: Counter[int] = Counter()
        for rank in range(world):
            s = sampler(rank)
            s.set_start(k * world)
            tail = list(s)
            assert tail == full[rank][k:], (k, rank)
            assert len(s) == per_rank - k
            consumed.update(full[rank][:k])  # what this rank saw before stopping
            consumed.update(tail)
        # Nothing twice, nothing skipped: exactly the uninterrupted epoch's multiset.
        assert consumed == full_counts, k
    if not drop_last:
        assert set(full_counts) == set(range(n))  # every index is covered at least once


def test_set_epoch_resets_start_only_for_a_new_epoch():
    s = ResumableDistributedSampler(_Sized(20), num_replicas=2, rank=1, shuffle=True, seed=0)
    s.set_epoch(3)
    s.set_start(6)
    s.set_epoch(3)  # same epoch: the position stays
    assert s.start_sample == 6
    s.set_epoch(4)
    assert s.start_sample == 0
    ref: DistributedSampler[int] = DistributedSampler(
        _Sized(20), num_replicas=2, rank=1, shuffle=True, seed=0
    )
    ref.set_epoch(4)
    assert list(s) == list(ref)


@pytest.mark.parametrize("bad", [-2, 1, 3, 23, 24])
def test_bad_offsets_raise(bad):
    # 21 samples over 2 ranks: total_size 22; valid offsets are the even numbers 0..22.
    s = ResumableDistributedSampler(_Sized(21), num_replicas=2, rank=0, shuffle=False)
    assert s.total_size == 22
    with pytest.raises(ValueError, match="start_sample"):
        s.set_start(bad)
    assert s.start_sample == 0
    s.set_start(22)  # the very end is valid: nothing left
    assert list(s) == [] and len(s) == 0


# ---------------------------------------------------------------- the prepared loader


def test_prepared_loader_shuffles_like_the_sampler_and_varies_by_epoch():
    loader = _prepared()
    assert rt.get_context().world_size == 1
    assert isinstance(loader.sampler, ResumableDistributedSampler)
    e0 = _take(loader)
    assert loader.epoch == 1 and loader.batch == 0  # ran off the end: next epoch
    e1 = _take(loader)
    ids0 = torch.cat([b[0] for b in e0])
    ids1 = torch.cat([b[0] for b in e1])
    assert sorted(ids0.tolist()) == list(range(23)) == sorted(ids1.tolist())
    assert not torch.equal(ids0, ids1)
    ref: DistributedSampler[int] = DistributedSampler(
        _dataset(), num_replicas=1, rank=0, shuffle=True, seed=7
    )
    ref.set_epoch(1)
    assert ids1.tolist() == list(ref)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_state_dict_resumes_at_the_next_batch(k):
    check_state_dict_resumes(0, k)  # with loader workers: tests/multiprocess/test_data_workers.py


def test_state_dict_at_the_last_batch_resumes_with_nothing_left():
    loader = _prepared()
    it = iter(loader)
    batches = [next(it) for _ in range(6)]  # every batch, the generator not yet exhausted
    assert len(batches) == 6
    state = loader.state_dict()
    it.close()
    assert state == {
        "epoch": 0,
        "batch": 6,
        "samples": 23,
        "seed": 7,
        "world_size": 1,
        "batch_size": 4,
    }
    resumed = _prepared()
    resumed.load_state_dict(state)
    assert _take(resumed) == []
    assert resumed.epoch == 1 and resumed.batch == 0


def test_running_off_the_end_advances_epoch_and_resets_batch():
    loader = _prepared()
    it = iter(loader)
    next(it)
    next(it)
    assert (loader.epoch, loader.batch) == (0, 2)
    for _ in it:
        pass
    assert (loader.epoch, loader.batch) == (1, 0)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["samples"] == 0


def test_set_epoch_to_another_epoch_resets_the_position():
    ref = _prepared()
    ref.set_epoch(4)
    ref_e4 = _take(ref)

    loader = _prepared()
    loader.set_epoch(2)
    _take(loader, 3)
    state = loader.state_dict()
    resumed = _prepared()
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # the same epoch: the restored position is kept
    assert resumed.batch == 3
    resumed.set_epoch(4)
    assert resumed.batch == 0 and resumed.state_dict()["samples"] == 0
    _assert_same_batches(_take(resumed), ref_e4)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [("batch_size", {"batch_size": 5}), ("seed", {"seed": 8})],
)
def test_load_state_dict_rejects_another_setup(field, kwargs):
    loader = _prepared()
    _take(loader, 1)
    state = loader.state_dict()
    other = _prepared(**kwargs)
    with pytest.raises(ValueError, match=field):
        other.load_state_dict(state)
    assert other.batch == 0 and other.epoch == 0  # nothing half-applied


def test_load_state_dict_rejects_another_world_size():
    loader = _prepared()
    _take(loader, 1)
    state = {**loader.state_dict(), "world_size": 2}
    with pytest.raises(ValueError, match="world_size=2"):
        _prepared().load_state_dict(state)


def test_iterating_never_touches_the_global_torch_rng():
    check_global_rng_untouched(0)  # with loader workers: tests/multiprocess/test_data_workers.py


def test_a_plain_shuffled_loader_does_draw_from_the_global_rng():
    # The property above is not vacuous: an unprepared shuffled DataLoader consumes global RNG.
    dl = DataLoader(_dataset(), batch_size=4, shuffle=True)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    for _ in dl:
        pass
    assert not torch.equal(torch.get_rng_state(), before)
