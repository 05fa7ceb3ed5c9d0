"""Test-only stand-in for torchvision (see tests/stubs/README.md): no downloads, no images."""

from . import datasets, transforms

__all__ = ["datasets", "transforms"]
__version__ = "0.0.0+ringtrain.stub"
