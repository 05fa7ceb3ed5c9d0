"""64-bit fingerprints of a rank's training state: what the replica check compares.

A data-parallel replica's parameters and optimizer state are bit-identical on every rank by
construction (DDP reduces the same gradient in a fixed bucket order, and every rank applies the
same update), so two ranks whose fingerprints differ hold different bits: one of them was
corrupted. The fingerprint of a tensor is the sum, modulo 2**64, of its bytes read as integers
(the widest of int64, int32, int16, uint8 that divides its size): integer addition is
associative, so any summation order gives the same value (a vectorised or GPU reduction too),
and a single flipped bit changes exactly one word by ``±2**b``, which changes the sum. The
tensors of a state are combined in a fixed order with FNV-1a's 64-bit prime, so that the same
bytes in another tensor give another fingerprint.

The cost is one pass over the state's bytes (a few milliseconds per GiB on a GPU) and one
device-to-host copy of one integer per tensor; see docs/fault-tolerance.md, "Silent data
corruption", for what it costs per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

_PRIME = 0x100000001B3  # FNV-1a 64-bit prime
_MASK = (1 << 64) - 1
_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of the widest type that divides their size."""
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    raw = local.detach()
    if not raw.is_contiguous():
        raw = raw.contiguous()
    flat = raw.reshape(-1).view(torch.uint8)
    for dtype, size in _WORDS:
        if flat.numel() % size == 0:
            return flat.view(dtype)
    raise AssertionError("uint8 divides every size")


def tensor_sums(tensors: Iterable[torch.Tensor]) -> list[int]:
    """Each tensor's sum of words modulo 2**64 (one device-to-host copy per device)."""
    sums: list[torch.Tensor] = []
    for t in tensors:
        words = _words(t)
        if words.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=words.device))
        else:
            sums.append(words.sum(dtype=torch.int64))
    if not sums:
        return []
    by_device: dict[torch.device, list[int]] = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    values = [0] * len(sums)
    for indices in by_device.values():
        stacked = torch.stack([sums[i] for i in indices]).cpu().tolist()
        for i, v in zip(indices, stacked, strict=True):
            values[i] = int(v) & _MASK
    return values


def combine(values: Iterable[int]) -> int:
    """Fold 64-bit values into one, order-sensitive (FNV-1a over 64-bit words)."""
    h = 0xCBF29CE484222325
    for v in values:
        h = ((h ^ (v & _MASK)) * _PRIME) & _MASK
    return h


def to_signed(value: int) -> int:
    """``value`` (0 <= value < 2**64) as the int64 a tensor can carry."""
    return value - (1 << 64) if value >= 1 << 63 else value


def state_tensors(model: Any, optimizer: Any = None) -> Iterator[torch.Tensor]:
    """The tensors a replica check covers, in an order every rank shares: the (unwrapped)
    model's parameters and buffers by name, then the optimizer's state tensors by parameter
    index and state name (``optimizer.state_dict()``), and the GradScaler's scale if any."""
    module = getattr(model, "module", model)  # DDP keeps the user's module as .module
    for _name, p in module.named_parameters():
        yield p
    for _name, b in module.named_buffers():
        yield b
    if optimizer is None:
        return
    inner = getattr(optimizer, "optimizer", optimizer)  # a PreparedOptimizer wraps one
    state = inner.state_dict().get("state", {})
    for index in sorted(state):
        entry = state[index]
        for key in sorted(entry):
            value = entry[key]
            if isinstance(value, torch.Tensor):
                yield value
            elif isinstance(value, (int, float)):
                yield torch.tensor([float(value)], dtype=torch.float64)
    scaler = getattr(optimizer, "grad_scaler", None)
    scale = getattr(scaler, "_scale", None)
    if isinstance(scale, torch.Tensor):
        yield scale


def fingerprint(tensors: Iterable[torch.Tensor]) -> int:
    """The 64-bit fingerprint (an unsigned int) of ``tensors`` (any shapes, dtypes, devices).

    Raises:
        TypeError: an element is not a tensor.
    """
    return combine(tensor_sums(tensors))
