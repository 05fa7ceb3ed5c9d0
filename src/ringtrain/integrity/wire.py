"""Tensors from one rank to another for the replay check, without a pickle.

gloo's point-to-point messages are not authenticated, so nothing received is unpickled: a
fixed two-integer header (the number of tensors, the length of the description), a JSON
description (``meta``, and each tensor's dtype and shape: JSON cannot run code), then each
tensor's bytes into a tensor allocated from its description. Every tensor travels on the CPU.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = {
    str(d): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
MAX_DESCRIPTION = 1 << 20
"""The longest description accepted (bytes): a peer's header cannot make this rank allocate
more."""


def pack(tensors: list[torch.Tensor], meta: dict[str, Any]) -> bytes:
    """The JSON description of ``tensors`` (dtypes and shapes) and ``meta``."""
    described = [{"dtype": str(t.dtype), "shape": list(t.shape)} for t in tensors]
    return json.dumps({"meta": meta, "tensors": described}).encode()


def send_tensors(tensors: list[torch.Tensor], meta: dict[str, Any], dst: int, group: Any) -> None:
    """Send ``tensors`` and ``meta`` to rank ``dst`` (its :func:`recv_tensors` takes them)."""
    cpu = [t.detach().cpu().contiguous() for t in tensors]
    description = pack(cpu, meta)
    header = torch.tensor([len(cpu), len(description)], dtype=torch.int64)
    dist.send(header, dst=dst, group=group)
    dist.send(torch.frombuffer(bytearray(description), dtype=torch.uint8), dst=dst, group=group)
    for t in cpu:
        if t.numel():
            dist.send(t, dst=dst, group=group)


def recv_tensors(src: int, group: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """What rank ``src`` sent with :func:`send_tensors`.

    Raises:
        ValueError: a description that is too long, not JSON, or names an unknown dtype.
    """
    header = torch.empty(2, dtype=torch.int64)
    dist.recv(header, src=src, group=group)
    count, length = (int(v) for v in header)
    if not 0 <= length <= MAX_DESCRIPTION or count < 0:
        raise ValueError(f"replay check: a peer sent a header of {count} tensors, {length} bytes")
    raw = torch.empty(length, dtype=torch.uint8)
    dist.recv(raw, src=src, group=group)
    described = json.loads(bytes(raw.numpy()).decode())
    specs = described.get("tensors", [])
    if not isinstance(specs, list) or len(specs) != count:
        raise ValueError("replay check: a peer's description does not match its header")
    tensors = []
    for spec in specs:
        dtype = _DTYPES.get(spec.get("dtype"))
        shape = spec.get("shape")
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(isinstance(n, int) for n in shape)
        ):
            raise ValueError(f"replay check: a peer described a tensor as {spec!r}")
        t = torch.empty(shape, dtype=dtype)
        if t.numel():
            dist.recv(t, src=src, group=group)
        tensors.append(t)
    meta = described.get("meta", {})
    return tensors, meta if isinstance(meta, dict) else {}
