"""Bit flips on purpose: to test the corruption checks, and for users who want to verify them
on their own model (docs/fault-tolerance.md, "Silent data corruption").

Inside a train function, on the rank to corrupt::

    from ringtrain.integrity.inject import inject_bitflip

    if rt.get_context().world_rank == 1:
        inject_bitflip("param", step=7)            # one flipped bit after step 7
        inject_bitflip("gradient", step=20, every=True)   # a consistently faulty core

``where``:

- ``"param"``: a bit of the first parameter of the ``TrainState``'s model, right after
  ``TrainState.step`` reaches ``step`` (what a flipped bit in memory does);
- ``"optimizer"``: a bit of the first optimizer state tensor (e.g. a momentum buffer);
- ``"gradient"``: a bit of this rank's *local* gradient of the first parameter during the next
  backward (before DDP's allreduce spreads it to every replica: what a miscomputing core does;
  the replica check cannot see it, the replay check can);
- ``"global"``: a bit of the first global parameter of a model prepared with DiLoCo
  (``parallel_strategy="diloco"``), which every replica holds alike.

``every=True`` corrupts again at every step from ``step`` on. The bit (default 20: a float32's
high mantissa bits, a change of about 12 % of the value, silent: no NaN, no inf) is flipped in
element ``index`` of the tensor's raw words. Each flip is logged on the worker's stderr.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ringtrain.worker.hooks import StepState, WorkerPlugin
from ringtrain.worker.session import current_hooks

logger = logging.getLogger("ringtrain")

WHERE = ("param", "optimizer", "gradient", "global")
"""What :func:`inject_bitflip` can corrupt."""


def flip_bit(tensor: torch.Tensor, bit: int, index: int = 0) -> None:
    """Flip bit ``bit`` of element ``index`` of ``tensor``'s raw 32-bit words, in place
    (``tensor``: any floating dtype, contiguous; a DTensor's local shard).

    Raises:
        ValueError: ``bit`` outside 0..31, or ``index`` outside the tensor.
    """
    if not 0 <= bit < 32:
        raise ValueError(f"bit must be in 0..31, got {bit}")
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    words = local.detach().reshape(-1).view(torch.uint8)
    words = words[: words.numel() - words.numel() % 4].view(torch.int32)
    if not 0 <= index < words.numel():
        raise ValueError(f"index {index} is outside a tensor of {words.numel()} words")
    with torch.no_grad():
        words[index] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)


class BitFlip(WorkerPlugin):
    """The plug-in :func:`inject_bitflip` registers (see the module docs)."""

    def __init__(self, where: str, step: int, every: bool, bit: int, index: int) -> None:
        self.where = where
        self.step = step
        self.every = every
        self.bit = bit
        self.index = index
        self.flips = 0
        self._armed = False

    def on_step(self, state: StepState) -> None:
        step = int(state.step)
        due = step == self.step or (self.every and step >= self.step)
        if not due or (not self.every and self.flips):
            return
        model = _get(state, "model")
        if model is None:
            return
        module = getattr(model, "module", model)
        if self.where == "param":
            flip_bit(next(module.parameters()), self.bit, self.index)
            self._flipped(step)
        elif self.where == "global":
            from ringtrain.parallel.diloco import outer_sync  # raises for a model without it

            flip_bit(outer_sync(model).global_params[0], self.bit, self.index)
            self._flipped(step)
        elif self.where == "optimizer":
            tensors = _optimizer_tensors(_get(state, "optimizer"))
            if tensors:
                flip_bit(tensors[0], self.bit, self.index)
                self._flipped(step)
        elif not self._armed:  # gradient: corrupt the local gradient of the next backward
            self._armed = True
            param = next(p for p in module.parameters() if p.requires_grad)
            param.register_hook(self._corrupt_gradient(step))

    def _corrupt_gradient(self, armed_at: int) -> Any:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            if not self.every and self.flips:
                return grad
            corrupted = grad.clone()
            flip_bit(corrupted, self.bit, self.index)
            self._flipped(armed_at + 1 if not self.every else -1)
            return corrupted

        return hook

    def _flipped(self, step: int) -> None:
        self.flips += 1
        where = f"after step {step}" if step >= 0 else "in a backward"
        logger.warning("injected a bit flip (bit %d) into the %s %s", self.bit, self.where, where)


def inject_bitflip(
    where: str, step: int, *, every: bool = False, bit: int = 20, index: int = 0
) -> BitFlip:
    """Corrupt this rank's state on purpose (see the module docs); call it in the train function
    of the rank to corrupt, before the loop.

    Args:
        where: ``"param"``, ``"optimizer"``, ``"gradient"`` or ``"global"`` (DiLoCo).
        step: the ``TrainState.step`` at which the (first) flip happens (>= 1).
        every: flip again at every later step (a consistently faulty device).
        bit: which bit of the 32-bit word (0..31).
        index: which word of the tensor.

    Returns:
        The registered plug-in (its ``flips`` counts the flips made).

    Raises:
        ValueError: an unknown ``where``, a ``step`` below 1, or a bad ``bit``.
    """
    if where not in WHERE:
        raise ValueError(f"inject_bitflip(where={where!r}) must be one of {', '.join(WHERE)}")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"inject_bitflip(step={step!r}) must be a step >= 1")
    if not 0 <= bit < 32:
        raise ValueError(f"inject_bitflip(bit={bit!r}) must be in 0..31")
    plugin = BitFlip(where, step, every, bit, index)
    current_hooks().register(plugin)
    return plugin


def _get(state: object, name: str) -> Any:
    try:
        return state[name]  # type: ignore[index]
    except (KeyError, TypeError):
        return None


def _optimizer_tensors(optimizer: Any) -> list[torch.Tensor]:
    inner = getattr(optimizer, "optimizer", optimizer)
    state = getattr(inner, "state", {})
    found: list[torch.Tensor] = []
    for group in getattr(inner, "param_groups", []):
        for p in group["params"]:
            found += [v for v in state.get(p, {}).values() if isinstance(v, torch.Tensor)]
    return [t for t in found if t.is_floating_point() and t.numel() > 0]
