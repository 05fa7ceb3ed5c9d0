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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ringtrain.state import RANK_STATE_ATTR, _unwrap, attach_rank_state

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
    registry = getattr(_unwrap(model), RANK_STATE_ATTR, None) or {}
    found = registry.get(_NAME)
    if found is None:
        found = AccumulationState(_unwrap(model))
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
