"""The row each rank contributes to :func:`~ringtrain.horovod.runtime.negotiate`, and the
comparison of every rank's row.

Pure functions (no process group): one row of ``9`` int64 per operation plus the alltoall splits:
``[kind, name, dtype, ndim, shape hash, first dim, extra, count, payload, splits...]``,
text hashed to 63 bits (blake2b) so that it fits an int64. :func:`mismatches` names, per rank,
the first field that differs from the first rank's row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

#: dtypes with a stable code; any other dtype is coded ``100 + hash % 1000``.
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
HEADER = 9
KIND, NAME, DTYPE, NDIM, SHAPE, DIM0, EXTRA, COUNT, PAYLOAD = range(HEADER)


def hash63(text: str) -> int:
    """``text`` as a non-negative int64 (63 bits of blake2b)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` (its index in :data:`DTYPES`, else a hash)."""
    return DTYPES.index(dtype) if dtype in DTYPES else 100 + hash63(str(dtype)) % 1000


def describe(row: Sequence[int]) -> str:
    """The tensor part of ``row`` in words, for error messages."""
    code = row[DTYPE]
    dtype = str(DTYPES[code]).replace("torch.", "") if 0 <= code < len(DTYPES) else f"#{code}"
    return f"dtype {dtype}, {row[NDIM]} dims, first dim {row[DIM0]}"


def metadata_row(
    kind: str,
    name: str | None,
    tensors: Sequence[torch.Tensor],
    vary_first_dim: bool,
    extra: int,
    payload: int,
    signature: str | None,
) -> list[int]:
    """This rank's ``HEADER`` integers for an operation (see the module docstring).

    Args:
        kind: the operation (``"allreduce"``...).
        name: the key it is matched by (its name, or the unnamed key); ``None``: 0.
        tensors: its tensors (the first one's dtype and dims are recorded, a hash of all
            shapes).
        vary_first_dim: the first dimension is left out of the shape hash.
        extra: an integer every rank must agree on (op, root rank, process set).
        payload: an integer carried and not compared.
        signature: text folded into the shape hash (parameter names).
    """
    t0 = tensors[0] if tensors else torch.empty(0)
    if len(tensors) == 1:
        rest = tuple(t0.shape[1:]) if vary_first_dim else tuple(t0.shape)
        shape_hash = hash63(repr(rest))
    else:
        shape_hash = hash63(
            repr(
                [(str(t.dtype), tuple(t.shape[1:] if vary_first_dim else t.shape)) for t in tensors]
            )
        )
    if signature is not None:
        shape_hash = hash63(f"{shape_hash}|{signature}")
    return [
        hash63(kind),
        hash63(name) if name else 0,
        dtype_code(t0.dtype),
        t0.dim(),
        shape_hash,
        int(t0.shape[0]) if t0.dim() > 0 else 1,
        int(extra),
        len(tensors),
        int(payload),
    ]


def mismatches(
    rows: Sequence[Sequence[int]],
    ranks: Sequence[int],
    vary_first_dim: bool,
    signature: str | None,
) -> list[str]:
    """What differs between each row and the first one, one phrase per differing rank.

    Args:
        rows: every member's row, in set order.
        ranks: the global rank of each row.
        vary_first_dim: the first dimension may differ (allgather, alltoall).
        signature: whether a signature was compared (adds a hint to shape mismatches).
    """
    first = rows[0]
    problems = []
    for i, other in enumerate(rows[1:], start=1):
        r, r0 = ranks[i], ranks[0]
        if other[KIND] != first[KIND]:
            problems.append(f"rank {r} called another operation than rank {r0}")
        elif other[NAME] != first[NAME]:
            problems.append(f"rank {r} used another name than rank {r0}")
        elif other[EXTRA] != first[EXTRA]:
            problems.append(f"rank {r} passed another op/root rank/process set than rank {r0}")
        elif other[COUNT] != first[COUNT]:
            problems.append(
                f"rank {r} passed {other[COUNT]} tensors, rank {r0} passed {first[COUNT]}"
            )
        elif list(other[DTYPE : SHAPE + 1]) != list(first[DTYPE : SHAPE + 1]) or (
            not vary_first_dim and other[DIM0] != first[DIM0]
        ):
            problems.append(
                f"rank {r} has {describe(other)}; rank {r0} has {describe(first)}"
                + (" (or other tensor names/shapes)" if signature is not None else "")
            )
    return problems
