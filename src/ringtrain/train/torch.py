"""``ray.train.torch``'s names on ringtrain: ``TorchTrainer``, ``prepare_model``,
``prepare_data_loader``, ``enable_reproducibility``, ``get_device``, ``get_devices``,
``TorchConfig``.

The functions take Ray Train's arguments and give Ray Train's results: in particular
:func:`prepare_data_loader` shards with the very sample order of Ray's ``DistributedSampler``
(seed 0, ``shuffle`` from the loader, ``set_epoch`` per epoch, no sampler at world size 1) and
leaves the loader's random numbers where a plain ``DataLoader`` draws them (the global torch
RNG), so a seeded script gives the same numbers as under Ray's ``TorchTrainer``. The price is
that a restart mid-epoch is not bit-exact: use ``ringtrain.prepare_data_loader`` and
``ringtrain.TrainState`` for that (docs/ray.md).
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from ringtrain.prepare import PreparedDataLoader, get_device
from ringtrain.prepare import prepare_data_loader as _prepare_data_loader
from ringtrain.prepare import prepare_model as _prepare_model
from ringtrain.train.torch_config import TorchConfig
from ringtrain.worker.session import get_context

if TYPE_CHECKING:
    from ringtrain.train.trainer import TorchTrainer


def get_devices() -> list[torch.device]:
    """``[get_device()]``: one device per worker."""
    return [get_device()]


def enable_reproducibility(seed: int = 0) -> None:
    """Seed torch, Python and NumPy with ``seed`` and ask torch for deterministic kernels, as
    Ray Train's ``enable_reproducibility`` does (also on every rank, with the same seed).

    Args:
        seed: the seed of ``torch``, ``random`` and ``numpy.random``.
    """
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # required by deterministic cuBLAS


def prepare_model(
    model: torch.nn.Module,
    move_to_device: bool | torch.device = True,
    parallel_strategy: str | None = "ddp",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> torch.nn.Module:
    """Ray Train's ``prepare_model``: move ``model`` to the worker's device and wrap it in
    ``DistributedDataParallel`` when there is more than one worker.

    Args:
        model: the module (identical on every rank, e.g. built after ``enable_reproducibility``).
        move_to_device: ``True``: to ``get_device()``; a ``torch.device``: to that one;
            ``False``: leave it where it is.
        parallel_strategy: ``"ddp"``, ``"fsdp"`` (ringtrain's FSDP2, docs/fsdp.md) or ``None``.
        parallel_strategy_kwargs: ``DistributedDataParallel`` arguments for ``"ddp"``.

    Raises:
        ValueError: for another ``parallel_strategy``, or ``parallel_strategy_kwargs`` with
            ``"fsdp"`` (Ray's are FSDP1 arguments: use ``ringtrain.prepare_model(model,
            parallel_strategy="fsdp", fsdp_config=ringtrain.FSDPConfig(...))``).
    """
    if parallel_strategy not in ("ddp", "fsdp", None):
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) must be 'ddp', 'fsdp' or None"
        )
    if parallel_strategy == "fsdp" and parallel_strategy_kwargs:
        raise ValueError(
            "prepare_model(parallel_strategy='fsdp', parallel_strategy_kwargs=...): ringtrain "
            "shards with FSDP2, which does not take FullyShardedDataParallel's arguments; use "
            "ringtrain.prepare_model(model, parallel_strategy='fsdp', "
            "fsdp_config=ringtrain.FSDPConfig(...))"
        )
    if isinstance(move_to_device, torch.device):
        model = model.to(move_to_device)
        move_to_device = False
    return _prepare_model(
        model,
        move_to_device=bool(move_to_device),
        parallel_strategy=parallel_strategy,
        ddp_kwargs=parallel_strategy_kwargs if parallel_strategy == "ddp" else None,
    )


def prepare_data_loader(
    data_loader: DataLoader,
    add_dist_sampler: bool = True,
    move_to_device: bool = True,
    auto_transfer: bool = True,
) -> PreparedDataLoader:
    """Ray Train's ``prepare_data_loader``: shard ``data_loader`` across the workers and move
    its batches to the worker's device.

    With more than one worker, a loader over a map-style dataset without a
    ``DistributedSampler`` gets one that yields exactly what Ray's
    ``DistributedSampler(dataset, shuffle=...)`` yields (seed 0; ``shuffle`` when the loader
    shuffled; call ``loader.sampler.set_epoch(epoch)`` each epoch, as in Ray). With one worker
    the loader's own sampler is kept (Ray adds none). The loader keeps its ``generator``
    (``None``: the global torch RNG), so dropout and the like see Ray's random numbers.

    Args:
        data_loader: the DataLoader to prepare.
        add_dist_sampler: shard with the distributed sampler (False: every rank iterates the
            loader as given).
        move_to_device: move every tensor of each batch to ``get_device()``.
        auto_transfer: accepted for Ray's signature (the copy is made on the default stream).

    Returns:
        A :class:`ringtrain.prepare.PreparedDataLoader` (``len()``, ``sampler``, ``dataset``,
        ``batch_size`` as a DataLoader; ``state_dict()`` for ``TrainState``).
    """
    del auto_transfer
    shard = (
        add_dist_sampler
        and get_context().world_size > 1
        and not isinstance(data_loader.sampler, DistributedSampler)
        and not isinstance(data_loader.dataset, IterableDataset)
    )
    return _prepare_data_loader(
        data_loader, add_dist_sampler=shard, move_to_device=move_to_device, loader_rng="global"
    )


def __getattr__(name: str) -> Any:
    # TorchTrainer pulls in the driver side (controller, launchers): loaded on first use, so that
    # a worker's `ringtrain.train.torch.prepare_model` stays light.
    if name == "TorchTrainer":
        from ringtrain.train.trainer import TorchTrainer

        return TorchTrainer
    raise AttributeError(f"module 'ringtrain.train.torch' has no attribute {name!r}")


__all__ = [
    "TorchConfig",
    "TorchTrainer",
    "enable_reproducibility",
    "get_device",
    "get_devices",
    "prepare_data_loader",
    "prepare_model",
]
