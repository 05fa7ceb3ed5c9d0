"""The prepared loader's position with DataLoader worker processes (``num_workers=2``): the
checks of tests/unit/test_data.py, which run them in-process, and random augmentations drawn in
the loader workers."""

from __future__ import annotations

import pytest

from loaders import (
    check_global_rng_untouched,
    check_resume_reproduces_augmentations,
    check_state_dict_resumes,
)

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_state_dict_resumes_at_the_next_batch_with_loader_workers(k):
    check_state_dict_resumes(2, k)


def test_iterating_with_loader_workers_never_touches_the_global_torch_rng():
    check_global_rng_untouched(2)


def test_resume_with_workers_reproduces_random_augmentations():
    check_resume_reproduces_augmentations()
