"""``hvd.join()``: a rank with no more data serves its peers' allreduces with zeros.

A rank that calls :func:`join` stays in exchange rounds (see
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
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ringtrain.comm.fusion import ReduceOp, launch_fused_allreduce
from ringtrain.horovod.matching import Member, Ready, dtype_of
from ringtrain.horovod.metadata import PAYLOAD, dtype_code
from ringtrain.horovod.process_sets import SetView
from ringtrain.horovod.slot import runtime

if TYPE_CHECKING:
    from ringtrain.horovod.coordinator import Match

__all__ = ["join", "layout_length", "send_layout", "serve_zeros"]


def join(device: int = -1) -> int:
    """Declare that this rank has no more data; return the rank that joined last.

    Until every rank has joined, this rank takes part in its peers' allreduces with zero tensors
    (``Average`` divides by the full size); any other collective its peers submit meanwhile
    raises ``RuntimeError`` on them (Horovod's rule). ``DistributedOptimizer`` reduces its
    gradients without this exchange: do not join while peers still step one.

    Args:
        device: the CUDA device for the zero tensors (``-1``: the process group's device, CUDA
            ``local_rank()`` under NCCL, else CPU).

    Returns:
        The global rank that called ``join()`` last (the highest of those that joined in the
        same round), the same on every rank; 0 in a single process.

    Raises:
        HorovodInternalError: if a peer is gone.
    """
    from ringtrain.horovod.coordinator import submit, wait

    rt = runtime()
    if rt.size == 1:
        return 0
    if device >= 0:
        rt.join_device = torch.device("cuda", device)
    elif dist.is_initialized() and dist.get_backend() == "nccl":
        rt.join_device = torch.device("cuda", rt.ctx.local_rank)
    else:
        rt.join_device = torch.device("cpu")
    rt.join_age = 0
    try:
        request = submit("join", None, [], _never, rt.set_view(None), blocking=True)
        return int(wait(request))
    finally:
        rt.join_age = -1


def _never(match: Match) -> Any:
    raise AssertionError("a join entry is completed by the round plan, never launched")


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
