"""``FashionMNIST`` and ``MNIST`` with torchvision's signature, synthetic and seeded.

``TORCHVISION_STUB_SAMPLES`` (default 256) sets the training split's size; the test split has a
quarter of it. Each class has a fixed random 28x28 pattern; a sample is its class's pattern plus
noise, so a model can learn it. The patterns depend only on the class name, the samples on the
class name, the split and the size (a private generator: the global torch RNG is not touched).
``root`` and ``download`` are accepted and ignored: nothing is read or written.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable
from typing import Any

import torch


class _Synthetic(torch.utils.data.Dataset):
    classes: list[str] = [str(i) for i in range(10)]

    def __init__(
        self,
        root: str | None = None,
        train: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        download: bool = False,
    ) -> None:
        size = int(os.environ.get("TORCHVISION_STUB_SAMPLES", "256"))
        if not train:
            size = max(size // 4, 1)
        name = type(self).__name__
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        patterns = torch.rand(10, 28, 28, generator=g) * 160  # the same in both splits
        g.manual_seed(zlib.crc32(f"{name}:{train}:{size}".encode()))
        self.targets = torch.randint(0, 10, (size,), generator=g)
        noise = torch.rand(size, 28, 28, generator=g) * 95
        self.data = (patterns[self.targets] + noise).to(torch.uint8)
        self.train = train
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        img: Any = self.data[index].numpy()
        target: Any = int(self.targets[index])
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target


class FashionMNIST(_Synthetic):
    """Stand-in for ``torchvision.datasets.FashionMNIST``."""


class MNIST(_Synthetic):
    """Stand-in for ``torchvision.datasets.MNIST``."""
