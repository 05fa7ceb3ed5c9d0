"""The run directory's ``config.json`` and ``result.json`` records (docs/run-directory.md):
frozen dataclasses written with the same keys in field order and read leniently
(:class:`~ringtrain.rundir.record.Record`), as the events of :mod:`ringtrain.rundir.schema`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringtrain.rundir.record import MISSING, Record, coerce

__all__ = ["ConfigRecord", "ResultRecord"]


@dataclass(frozen=True, kw_only=True)
class ConfigRecord(Record):
    """``config.json``: the resolved configuration (``ScalingConfig.to_dict()``,
    ``RunConfig.to_dict()``, the train loop config as given; values that are not JSON are
    written as their ``repr``)."""

    name: str | None = None
    storage_path: str | None = None
    entrypoint: str | None = None
    script: str | None = None
    script_args: list[str] = field(default_factory=list)
    ringtrain_version: str | None = None
    created: float | None = None
    scaling_config: dict[str, Any] = field(default_factory=dict)
    run_config: dict[str, Any] = field(default_factory=dict)
    train_loop_config: Any = None

    def worker_range(self) -> tuple[int, int] | None:
        """An elastic run's ``(min, max)`` workers (``scaling_config.num_workers`` as a pair);
        None for a fixed world size or when unknown."""
        n = self.scaling_config.get("num_workers")
        if isinstance(n, list | tuple) and len(n) == 2:
            lo, hi = coerce(int, n[0]), coerce(int, n[1])
            if lo is not MISSING and hi is not MISSING:
                return lo, hi
        return None

    def num_workers(self) -> int | None:
        """``scaling_config.num_workers`` when it is one int."""
        n = coerce(int, self.scaling_config.get("num_workers"))
        return None if n is MISSING else n

    def spares(self) -> int:
        """``scaling_config.spares``: hot spares kept ready (0 when absent or not an int)."""
        n = coerce(int, self.scaling_config.get("spares"))
        return 0 if n is MISSING or n < 0 else n


@dataclass(frozen=True, kw_only=True)
class ResultRecord(Record):
    """``result.json``: the run's outcome so far (``status`` ``RUNNING`` until it ends).

    ``metrics_per_rank`` is keyed by the rank as a string; checkpoints are URIs;
    ``best_checkpoints`` items are ``{"path", "metrics"}``; ``failures`` items are
    ``WorkerFailure.to_dict()``. ``hostname`` is read when present (a driver on another host is
    not declared dead from here) and not written today.
    """

    status: str | None = None
    name: str | None = None
    path: str | None = None
    driver_pid: int | None = None
    start_time: float | None = None
    end_time: float | None = None
    duration_s: float | None = None
    world_size: int | None = None
    rounds: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    metrics_per_rank: dict[str, Any] = field(default_factory=dict)
    checkpoint: str | None = None
    best_checkpoints: list[Any] = field(default_factory=list)
    error: Any = None
    failures: list[Any] = field(default_factory=list)
    follow_on_failures: list[Any] = field(default_factory=list)
    preemptions: int = 0
    outer_steps: int | None = field(default=None, metadata={"omit_none": True})
    hostname: str | None = field(default=None, metadata={"omit_none": True})
