"""How a rank that called ``hvd.join()`` serves its peers' allreduces with zeros.

A rank that calls :func:`ringtrain.horovod.join` stays in exchange rounds (see
:mod:`ringtrain.horovod.coordinator`) until every rank of the job has joined. Meanwhile, each
allreduce its peers submit is ready without it: the first participant broadcasts the
operation's layout (:func:`send_layout`: the fusion threshold, the op, each tensor's dtype and
shape, int64 only, never a pickle) and the joined rank reduces zero tensors of that layout with
the same fused allreduce (:func:`serve_zeros`), so ``Average`` divides the peers' sum by the full
size, as in Horovod. Any other operation submitted while a rank has joined raises
``RuntimeError`` on the ranks that submitted it (Horovod: "not supported with Join at this
time"); the joined rank keeps waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ringtrain.comm.fusion import ReduceOp, launch_fused_allreduce
from ringtrain.horovod.matching import Member, Ready, dtype_of
from ringtrain.horovod.metadata import PAYLOAD, dtype_code
from ringtrain.horovod.process_sets import SetView
from ringtrain.horovod.slot import runtime

if TYPE_CHECKING:
    from ringtrain.horovod.coordinator import Match

__all__ = ["layout_length", "send_layout", "serve_zeros"]


def _layout(tensors: Sequence[torch.Tensor], op: ReduceOp, threshold: int) -> list[int]:
    values = [int(threshold), int(op), len(tensors)]
    for t in tensors:
        values += [dtype_code(t.dtype), t.dim(), *t.shape]
    return values


def layout_length(tensors: Sequence[torch.Tensor]) -> int:
    """How many int64 :func:`send_layout` sends for ``tensors`` (carried in the row's
    ``PAYLOAD`` so that a joined rank knows what to receive)."""
    return 3 + sum(2 + t.dim() for t in tensors)


def send_layout(
    match: Match, view: SetView, tensors: Sequence[torch.Tensor], op: ReduceOp, threshold: int
) -> None:
    """Before an allreduce that joined ranks serve: broadcast its layout from the first
    participant (every member of the set takes part).

    Raises:
        RuntimeError: on every participant, after the broadcast, for a dtype the joined ranks
            cannot name (they skip the data collective then).
    """
    if not match.zero_fill:
        return
    values = _layout(tensors, op, threshold)
    if runtime().rank == match.src:
        buf = torch.tensor(values, dtype=torch.int64)
    else:
        buf = torch.empty(len(values), dtype=torch.int64)
    dist.broadcast(buf, src=match.src, group=view.group)
    if _decode(values) is None:
        raise RuntimeError(
            f"allreduce: rank(s) {list(match.zero_fill)} have joined and cannot contribute zeros "
            f"of dtype {[str(t.dtype) for t in tensors]}"
        )


def _decode(values: list[int]) -> tuple[int, ReduceOp, list[tuple[torch.dtype, list[int]]]] | None:
    threshold, op, count = values[:3]
    specs, at = [], 3
    for _ in range(count):
        code, ndim = values[at], values[at + 1]
        dtype = dtype_of(code)
        if dtype is None:
            return None
        specs.append((dtype, values[at + 2 : at + 2 + ndim]))
        at += 2 + ndim
    return threshold, ReduceOp(op), specs


def serve_zeros(view: SetView, members: Sequence[Member], ready: Ready) -> None:
    """On a joined rank: receive the layout of the allreduce ``ready`` and reduce zeros of it
    (the same fused collectives the participants launch), then wait for them."""
    first = members[ready.participants[0]]
    row = first.find(ready.key)
    assert row is not None
    buf = torch.empty(row[PAYLOAD], dtype=torch.int64)
    dist.broadcast(buf, src=first.rank, group=view.group)
    layout = _decode(buf.tolist())
    if layout is None:
        return  # the participants raise (send_layout)
    threshold, op, specs = layout
    device = runtime().join_device
    zeros = [torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in specs]
    launch_fused_allreduce(
        zeros, zeros, op=op, world_size=view.size, threshold_bytes=threshold, group=view.group
    ).wait()
