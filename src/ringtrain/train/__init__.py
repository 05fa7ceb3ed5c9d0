"""``ray.train``'s names on ringtrain: a Ray Train script ports by changing its imports.

::

    import ringtrain as ray                                  # was: import ray.train
    from ringtrain.train import Checkpoint, RunConfig, ScalingConfig   # was: from ray.train ...
    from ringtrain.train.torch import TorchTrainer           # was: from ray.train.torch ...

Every name here is ringtrain's own object (``ScalingConfig`` *is* ``ringtrain.ScalingConfig``),
so ported code and native ringtrain code mix freely. What Ray Train has and ringtrain does not
(Ray Data's ``get_dataset_shard``, ``SyncConfig``...) is left out or raises an error that names
the alternative; docs/ray.md lists the differences.
"""

from __future__ import annotations

from typing import Any

from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.cluster.env import DistributedContext as TrainContext
from ringtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ringtrain.result import Result, TrainingFailedError
from ringtrain.train import torch
from ringtrain.worker.session import get_checkpoint, get_context, report


def get_dataset_shard(dataset_name: str | None = None) -> Any:
    """Not available: ringtrain does not integrate Ray Data.

    Raises:
        NotImplementedError: always; build a torch ``DataLoader`` in the train function and pass
            it through ``ringtrain.train.torch.prepare_data_loader`` (it shards by rank).
    """
    raise NotImplementedError(
        f"get_dataset_shard({dataset_name!r}): ringtrain does not integrate Ray Data; build a "
        "torch DataLoader in the train function and pass it through prepare_data_loader() (it "
        "gives each rank its shard)"
    )


__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "TrainingFailedError",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
    "torch",
]
