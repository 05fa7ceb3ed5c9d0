"""ringtrain: scale one PyTorch training function to N data-parallel workers.

The public API; nothing outside this list is public::

    Trainer, Result, TrainingFailedError, WorkerFailure, NoValidCheckpointError
    warm_pool, WarmPool                              (one warm worker pool for several fits)
    ScalingConfig, RunConfig, CheckpointConfig, FailureConfig, MonitorConfig
    get_context, report, get_checkpoint, Checkpoint
    prepare_model, prepare_data_loader, get_device, TrainState
    prepare_optimizer, backward, accumulate          (mixed precision, gradient accumulation)
    FSDPConfig, export_model                         (sharded data parallelism, export)
    DDPStrategy, FSDPStrategy                        (prepare_model(strategy=...))
    ParallelConfig, ParallelStrategy                 (device mesh: HSDP, tensor parallelism)
    DiLoCoConfig, DiLoCoStrategy                     (low-communication training, slow links)
    TensorBoardCallback, CSVCallback, MLflowCallback, WandbCallback   (logging callbacks)
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

# Worker-side and config names are light; the driver and torch-dependent parts load on first use
# so that `import ringtrain` in a worker or in the CLI stays fast.
from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.cluster.env import DistributedContext
from ringtrain.config import (
    CheckpointConfig,
    FailureConfig,
    MonitorConfig,
    RunConfig,
    ScalingConfig,
)
from ringtrain.config.diloco import DiLoCoConfig
from ringtrain.config.parallel import ParallelConfig
from ringtrain.result import Result, TrainingFailedError, WorkerFailure
from ringtrain.worker.session import get_checkpoint, get_context, report

if TYPE_CHECKING:
    from ringtrain.checkpoint.manager import NoValidCheckpointError
    from ringtrain.export import export_model
    from ringtrain.launch.shared_pool import WarmPool, warm_pool
    from ringtrain.monitor.integrations import MLflowCallback, WandbCallback
    from ringtrain.monitor.sinks import CSVCallback, TensorBoardCallback
    from ringtrain.parallel import DDPStrategy, FSDPStrategy, ParallelStrategy
    from ringtrain.parallel.deepspeed import prepare_deepspeed
    from ringtrain.parallel.diloco import DiLoCoStrategy
    from ringtrain.parallel.fsdp import FSDPConfig
    from ringtrain.parallel.pipeline import prepare_pipeline
    from ringtrain.prepare import get_device, prepare_data_loader, prepare_model
    from ringtrain.trainer import Trainer
    from ringtrain.worker.accumulate import accumulate
    from ringtrain.worker.precision import backward, prepare_optimizer
    from ringtrain.worker.state import TrainState

_LAZY = {
    "Trainer": "ringtrain.trainer",
    "NoValidCheckpointError": "ringtrain.checkpoint.manager",
    "warm_pool": "ringtrain.launch.shared_pool",
    "WarmPool": "ringtrain.launch.shared_pool",
    "prepare_model": "ringtrain.prepare",
    "prepare_data_loader": "ringtrain.prepare",
    "get_device": "ringtrain.prepare",
    "TrainState": "ringtrain.worker.state",
    "FSDPConfig": "ringtrain.parallel.fsdp",
    "DDPStrategy": "ringtrain.parallel",
    "FSDPStrategy": "ringtrain.parallel",
    "ParallelStrategy": "ringtrain.parallel",
    "DiLoCoStrategy": "ringtrain.parallel.diloco",
    "prepare_pipeline": "ringtrain.parallel.pipeline",
    "prepare_deepspeed": "ringtrain.parallel.deepspeed",
    "export_model": "ringtrain.export",
    "accumulate": "ringtrain.worker.accumulate",
    "backward": "ringtrain.worker.precision",
    "prepare_optimizer": "ringtrain.worker.precision",
    "TensorBoardCallback": "ringtrain.monitor.sinks",
    "CSVCallback": "ringtrain.monitor.sinks",
    "MLflowCallback": "ringtrain.monitor.integrations",
    "WandbCallback": "ringtrain.monitor.integrations",
}

__all__ = [
    "CSVCallback",
    "Checkpoint",
    "CheckpointConfig",
    "DDPStrategy",
    "DiLoCoConfig",
    "DiLoCoStrategy",
    "DistributedContext",
    "FSDPConfig",
    "FSDPStrategy",
    "FailureConfig",
    "MLflowCallback",
    "MonitorConfig",
    "NoValidCheckpointError",
    "ParallelConfig",
    "ParallelStrategy",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TensorBoardCallback",
    "TrainState",
    "Trainer",
    "TrainingFailedError",
    "WandbCallback",
    "WarmPool",
    "WorkerFailure",
    "__version__",
    "accumulate",
    "backward",
    "export_model",
    "get_checkpoint",
    "get_context",
    "get_device",
    "prepare_data_loader",
    "prepare_deepspeed",
    "prepare_model",
    "prepare_optimizer",
    "prepare_pipeline",
    "report",
    "warm_pool",
]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed package's metadata: pyproject.toml's version
        from ringtrain.rundir.saved_run import installed_version

        return installed_version()
    if name == "train":  # ray.train's names (`import ringtrain as ray` ports Ray Train scripts)
        import importlib

        return importlib.import_module("ringtrain.train")
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ringtrain' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """The ``ringtrain`` package object. Importing a submodule sets it as an attribute of its
    package, so importing ``ringtrain.worker.accumulate`` (the module) anywhere would replace the
    lazy function ``rt.accumulate`` with the module of the same name; such a submodule attribute is
    not set (the module stays in ``sys.modules``; ``from ringtrain.worker.accumulate import X``
    works)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple[Callable[[str], types.ModuleType], tuple[str]]:
        # A module subclass is not in pickle's or cloudpickle's table of modules: without this, a
        # train_fn that names ``rt`` could not be pickled. By reference, as any module: the
        # worker imports ``ringtrain`` itself.
        return importlib.import_module, (self.__name__,)


sys.modules[__name__].__class__ = _Package
