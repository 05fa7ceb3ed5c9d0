"""``ToTensor``, ``Normalize`` and ``Compose`` as torchvision's, for uint8 HxW images."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class ToTensor:
    """uint8 image of shape (H, W) or (H, W, C) -> float32 tensor (C, H, W) in [0, 1]."""

    def __call__(self, pic: Any) -> torch.Tensor:
        t = torch.as_tensor(pic)
        if t.ndim == 2:
            t = t.unsqueeze(-1)
        return t.permute(2, 0, 1).contiguous().to(torch.float32).div(255)


class Normalize:
    """``(x - mean) / std`` per channel."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return (t - self.mean) / self.std


class Compose:
    """Apply ``transforms`` in order."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x
