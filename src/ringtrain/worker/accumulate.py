"""Gradient accumulation without needless allreduces.

``rt.accumulate(model, steps)`` wraps each micro-step's forward and backward. On all but every
``steps``-th micro-step it runs them under DDP's ``no_sync()``: gradients accumulate locally and
nothing goes on the wire; the last micro-step of the group allreduces the accumulated sum once
(as Accelerate's ``accumulate(model)`` and Lightning Fabric's ``no_backward_sync``)::

    for x, y in loader:
        with rt.accumulate(model, 4) as sync:
            loss = loss_fn(model(x), y) / 4   # the mean over the 4 micro-batches
            rt.backward(loss)
        if sync:
            optimizer.step()
            optimizer.zero_grad()

The count of micro-steps since the last allreduce is kept on the model, and TrainState saves it
in each rank's file together with the partial (not yet allreduced, so per-rank) gradients when a
checkpoint falls inside a group: a resume mid-accumulation continues the group bit-exactly.

:func:`split_batch` and :func:`micro_batches` cut one step's batch into weighted micro-batches
run under :func:`accumulate` (``PreparedDataLoader.micro_batches``; an elastic run's
``elastic_batch_policy="accumulate"``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ringtrain.worker.state_files import RANK_STATE_ATTR, attach_rank_state, unwrap

_NAME = "accumulation"


class AccumulationState:
    """The micro-step counter of one prepared model, as a (per-rank) Stateful object.

    Attributes:
        micro_step: micro-steps run since the last allreduce (0 at a group boundary).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.micro_step = 0

    def state_dict(self) -> dict[str, Any]:
        """``{"micro_step", "grads"}``: ``grads`` holds each parameter's gradient (or None)
        inside a group, and is empty at a group boundary."""
        grads: list[Any] = []
        if self.micro_step:
            grads = [
                p.grad.detach() if p.grad is not None else None for p in self.module.parameters()
            ]
        return {"micro_step": self.micro_step, "grads": grads}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counter, and the partial gradients saved inside a group.

        Raises:
            ValueError: if the saved gradients do not match the model's parameters.
        """
        self.micro_step = int(state["micro_step"])
        grads = state.get("grads") or []
        if not grads:
            return
        params = list(self.module.parameters())
        if len(grads) != len(params):
            raise ValueError(
                f"cannot resume gradient accumulation: the checkpoint has {len(grads)} partial "
                f"gradients, the model has {len(params)} parameters"
            )
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.to(device=p.device, dtype=p.dtype).clone()


def _state_of(model: torch.nn.Module) -> AccumulationState:
    registry = getattr(unwrap(model), RANK_STATE_ATTR, None) or {}
    found = registry.get(_NAME)
    if found is None:
        found = AccumulationState(unwrap(model))
        attach_rank_state(model, _NAME, found)
    return found


@contextlib.contextmanager
def accumulate(model: torch.nn.Module, steps: int) -> Iterator[bool]:
    """Run one micro-step; allreduce gradients only on every ``steps``-th.

    Args:
        model: the model returned by :func:`ringtrain.prepare_model` (DDP-wrapped or not; without
            DDP only the counting applies).
        steps: micro-steps per optimizer step (the accumulation factor), >= 1.

    Yields:
        ``sync``: True on the micro-step that allreduces (the last of its group): step the
        optimizer after it. False inside a group.

    Raises:
        ValueError: if ``steps`` is not an integer >= 1.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"accumulate(model, steps={steps!r}): steps must be an integer >= 1 (the number "
            "of micro-batches per optimizer step)"
        )
    state = _state_of(model)
    sync = state.micro_step + 1 >= steps
    if sync or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        yield sync
    else:
        with model.no_sync():
            yield sync
    state.micro_step = 0 if sync else state.micro_step + 1


def batch_length(batch: Any) -> int | None:
    """Samples in ``batch``: dim 0 of its first tensor (nested in tuples, lists, dicts)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, Mapping):
        items: Any = batch.values()
    elif isinstance(batch, (list, tuple)):
        items = batch
    else:
        return None
    for item in items:
        found = batch_length(item)
        if found is not None:
            return found
    return None


def _slice(value: Any, start: int, stop: int, n: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.dim() and value.shape[0] == n else value
    if isinstance(value, Mapping):
        return type(value)({k: _slice(v, start, stop, n) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_slice(v, start, stop, n) for v in value))
    if isinstance(value, (list, tuple)):
        nested = any(isinstance(v, (torch.Tensor, Mapping, list, tuple)) for v in value)
        if len(value) == n and not nested:
            return type(value)(value[start:stop])  # a collated list of strings, ids...
        return type(value)(_slice(v, start, stop, n) for v in value)
    return value


def split_batch(batch: Any, max_size: int) -> list[tuple[Any, float]]:
    """``batch`` cut along dim 0 into ``ceil(n / max_size)`` nearly equal micro-batches (sizes
    differ by at most one, larger first), each with its weight ``len(micro) / n`` (pure).

    Tensors whose dim 0 is the batch length are sliced, as are collated lists of that length
    (of strings, numbers); everything else (scalars, other tensors) is repeated in each part.

    Args:
        batch: a tensor, or tuples, lists and dicts of them.
        max_size: the largest micro-batch (samples, >= 1).

    Returns:
        ``[(micro_batch, weight), ...]``; ``[(batch, 1.0)]`` when ``n <= max_size`` or ``batch``
        has no tensor with a batch dimension.

    Raises:
        ValueError: ``max_size`` < 1.
    """
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise ValueError(f"micro_batches: max_size must be an integer >= 1, got {max_size!r}")
    n = batch_length(batch)
    if n is None or n <= max_size:
        return [(batch, 1.0)]
    parts = -(-n // max_size)
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append((_slice(batch, start, start + size, n), size / n))
        start += size
    return out


def micro_batches(batch: Any, model: Any, max_size: int | None) -> Iterator[tuple[Any, float]]:
    """Yield ``(micro_batch, weight)`` for each part of :func:`split_batch`; the caller runs the
    forward and ``(loss * weight).backward()`` of each before taking the next. With a DDP
    ``model``, all but the last run under ``no_sync()`` (through
    :func:`ringtrain.accumulate`), so the gradients are allreduced once per step.
    ``max_size=None``: ``batch`` whole."""
    parts = [(batch, 1.0)] if max_size is None else split_batch(batch, max_size)
    if model is None:
        yield from parts
        return
    for part in parts:
        with accumulate(model, len(parts)):
            yield part
