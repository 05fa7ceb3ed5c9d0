"""The RNG states a hot spare carries from the rank whose place it takes
(``elastic.snapshot.pack_rng`` / ``unpack_rng``): a fixed-size int64 layout that one all-gather
moves without a pickle."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ringtrain.elastic.snapshot import RNG_WORDS, pack_rng, unpack_rng
from ringtrain.worker.state_files import capture_rng, restore_rng


def _draws() -> tuple[float, float, float, float]:
    return random.random(), random.gauss(0, 1), float(np.random.randn()), torch.rand(1).item()


@pytest.mark.parametrize("gauss_pending", [False, True])
def test_the_packed_streams_continue_exactly(gauss_pending):
    saved = capture_rng()
    try:
        random.seed(3)
        np.random.seed(4)
        torch.manual_seed(5)
        if gauss_pending:  # both Box-Muller caches hold a second value
            random.gauss(0, 1)
            np.random.randn()
        words = pack_rng(capture_rng())
        assert words.dtype == torch.int64 and words.numel() == RNG_WORDS
        expected = _draws()
        torch.manual_seed(99)
        random.seed(99)
        np.random.seed(99)
        state = unpack_rng(words)
        assert state is not None
        restore_rng(state)
        assert _draws() == expected
    finally:
        restore_rng(saved)


def test_streams_it_cannot_carry_pack_to_nothing():
    rng = capture_rng()
    with_cuda = {**rng, "cuda": [torch.zeros(16, dtype=torch.uint8)]}
    assert int(pack_rng(with_cuda)[0]) == 0 and unpack_rng(pack_rng(with_cuda)) is None
    other = {**rng, "numpy": {**rng["numpy"], "bit_generator": "PCG64"}}
    assert unpack_rng(pack_rng(other)) is None
    assert unpack_rng(torch.zeros(RNG_WORDS, dtype=torch.int64)) is None


def test_words_in_another_layout_are_refused():
    words = pack_rng(capture_rng())
    bad = words.clone()
    bad[0] = 7  # an unknown layout version
    with pytest.raises(ValueError, match="layout"):
        unpack_rng(bad)
    bad = words.clone()
    bad[4] = 10**9  # a torch state longer than the words
    with pytest.raises(ValueError, match="layout"):
        unpack_rng(bad)
