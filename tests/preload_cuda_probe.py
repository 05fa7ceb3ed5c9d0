"""A module whose import does what initialising CUDA does to a process (tests/multiprocess/
test_pool.py): every child forked afterwards is "in bad fork" for torch, whose first CUDA call
there would raise "Cannot re-initialize CUDA in forked subprocess". A zygote that preloads it must
stop forking.

This machine's torch has no CUDA, so the module installs the answer torch's CUDA build gives
after ``cuInit`` (``torch._C._cuda_isInBadFork``: true in a child forked after the import). It
stands in for the GPU only; the zygote's probe fork, its answer and the cold start are real."""

from __future__ import annotations

import os

import torch

_POISONED_IN = os.getpid()
torch._C._cuda_isInBadFork = lambda: os.getpid() != _POISONED_IN  # type: ignore[attr-defined]
