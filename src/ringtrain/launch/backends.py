"""Backends as objects: ``ScalingConfig(backend="local" | "ray")`` names one, and
:func:`backend_for` turns the name into the object that owns everything that differs between
them, so no other module asks which backend runs:

- **validation** of the :class:`~ringtrain.config.ScalingConfig` fields that only make sense for
  one backend (``placement_strategy``, ``ray_address``, ``placement_timeout_s``, custom
  ``resources_per_worker`` keys): the pure rules live in :mod:`ringtrain.config.backends`,
  which ``ScalingConfig.__post_init__`` runs before any process starts;
- the **host check** right before a run starts (``use_gpu`` on a machine without enough GPUs);
- **launching**: the :class:`~ringtrain.launch.base.Launcher` that starts the worker group
  (local processes, or Ray actors);
- **capacity**: what can run at once (this machine's cores and GPUs, or the Ray cluster's
  resources), which sweeps gang-schedule their trials against (:mod:`ringtrain.tune.resources`);
- the environment a sweep trial's workers get for their share of the GPUs.

The string stays the user-facing value (``config.json`` records it); a new backend is a new class
in :data:`BACKEND_CLASSES` (and its field rules in :mod:`ringtrain.config.backends`), not a new
branch. This module imports no launcher, torch or Ray at import time; each method imports what
it needs.
"""

from __future__ import annotations

import os
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from ringtrain.config.backends import check_backend_fields, check_backend_name

if TYPE_CHECKING:
    from ringtrain.config import ScalingConfig
    from ringtrain.launch.base import Launcher
    from ringtrain.launch.ray import RayLauncher

# Ray's bookkeeping entries in cluster_resources(), which are not schedulable resources.
_RAY_BOOKKEEPING = ("node:", "memory", "object_store_memory", "accelerator_type:")


@dataclass(frozen=True)
class Capacity:
    """What can run at once.

    Attributes:
        resources: resource name -> amount (``{"CPU": 8.0, "GPU": 2.0}``; Ray custom resources
            too).
        where: what it is the capacity of, for messages (``"this machine"``, ``"the Ray
            cluster"``).
    """

    resources: dict[str, float]
    where: str


class Backend(Protocol):
    """Where the workers of one :class:`~ringtrain.config.ScalingConfig` run.

    Attributes:
        name: the ``ScalingConfig.backend`` value.
        local_processes: the workers are child processes of the driver on this machine (what
            ``ringtrain chaos`` needs to kill them by pid).
    """

    name: ClassVar[str]
    local_processes: ClassVar[bool]

    def validate(self) -> None:
        """Reject the config's backend-specific fields (pure; no process, no Ray).

        Raises:
            ValueError: naming the field and the fix.
        """
        ...

    def check_host(self) -> None:
        """Right before a run starts: refuse what this host cannot run (ValueError)."""
        ...

    def launcher(self) -> Launcher:
        """A new launcher for the run (Ray: ImportError naming the extra when missing)."""
        ...

    def capacity(self) -> Capacity:
        """What can run at once (Ray: connects first; :meth:`close` undoes that)."""
        ...

    def close(self) -> None:
        """Release what :meth:`capacity` connected to (idempotent)."""
        ...

    def trial_env(self, gpus: Sequence[int]) -> dict[str, str]:
        """Environment for a sweep trial's workers that were given the GPUs ``gpus``."""
        ...


def local_capacity() -> dict[str, float]:
    """This host's CPU cores (the ones this process may run on) and CUDA devices."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return {"CPU": float(cpus), **_cuda_devices()}


def _cuda_devices() -> dict[str, float]:
    """``{"GPU": n}`` with this host's CUDA devices, ``{}`` without."""
    import torch  # a driver that only configures stays free of torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {"GPU": float(count)} if count else {}


def cluster_capacity(resources: dict[str, Any]) -> dict[str, float]:
    """A Ray cluster's schedulable resources from ``ray.cluster_resources()``: without Ray's
    bookkeeping entries (``node:...``, ``memory``, ``object_store_memory``,
    ``accelerator_type:...``)."""
    return {
        k: float(v)
        for k, v in resources.items()
        if not any(k == s or k.startswith(s) for s in _RAY_BOOKKEEPING)
    }


class LocalBackend:
    """``backend="local"``: worker processes on this machine
    (:class:`~ringtrain.launch.local.LocalLauncher`).

    Args:
        scaling: the run's config (its fields may not be validated yet when :meth:`validate`
            runs).
    """

    name: ClassVar[str] = "local"
    local_processes: ClassVar[bool] = True

    def __init__(self, scaling: ScalingConfig) -> None:
        self.scaling = scaling

    def validate(self) -> None:
        """Only ``CPU`` and ``GPU`` resources; the Ray-only fields at their defaults
        (:mod:`ringtrain.config.backends`).

        Raises:
            ValueError: naming the field and that it needs ``backend='ray'``.
        """
        check_backend_fields(self.scaling)

    def check_host(self) -> None:
        """With ``use_gpu``: this machine has a CUDA device for each of ``max_workers``.

        Raises:
            ValueError: naming the devices needed and found, and the fix.
        """
        s = self.scaling
        if not s.use_gpu:
            return
        available = int(_cuda_devices().get("GPU", 0))
        if available < s.max_workers:
            fix = (
                f"use num_workers<={available}, or use_gpu=False for CPU workers"
                if available
                else "use use_gpu=False: CPU workers with gloo"
            )
            raise ValueError(
                f"ScalingConfig(use_gpu=True, num_workers={s.num_workers}) needs "
                f"{s.max_workers} CUDA devices, this machine has {available or 'none'} ({fix})"
            )

    def launcher(self) -> Launcher:
        """A :class:`~ringtrain.launch.local.LocalLauncher`; with ``warm_start`` (default) it
        starts the run's warm worker pool now, so its imports overlap the driver's set-up."""
        from ringtrain.launch.local import LocalLauncher  # config imports this module

        return LocalLauncher(
            warm_start=self.scaling.warm_start,
            preload=self.scaling.preload_modules,
        )

    def capacity(self) -> Capacity:
        """This machine's cores (its CPU affinity) and CUDA devices."""
        return Capacity(local_capacity(), "this machine")

    def close(self) -> None:
        """Nothing to release."""

    def trial_env(self, gpus: Sequence[int]) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` naming ``gpus`` (concurrent trials get disjoint devices)."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus)} if gpus else {}


class RayBackend:
    """``backend="ray"``: one Ray actor per worker on a Ray cluster
    (:class:`~ringtrain.launch.ray.RayLauncher`; Ray is imported only when a method needs it).

    Args:
        scaling: the run's config (its fields may not be validated yet when :meth:`validate`
            runs).
    """

    name: ClassVar[str] = "ray"
    local_processes: ClassVar[bool] = False

    def __init__(self, scaling: ScalingConfig) -> None:
        self.scaling = scaling
        self._connected: RayLauncher | None = None

    def validate(self) -> None:
        """Custom resources are non-empty names; the Ray fields are valid values
        (:mod:`ringtrain.config.backends`).

        Raises:
            ValueError: naming the field and the fix.
        """
        check_backend_fields(self.scaling)

    def check_host(self) -> None:
        """Nothing here: the cluster's GPUs are checked when its placement group is granted
        (:class:`~ringtrain.launch.ray.PlacementError` names what is missing)."""

    def launcher(self) -> RayLauncher:
        """A :class:`~ringtrain.launch.ray.RayLauncher` for the config's cluster.

        Raises:
            ImportError: naming ``pip install 'ringtrain[ray]'`` when Ray is missing.
        """
        from ringtrain.launch.ray import RayLauncher  # Ray is optional

        return RayLauncher.from_scaling_config(self.scaling)

    def capacity(self) -> Capacity:
        """The cluster's total resources; joins (or starts) Ray first, as a run would.

        Raises:
            ImportError: naming ``pip install 'ringtrain[ray]'`` when Ray is missing.
        """
        if self._connected is None:
            self._connected = self.launcher()
            self._connected.connect()
        from ringtrain.launch.ray import import_ray

        return Capacity(cluster_capacity(import_ray().cluster_resources()), "the Ray cluster")

    def close(self) -> None:
        """Shut down the Ray instance :meth:`capacity` started, if it did (a cluster it joined,
        or Ray initialised by the caller, stays up)."""
        connected, self._connected = self._connected, None
        if connected is not None:
            connected.close()

    def trial_env(self, gpus: Sequence[int]) -> dict[str, str]:
        """Nothing: each trial's placement group reserves its GPUs and Ray assigns them."""
        return {}


BACKEND_CLASSES: Mapping[str, type[LocalBackend] | type[RayBackend]] = types.MappingProxyType(
    {LocalBackend.name: LocalBackend, RayBackend.name: RayBackend}
)
"""``ScalingConfig.backend`` value -> its class (read-only)."""

BACKENDS = tuple(BACKEND_CLASSES)
"""Launcher backends known to this version."""


def backend_for(scaling: ScalingConfig) -> Backend:
    """The backend object ``scaling.backend`` names (a new one per call).

    Raises:
        ValueError: ``scaling.backend`` is not a known backend, naming the known ones.
    """
    check_backend_name(scaling)
    return BACKEND_CLASSES[scaling.backend](scaling)
