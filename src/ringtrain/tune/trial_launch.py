"""Starting one trial of a sweep: its workers' scaling, its run configuration, its warm
worker pool, and the thread that drives its controller (:func:`launch_trial`).

The :class:`~ringtrain.tune.tuner.Tuner` decides *which* trial starts and when; this module
only turns a chosen trial into a running ringtrain run in ``{sweep}/trial_NNNN/``.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.launch.backends import backend_for
from ringtrain.launch.pool import with_auto_preload
from ringtrain.rundir import RunDirectory
from ringtrain.tune.trials import TrialRun

if TYPE_CHECKING:
    from ringtrain.launch.pool import WorkerPool

OnRound = Callable[[TrialRun, int, dict[str, Any]], None]


class _TrialReporter:
    """The trial's driver-side callback: rank 0's metrics of each report round become the
    Optuna trial's intermediate values; a pruning decision stops the trial's workers."""

    def __init__(self, on_round: OnRound, trial: TrialRun) -> None:
        self._on_round = on_round
        self.trial = trial

    def on_round(self, round_: int, metrics: dict[str, Any]) -> None:
        self._on_round(self.trial, round_, metrics)


def trial_scaling(scaling: ScalingConfig) -> ScalingConfig:
    """``scaling`` with 1 CPU per worker unless it names its CPUs (each worker gets the 1 CPU
    it was scheduled with: its torch thread count)."""
    if scaling.resources_per_worker and "CPU" in scaling.resources_per_worker:
        return scaling
    return dataclasses.replace(
        scaling, resources_per_worker={**(scaling.resources_per_worker or {}), "CPU": 1}
    )


def launch_trial(
    trial: TrialRun,
    *,
    train_fn: Callable[..., Any],
    dir_name: str,
    sweep: RunDirectory,
    scaling_config: ScalingConfig,
    run_config: RunConfig,
    worker_pool: WorkerPool | None,
    on_round: OnRound,
) -> None:
    """Start ``trial`` (its ``config``, ``gpus`` and ``stop`` event) as a ringtrain run named
    ``dir_name`` in ``sweep``, on a daemon thread (``trial.thread``) that sets ``trial.result``
    or ``trial.exception``, then ``trial.done``.

    Args:
        worker_pool: the sweep's warm pool to fork the workers from, or ``None`` (cold start).
        on_round: called on the trial's controller thread once every rank reported a round.
    """
    from ringtrain.trainer import _pickle_payload, run_workers

    scaling = with_auto_preload(trial_scaling(scaling_config), train_fn)
    extra_env = backend_for(scaling).trial_env(trial.gpus)
    trial_run_config = dataclasses.replace(
        run_config,
        name=dir_name,
        storage_path=sweep.uri,
        progress="off",
        callbacks=[*run_config.callbacks, _TrialReporter(on_round, trial)],
    )
    payload = _pickle_payload(train_fn, trial.config)
    launcher = None
    if worker_pool is not None:
        from ringtrain.launch.local import LocalLauncher

        launcher = LocalLauncher(pool=worker_pool)

    def target() -> None:
        try:
            trial.result = run_workers(
                name=dir_name,
                entrypoint=getattr(train_fn, "__name__", "train"),
                scaling_config=scaling,
                run_config=trial_run_config,
                payload=payload,
                train_loop_config=trial.config,
                stop_event=trial.stop,
                extra_env=extra_env,
                launcher=launcher,
            )
        except BaseException as exc:  # reported by the main thread
            trial.exception = exc
        finally:
            trial.done.set()

    trial.thread = threading.Thread(target=target, name=f"ringtrain-{dir_name}", daemon=True)
    trial.thread.start()


def sweep_pool(scaling: ScalingConfig) -> tuple[WorkerPool | None, Callable[[], None]]:
    """The sweep's warm worker pool (:class:`ringtrain.launch.pool.WorkerPool`), or ``None``
    (Ray, ``warm_start=False``, or the zygote could not start: trials then start cold), and
    the function to call when the sweep ends. Inside an open :func:`ringtrain.warm_pool` block
    the trials fork from the block's zygote (which the end gives back, and which outlives the
    sweep); else the sweep starts a zygote of its own (which the end stops)."""
    if not backend_for(scaling).local_processes or not scaling.warm_start:
        return None, lambda: None
    from ringtrain.launch import shared_pool
    from ringtrain.launch.pool import PoolUnavailable, WorkerPool

    block = shared_pool.active()
    if block is not None:
        try:
            pool = block.acquire()
        except (PoolUnavailable, OSError):
            pass  # the block has ended, or its zygote could not start: one of the sweep's own
        else:
            return pool, lambda: block.release(pool)
    try:
        own = WorkerPool()
    except OSError:
        return None, lambda: None
    return own, own.close
