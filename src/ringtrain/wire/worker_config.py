"""The typed driver -> worker contract: :class:`WorkerConfig`.

Everything the driver tells a worker about how to behave (timeouts, checkpoint mode, step timing,
a step limit, elastic settings, the attempt and the first report round) travels as one frozen
:class:`WorkerConfig` inside the authenticated :class:`~ringtrain.wire.channel.Start` message; the
worker reads it as ``get_context().config`` (and ``Session.worker_config``).

Environment variables remain only where another program's contract needs them before Python code of
ours runs: torchrun's and Horovod's rank variables, ``MASTER_ADDR``/``MASTER_PORT``,
``OMP_NUM_THREADS``, gloo's interface variables (:func:`ringtrain.cluster.env.worker_environment`),
and the bootstrap a worker needs before it can receive ``Start`` at all
(:data:`ringtrain.cluster.env.BOOTSTRAP_ENV`:
the driver's channel address and secret, and the reaper's run token). The channel is authenticated
(HMAC challenge both ways) before a single byte is unpickled, so the config is as trustworthy as the
driver; it is built from the same classes on both sides, so nothing is parsed back from strings.

This module imports neither torch nor the controller: the driver, the workers and the channel all
use it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringtrain.config.parallel import MeshShape
from ringtrain.config.run import ELASTIC_BATCH_POLICIES

if TYPE_CHECKING:
    from ringtrain.config import RunConfig, ScalingConfig

COMM_TIMING_MODES = ("auto", "hook", "wait")
"""``MonitorConfig.comm_timing`` values."""


@dataclass(frozen=True)
class ElasticSettings:
    """The elastic part of a :class:`WorkerConfig` (``ScalingConfig(num_workers=(min, max))``).

    Attributes:
        min_workers: the smallest world size the group may shrink to (>= 1).
        max_workers: the world size the run starts with and may grow back to (>= min_workers).
        snapshot_interval_steps: take an in-memory snapshot every this many ``TrainState`` steps
            (``FailureConfig.snapshot_interval_steps``, >= 1).
        grow: the group may grow back to ``max_workers`` when capacity returns
            (``ScalingConfig.elastic_grow_after_s`` is not None).
        joining: set only in a worker started to join a running group: it waits for its
            ``Resize`` instead of starting the process group (the driver's channel group marks
            it in that worker's ``Start``).
        carry_rng: every rank's RNG states are gathered at each snapshot, so that a worker that
            takes a lost rank's place (a hot spare: ``ScalingConfig.spares > 0``) continues
            that rank's random streams (gathered with the pause agreement:
            :func:`ringtrain.elastic.snapshot.pack_rng`).
    """

    min_workers: int
    max_workers: int
    snapshot_interval_steps: int = 1
    grow: bool = False
    joining: bool = False
    carry_rng: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(
                f"ElasticSettings needs 1 <= min_workers <= max_workers, got min_workers="
                f"{self.min_workers}, max_workers={self.max_workers} (set "
                "ScalingConfig(num_workers=(min, max)) with min <= max)"
            )
        if self.snapshot_interval_steps < 1:
            raise ValueError(
                "ElasticSettings.snapshot_interval_steps must be >= 1, got "
                f"{self.snapshot_interval_steps} (set FailureConfig(snapshot_interval_steps=1) "
                "to snapshot every step)"
            )


@dataclass(frozen=True)
class WorkerConfig:
    """What the driver tells every worker of one attempt (inside ``Start``).

    Attributes:
        run_dir: the run directory the workers write to (path or fsspec URL); ``None`` outside a
            ringtrain run.
        attempt: 0 on the first attempt; +1 each time the group is restarted (the generation of
            the worker group).
        start_round: the report round the first ``report()`` of this attempt gets.
        use_gpu: each worker drives ``cuda:{local_rank}`` (NCCL) instead of the CPU (gloo).
        worker_timeout_s: ``FailureConfig.worker_timeout_s``, seconds without progress before
            the driver fails a rank as hung; also sizes the heartbeat and the collective
            timeout (``None``: no hang detection).
        async_checkpoint: ``CheckpointConfig.async_save``: TrainState checkpoints are written
            on a background thread after staging to host memory.
        timing_interval_s: ``MonitorConfig.timing_interval_s`` when ``MonitorConfig.timing`` is
            on: seconds between step-timing windows (``None``: timing off).
        comm_timing: ``MonitorConfig.comm_timing``: ``"auto"``, ``"hook"`` or ``"wait"``.
        max_steps: stop cleanly after this many steps (``ringtrain bench``; ``None``: no limit).
        elastic: the elastic settings, ``None`` for a run of a fixed size without hot spares
            (``ScalingConfig.spares`` needs the in-place runtime: ``min = max = num_workers``).
        elastic_batch_policy: ``ScalingConfig.elastic_batch_policy`` (elastic runs).
        mesh: the resolved ``ScalingConfig.parallel`` (``get_context().mesh`` is built from it;
            ``prepare_model`` then shards and applies TP over it); ``None`` without a
            ``ParallelConfig``.
        driver_pid: the driver process's pid, when its workers run on its machine (the local
            launcher sets it: a worker's parent, or its grandparent through the warm pool's
            zygote); its SIGTERM stops a worker at once, anyone else's is a preemption notice
            (:mod:`ringtrain.worker.preempt`). ``None`` where the driver is elsewhere (Ray).
        replica_check_every: ``FailureConfig.replica_check_every`` (0: no replica check).
        replay_check_every: ``FailureConfig.replay_check_every`` (0: no replay check).
        recheck_step: the step whose replica-check fingerprint rank 0 sends the driver (the
            re-run after a mismatch without a majority; ``None``: none).

    Raises:
        ValueError: from ``__post_init__`` for a value out of range (the message names the field
            and the fix).
    """

    run_dir: str | None = None
    attempt: int = 0
    start_round: int = 0
    use_gpu: bool = False
    worker_timeout_s: float | None = None
    async_checkpoint: bool = False
    timing_interval_s: float | None = None
    comm_timing: str = "auto"
    max_steps: int | None = None
    elastic: ElasticSettings | None = None
    elastic_batch_policy: str = "resize_batch"
    mesh: MeshShape | None = None
    driver_pid: int | None = None
    replica_check_every: int = 0
    replay_check_every: int = 0
    recheck_step: int | None = None

    def __post_init__(self) -> None:
        for name in ("attempt", "start_round", "replica_check_every", "replay_check_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"WorkerConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("worker_timeout_s", "timing_interval_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"WorkerConfig.{name} must be a positive number of seconds or None, "
                    f"got {value!r}"
                )
        if self.driver_pid is not None and self.driver_pid < 1:
            raise ValueError(
                f"WorkerConfig.driver_pid must be a process id >= 1 or None, got {self.driver_pid}"
            )
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(
                f"WorkerConfig.max_steps must be >= 1 or None (no limit), got {self.max_steps}"
            )
        if self.comm_timing not in COMM_TIMING_MODES:
            raise ValueError(
                f"WorkerConfig.comm_timing must be one of {COMM_TIMING_MODES}, got "
                f"{self.comm_timing!r} (MonitorConfig.comm_timing)"
            )
        if self.elastic_batch_policy not in ELASTIC_BATCH_POLICIES:
            raise ValueError(
                f"WorkerConfig.elastic_batch_policy must be one of {ELASTIC_BATCH_POLICIES}, got "
                f"{self.elastic_batch_policy!r} (ScalingConfig.elastic_batch_policy)"
            )

    @property
    def timing(self) -> bool:
        """Whether the worker times its steps and sends timing windows."""
        return self.timing_interval_s is not None

    def for_attempt(self, attempt: int, start_round: int) -> WorkerConfig:
        """This config for attempt ``attempt`` whose first report is round ``start_round``."""
        return dataclasses.replace(self, attempt=attempt, start_round=start_round)

    def for_joiner(self) -> WorkerConfig:
        """The config of a worker started to join a running elastic group (``elastic.joining``).

        Raises:
            ValueError: if the run is not elastic.
        """
        if self.elastic is None:
            raise ValueError("WorkerConfig.for_joiner: the run is not elastic (elastic is None)")
        return dataclasses.replace(self, elastic=dataclasses.replace(self.elastic, joining=True))


def build_worker_config(
    scaling_config: ScalingConfig,
    run_config: RunConfig,
    *,
    max_steps: int | None = None,
) -> WorkerConfig:
    """The :class:`WorkerConfig` of a run, built once on the driver; each attempt's launcher
    fills in the run directory, attempt and first round
    (:meth:`ringtrain.launch.base.WorkerSpec.start_config`).

    Args:
        scaling_config: the run's ``ScalingConfig``.
        run_config: the run's ``RunConfig``.
        max_steps: stop every worker cleanly after this many steps (``None``: no limit).

    Raises:
        ValueError: a value out of range (see :class:`WorkerConfig`).
    """
    failure = run_config.failure_config
    monitor = run_config.monitor_config
    elastic = None
    if scaling_config.in_place:  # num_workers=(min, max), or spares: resize/replace in place
        elastic = ElasticSettings(
            scaling_config.min_workers,
            scaling_config.max_workers,
            failure.snapshot_interval_steps,
            grow=scaling_config.elastic and scaling_config.elastic_grow_after_s is not None,
            carry_rng=scaling_config.spares > 0,
        )
    timeout = failure.worker_timeout_s
    return WorkerConfig(
        use_gpu=scaling_config.use_gpu,
        worker_timeout_s=None if timeout is None else float(timeout),
        async_checkpoint=bool(run_config.checkpoint_config.async_save),
        timing_interval_s=float(monitor.timing_interval_s) if monitor.timing else None,
        comm_timing=monitor.comm_timing,
        max_steps=None if max_steps is None else int(max_steps),
        elastic=elastic,
        elastic_batch_policy=scaling_config.elastic_batch_policy,
        replica_check_every=failure.replica_check_every,
        replay_check_every=failure.replay_check_every,
        mesh=(
            None
            if scaling_config.parallel is None
            else scaling_config.parallel.resolve(scaling_config.max_workers)
        ),
    )
