"""Broadcasting model and optimizer state, and Python objects (``horovod.torch.functions``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.horovod.handles import _view
from ringtrain.horovod.process_sets import ProcessSet, global_process_set
from ringtrain.horovod.runtime import negotiate, runtime


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        # model.parameters() (tensors) or model.named_parameters() ((name, tensor) pairs)
        items = [
            p if isinstance(p, tuple) and len(p) == 2 else (f"param.{i}", p)
            for i, p in enumerate(params)
        ]
    else:
        raise ValueError(
            f"broadcast_parameters: params must be a state_dict, model.parameters() or "
            f"model.named_parameters(), got {type(params).__name__}"
        )
    return [(str(name), t) for name, t in items if isinstance(t, torch.Tensor)]


def broadcast_parameters(
    params: Any, root_rank: int, process_set: ProcessSet | None = global_process_set
) -> None:
    """Overwrite, in place, every rank's parameters with ``root_rank``'s.

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()``, ``model.parameters()``, or
            a list of tensors or ``(name, tensor)`` pairs; a dict is broadcast in sorted key
            order (as Horovod). Entries that are not tensors (``None``) are skipped.
        root_rank: the global rank whose values are kept.
        process_set: the ranks taking part (default: all).

    Raises:
        ValueError: on every rank, for ``root_rank`` outside the set; for ``params`` of
            another type.
        RuntimeError: on every rank, if the ranks hold different names, shapes or dtypes (one
            metadata exchange checks this before any data moves).
    """
    view = _view(process_set, "broadcast_parameters")
    tensors = _named_tensors(params)
    negotiate(
        "broadcast_parameters",
        None,
        [t for _, t in tensors],
        extra=root_rank,
        view=view,
        signature=repr([(n, str(t.dtype), tuple(t.shape)) for n, t in tensors]),
    )
    view.require_root(root_rank, "broadcast_parameters")
    if view.size == 1:
        return
    works = []
    with torch.no_grad():
        for _, t in tensors:
            target = t.data if t.is_contiguous() else t.data.contiguous()
            wire = target if target.dtype != torch.int16 else target.to(torch.int32)
            work = dist.broadcast(wire, src=root_rank, group=view.group, async_op=True)
            works.append((t, target, wire, work))
        for t, target, wire, work in works:
            work.wait()
            if wire is not target:
                target.copy_(wire)
            if target.data_ptr() != t.data_ptr():
                t.data.copy_(target)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet | None = global_process_set,
) -> Any:
    """``root_rank``'s ``obj`` (any picklable object), returned on every rank of the set.

    Only a pickle of the object travels; never call it on data from an untrusted rank.

    Raises:
        ValueError: on every rank, for ``root_rank`` outside the set.
        RuntimeError: on every rank, if the ranks pass different names or root ranks.
    """
    view = _view(process_set, "broadcast_object")
    negotiate("broadcast_object", name, [], extra=root_rank, view=view)
    view.require_root(root_rank, "broadcast_object")
    if view.size == 1:
        return obj
    box = [obj if runtime().rank == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank, group=view.group)
    return box[0]


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet | None = global_process_set
) -> list[Any]:
    """Every rank's ``obj`` (picklable), as a list in the set's rank order."""
    view = _view(process_set, "allgather_object")
    negotiate("allgather_object", name, [], view=view)
    if view.size == 1:
        return [obj]
    out: list[Any] = [None] * view.size
    dist.all_gather_object(out, obj, group=view.group)
    return out


def _initialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Horovod's initialisation of a fresh optimizer: zero gradients for the parameters that
    require grad and have none, then one local (not distributed) step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
    from ringtrain.horovod.optimizer import _DistributedOptimizer

    if isinstance(optimizer, _DistributedOptimizer):
        super(_DistributedOptimizer, optimizer).step()  # the wrapped class's step: no allreduce
    else:
        optimizer.step()


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    process_set: ProcessSet | None = global_process_set,
) -> None:
    """Make every rank's optimizer state (moments, step counts, learning rates and the other
    hyper-parameters of every param group) equal to ``root_rank``'s.

    As Horovod, an optimizer without state yet is first initialised on every rank (zero
    gradients for the parameters that require grad and have none, then one local step), so the
    state exists and gradients are tensors afterwards. Unlike Horovod, which broadcasts tensor by
    tensor, the root's ``state_dict()`` is broadcast as one object (tensors included, so
    ``LBFGS`` works too) and loaded with ``load_state_dict``.

    Raises:
        ValueError: if ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    view = _view(process_set, "broadcast_optimizer_state")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"broadcast_optimizer_state expects a torch.optim.Optimizer, got "
            f"{type(optimizer).__name__}"
        )
    if len(optimizer.state_dict()["state"]) == 0 and not isinstance(optimizer, torch.optim.LBFGS):
        _initialize_state(optimizer)  # (LBFGS's step needs a closure: its state is broadcast as is)
    if view.size == 1:
        return
    state = broadcast_object(
        optimizer.state_dict() if runtime().rank == root_rank else None,
        root_rank,
        name="optimizer_state",
        process_set=process_set,
    )
    optimizer.load_state_dict(state)
