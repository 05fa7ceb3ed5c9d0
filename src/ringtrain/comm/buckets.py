"""Bucket planning, reduction ops and the cross-rank layout check of the fused allreduce
(:mod:`ringtrain.comm.fusion`): the pure parts, with no buffers and no state.

The rules are DDP's and Horovod's (see :mod:`ringtrain.comm.fusion`): tensors in a fixed order,
grouped into consecutive buckets of one dtype and device up to a byte threshold
(``HOROVOD_FUSION_THRESHOLD``), a smaller first bucket; the layout checked once across ranks with
a 16-byte digest so that a mismatch raises on every rank instead of hanging.
"""

from __future__ import annotations

import enum
import hashlib
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

#: Horovod's default fusion threshold (bytes) since 0.21.
DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024
#: DDP's first-bucket cap (bytes): the gradients ready first go out early.
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
ENV_FUSION_THRESHOLD = "HOROVOD_FUSION_THRESHOLD"


class ReduceOp(enum.IntEnum):
    """Reduction operations, with Horovod's numbering (``hvd.Average == 0`` ...)."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


DIST_OPS = {
    ReduceOp.Average: dist.ReduceOp.SUM,  # divided by the world size afterwards
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


NO_INT16 = {torch.int16: torch.int32}


def check_op(op: Any) -> ReduceOp:
    """Validate a reduction op (an int or :class:`ReduceOp`).

    Raises:
        NotImplementedError: for Adasum (not implemented; the alternative is named).
        ValueError: for an unknown op.
    """
    try:
        op = ReduceOp(int(op))
    except (ValueError, TypeError) as exc:
        raise ValueError(
            f"op={op!r} is not a reduction op (use Average, Sum, Min, Max or Product)"
        ) from exc
    if op == ReduceOp.Adasum:
        raise NotImplementedError(
            "op=Adasum is not implemented by ringtrain.horovod; use op=Average (the default) and, "
            "for large effective batches, a scaled learning rate with warm-up or an optimizer "
            "such as LAMB"
        )
    return op


def fusion_threshold_from_env(environ: Any = None) -> int:
    """``HOROVOD_FUSION_THRESHOLD`` in bytes (0 disables fusion), else 128 MiB.

    Raises:
        ValueError: if the variable is not a non-negative integer.
    """
    env = os.environ if environ is None else environ
    text = env.get(ENV_FUSION_THRESHOLD, "")
    if text == "":
        return DEFAULT_FUSION_THRESHOLD
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"{ENV_FUSION_THRESHOLD}={text!r} must be a non-negative integer number of bytes "
            "(0 disables tensor fusion)"
        )
    return value


def plan_buckets(
    nbytes: Sequence[int],
    keys: Sequence[Any],
    threshold_bytes: int,
    first_bucket_bytes: int | None = None,
) -> list[list[int]]:
    """Split tensors, in the given order, into consecutive buckets.

    A bucket holds tensors of one ``key`` (dtype and device) and at most ``threshold_bytes``
    (the first bucket at most ``first_bucket_bytes`` when given); a tensor larger than the cap
    gets a bucket of its own; ``threshold_bytes == 0`` puts every tensor alone (no fusion).

    Args:
        nbytes: size of each tensor, bytes.
        keys: each tensor's fusion key; tensors of different keys never share a bucket.
        threshold_bytes: the bucket cap, bytes (>= 0).
        first_bucket_bytes: the first bucket's cap, bytes, or ``None`` for ``threshold_bytes``.

    Returns:
        Lists of indices into ``nbytes``, covering every index once, in order.
    """
    if threshold_bytes < 0:
        raise ValueError(f"threshold_bytes must be >= 0, got {threshold_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, (n, key) in enumerate(zip(nbytes, keys, strict=True)):
        cap = threshold_bytes
        if not buckets and first_bucket_bytes is not None:
            cap = min(cap, first_bucket_bytes)
        if current and (keys[current[0]] != key or size + n > cap):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


def layout_digest(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> torch.Tensor:
    """A 16-byte digest (as 2 int64) of names, dtypes and shapes, for a cross-rank check."""
    h = hashlib.blake2b(digest_size=16)
    for name, dtype, shape in entries:
        h.update(f"{name}|{dtype}|{tuple(shape)};".encode())
    raw = h.digest()
    return torch.tensor(
        [
            int.from_bytes(raw[:8], "little", signed=True),
            int.from_bytes(raw[8:], "little", signed=True),
        ],
        dtype=torch.int64,
    )


def check_same_layout(
    entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    what: str,
    world_size: int,
    group: Any = None,
) -> None:
    """Raise ``RuntimeError`` on every rank unless all ranks hold the same layout.

    Cost: one ``all_gather`` of 16 bytes per rank (one network latency).
    """
    if world_size <= 1:
        return
    mine = layout_digest(entries)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=group)
    differing = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if differing:
        raise RuntimeError(
            f"{what}: ranks {differing} hold different tensors (names, dtypes or shapes) than "
            "rank 0; every rank must register the same parameters in the same order"
        )
