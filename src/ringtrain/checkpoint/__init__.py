"""Checkpoints: the handle, fsspec storage with manifests, driver-side retention."""

from ringtrain.checkpoint.checkpoint import Checkpoint

__all__ = ["Checkpoint"]
