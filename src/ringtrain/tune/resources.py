"""Gang scheduling of sweep trials: what a trial needs, what the machine (or cluster) has, and
which trials may start now.

A trial is an N-worker training run. It starts only when **all** its workers fit in the free
capacity at once (gang scheduling): starting some of its workers and waiting for the rest would
hold resources while doing nothing, and two half-started trials can wait on each other forever.
Ray Tune leaves this to the user (``max_concurrent_trials``); here the pool does it:

- the capacity is the backend's (:meth:`ringtrain.launch.backends.Backend.capacity`): the local
  backend's is this host's CPU cores and CUDA devices (override with
  ``TuneConfig(resources=...)``); on Ray it is the cluster's resources, and each trial's workers
  are reserved together by the trial's own placement group (all bundles or none), so the
  driver's accounting and Ray's reservation agree.

Pure bookkeeping, no processes: unit-tested directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Resources small enough to compare with a tolerance (Ray reports fractional CPUs).
_EPS = 1e-9


def trial_demand(scaling: Any) -> dict[str, float]:
    """What one trial of ``scaling`` (a :class:`~ringtrain.config.ScalingConfig`) holds while it
    runs: ``max_workers`` times each worker's share.

    A worker's share is ``resources_per_worker`` when given; otherwise 1 CPU (and 1 GPU with
    ``use_gpu``), as Ray Train's default. The CPU share is also the worker's torch thread count
    in a sweep (see :func:`trial_scaling_config`).

    Returns:
        resource name -> amount, e.g. ``{"CPU": 4.0, "GPU": 2.0}`` for 2 GPU workers of 2 CPUs.
    """
    per_worker: dict[str, float] = {"CPU": 1.0}
    if scaling.resources_per_worker:
        per_worker.update({k: float(v) for k, v in scaling.resources_per_worker.items()})
    if scaling.use_gpu:
        per_worker.setdefault("GPU", 1.0)
    return {k: v * scaling.max_workers for k, v in per_worker.items() if v > 0}


def check_fits(demand: Mapping[str, float], capacity: Mapping[str, float], where: str) -> None:
    """Refuse, before any trial starts, a trial that could never start.

    Raises:
        ValueError: naming the resource, the trial's need, the capacity and the fix.
    """
    for name, need in sorted(demand.items()):
        have = capacity.get(name, 0.0)
        if need > have + _EPS:
            raise ValueError(
                f"a trial needs {need:g} {name} (ScalingConfig: num_workers x "
                f"resources_per_worker) but {where} has {have:g} {name}: lower "
                "ScalingConfig.num_workers or resources_per_worker, or set "
                f"TuneConfig(resources={{{name!r}: {need:g}}}) to declare more capacity"
            )


@dataclass
class ResourcePool:
    """Free capacity, taken and given back a whole trial at a time.

    Args:
        capacity: resource name -> amount (``{"CPU": 8, "GPU": 2}``).
        max_concurrent: at most this many trials at once (``None``: as many as fit).

    GPUs are handed out as device indices (``take`` returns which), so that concurrent local
    trials get disjoint ``CUDA_VISIBLE_DEVICES``.
    """

    capacity: Mapping[str, float]
    max_concurrent: int | None = None
    free: dict[str, float] = field(init=False)
    running: int = field(init=False, default=0)
    _free_gpus: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.free = {k: float(v) for k, v in self.capacity.items()}
        self._free_gpus = list(range(int(self.capacity.get("GPU", 0))))

    def fits(self, demand: Mapping[str, float]) -> bool:
        """Whether a trial of ``demand`` can start now (all its workers at once)."""
        if self.max_concurrent is not None and self.running >= self.max_concurrent:
            return False
        return all(need <= self.free.get(k, 0.0) + _EPS for k, need in demand.items())

    def take(self, demand: Mapping[str, float]) -> list[int]:
        """Reserve ``demand``; returns the GPU indices it got (empty without GPUs).

        Raises:
            RuntimeError: if it does not fit (call :meth:`fits` first).
        """
        if not self.fits(demand):
            raise RuntimeError(f"trial demand {dict(demand)} does not fit in {self.free}")
        for k, need in demand.items():
            self.free[k] = self.free.get(k, 0.0) - need
        gpus = round(demand.get("GPU", 0.0))
        taken, self._free_gpus = self._free_gpus[:gpus], self._free_gpus[gpus:]
        self.running += 1
        return taken

    def give_back(self, demand: Mapping[str, float], gpus: list[int]) -> None:
        """Return what :meth:`take` reserved."""
        for k, need in demand.items():
            self.free[k] = self.free.get(k, 0.0) + need
        self._free_gpus = sorted(self._free_gpus + gpus)
        self.running -= 1

    def concurrency(self, demand: Mapping[str, float]) -> int:
        """How many trials of ``demand`` fit at once in the whole capacity (at least 1 when one
        fits at all)."""
        counts = [int((self.capacity.get(k, 0.0) + _EPS) // need) for k, need in demand.items()]
        n = min(counts) if counts else 1
        if self.max_concurrent is not None:
            n = min(n, self.max_concurrent)
        return n
