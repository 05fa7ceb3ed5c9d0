"""Gradient compression for the wire: cast to a 16-bit float before the allreduce, back after.

The interface is Horovod's (``horovod/torch/compression.py``): a compressor has
``compress(tensor) -> (tensor_on_the_wire, ctx)`` and ``decompress(tensor, ctx) -> tensor``.
Casting halves the bytes sent; the sum itself is then computed in the wire dtype (as Horovod and
DDP's ``fp16_compress_hook`` do), so fp16 can overflow above 65504 and bf16 keeps 8 bits of
mantissa. Only floating tensors are cast; integer tensors pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BF16Compressor", "Compression", "Compressor", "FP16Compressor", "NoneCompressor"]


class Compressor:
    """Casts a tensor for the wire and back (no-op base class).

    Attributes:
        wire_dtype: the dtype floating tensors travel in, or ``None`` for unchanged.
    """

    wire_dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Return ``(tensor for the wire, ctx)``; ``ctx`` is the original dtype."""
        dtype = cls.wire_dtype
        if dtype is None or not tensor.is_floating_point() or tensor.dtype == dtype:
            return tensor, None
        return tensor.to(dtype), tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Cast ``tensor`` back to the dtype recorded in ``ctx`` (``None``: unchanged)."""
        return tensor if ctx is None else tensor.to(ctx)

    @classmethod
    def wire_dtype_for(cls, dtype: torch.dtype) -> torch.dtype:
        """The dtype a tensor of ``dtype`` travels in."""
        if cls.wire_dtype is None or not dtype.is_floating_point:
            return dtype
        return cls.wire_dtype


class NoneCompressor(Compressor):
    """No compression: tensors travel in their own dtype."""


class FP16Compressor(Compressor):
    """Floating tensors travel as IEEE half precision (2 bytes per element)."""

    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Floating tensors travel as bfloat16 (2 bytes per element, fp32's exponent range)."""

    wire_dtype = torch.bfloat16


class Compression:
    """The compressors by name, as ``horovod.torch.Compression``: ``none``, ``fp16``, ``bf16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def resolve(compression: Any) -> type[Compressor]:
    """A compressor class from a class, an instance, ``None`` or a name (``"fp16"``...).

    Raises:
        ValueError: for an unknown name or object.
    """
    if compression is None:
        return NoneCompressor
    if isinstance(compression, str):
        found = getattr(Compression, compression.lower(), None)
        if found is None:
            raise ValueError(
                f"compression={compression!r} is not known (use 'none', 'fp16' or 'bf16')"
            )
        return found
    if isinstance(compression, type) and issubclass(compression, Compressor):
        return compression
    if isinstance(compression, Compressor):
        return type(compression)
    if hasattr(compression, "compress") and hasattr(compression, "decompress"):
        raise ValueError(
            "custom compressors are not supported by the fused allreduce (it needs the wire "
            "dtype up front); use Compression.none, Compression.fp16 or Compression.bf16"
        )
    raise ValueError(f"compression={compression!r} is not a Compressor")
