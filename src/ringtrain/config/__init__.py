"""Every user-facing configuration, frozen and validated before any process starts.

``from ringtrain.config import ScalingConfig, RunConfig, ...`` (also ``rt.ScalingConfig``):

- :mod:`ringtrain.config.run`: :class:`ScalingConfig`, :class:`RunConfig`,
  :class:`CheckpointConfig`;
- :mod:`ringtrain.config.failure`: :class:`FailureConfig`;
- :mod:`ringtrain.config.monitor`: :class:`MonitorConfig`;
- :mod:`ringtrain.config.parallel`: :class:`ParallelConfig` (the device mesh);
- :mod:`ringtrain.config.diloco`: :class:`DiLoCoConfig` (low-communication training);
- :mod:`ringtrain.config.fsdp`: ``FSDPConfig`` (not imported here: it needs torch);
- the pure rules the configs validate with: :mod:`~ringtrain.config.backends` (backend-specific
  fields), :mod:`~ringtrain.config.replica_groups` (elastic resizing on a mesh),
  :mod:`~ringtrain.config.validation` (errors that name the field and the fix).

The config layer is the bottom of the package: it imports no launcher, no controller, no worker
code and no torch (checked by the import contracts in ``pyproject.toml``).
"""

from ringtrain.config.diloco import DiLoCoConfig
from ringtrain.config.failure import FailureConfig
from ringtrain.config.monitor import MonitorConfig
from ringtrain.config.parallel import ParallelConfig
from ringtrain.config.run import (
    CALLBACK_HOOKS,
    ELASTIC_BATCH_POLICIES,
    CheckpointConfig,
    RunConfig,
    ScalingConfig,
)

__all__ = [
    "CALLBACK_HOOKS",
    "ELASTIC_BATCH_POLICIES",
    "CheckpointConfig",
    "DiLoCoConfig",
    "FailureConfig",
    "MonitorConfig",
    "ParallelConfig",
    "RunConfig",
    "ScalingConfig",
]
