"""Broadcasting model and optimizer state, and Python objects (``horovod.torch.functions``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.fusion import check_same_layout
from ringtrain.horovod.ops import _check_process_set
from ringtrain.horovod.runtime import runtime


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite, in place, every rank's parameters with ``root_rank``'s.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, or a list of
            ``(name, tensor)`` pairs; a dict is broadcast in sorted key order (as Horovod).
        root_rank: the rank whose values are kept.

    Raises:
        ValueError: for ``root_rank`` out of range, or ``params`` of another type.
        RuntimeError: on every rank, if the ranks hold different names, shapes or dtypes (one
            ``all_gather`` of a 16-byte digest checks this before any data moves).
    """
    _check_process_set(process_set)
    rt = runtime()
    if not 0 <= root_rank < rt.size:
        raise ValueError(f"root_rank={root_rank} is outside [0, size()={rt.size})")
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
    else:
        raise ValueError(
            f"broadcast_parameters: params must be a state_dict or (name, tensor) pairs, got "
            f"{type(params).__name__}"
        )
    tensors = [(name, t) for name, t in items if isinstance(t, torch.Tensor)]
    check_same_layout(
        [(name, t.dtype, t.shape) for name, t in tensors], "broadcast_parameters", rt.size
    )
    if rt.size == 1:
        return
    works = []
    with torch.no_grad():
        for _, t in tensors:
            target = t.data if t.is_contiguous() else t.data.contiguous()
            works.append((t, target, dist.broadcast(target, src=root_rank, async_op=True)))
        for t, target, work in works:
            work.wait()
            if target.data_ptr() != t.data_ptr():
                t.data.copy_(target)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None
) -> Any:
    """``root_rank``'s ``obj`` (any picklable object), returned on every rank.

    Only a pickle of the object travels; never call it on data from an untrusted rank.
    """
    _check_process_set(process_set)
    rt = runtime()
    if not 0 <= root_rank < rt.size:
        raise ValueError(f"root_rank={root_rank} is outside [0, size()={rt.size})")
    if rt.size == 1:
        return obj
    box = [obj if rt.rank == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), as a list in rank order."""
    _check_process_set(process_set)
    rt = runtime()
    if rt.size == 1:
        return [obj]
    out: list[Any] = [None] * rt.size
    dist.all_gather_object(out, obj)
    return out


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: Any = None
) -> None:
    """Make every rank's optimizer state (moments, step counts, learning rates and the other
    hyper-parameters of every param group) equal to ``root_rank``'s.

    Unlike Horovod, which broadcasts tensor by tensor after a dummy step, the root's
    ``state_dict()`` is broadcast as one object (tensors included) and loaded with
    ``load_state_dict``; an optimizer without state yet (before its first step) stays empty.

    Raises:
        ValueError: if ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    _check_process_set(process_set)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"broadcast_optimizer_state expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if runtime().size == 1:
        return
    state = broadcast_object(
        optimizer.state_dict() if runtime().rank == root_rank else None, root_rank
    )
    optimizer.load_state_dict(state)
