"""``Trainer(train_fn, scaling_config, run_config).fit() -> Result``."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ringtrain
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.storage import protocols
from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.controller.controller import Controller
from ringtrain.controller.policy import FailurePolicy
from ringtrain.env import ENV_ASYNC_CHECKPOINT, ENV_WORKER_TIMEOUT, detect_source
from ringtrain.launch.base import Launcher, WorkerSpec
from ringtrain.launch.local import LocalLauncher
from ringtrain.monitor.progress import make_progress
from ringtrain.monitor.runs import pid_alive
from ringtrain.result import Result
from ringtrain.rundir import RunDirectory

logger = logging.getLogger("ringtrain")


def default_run_name(entrypoint: str) -> str:
    """``{entrypoint}_{YYYY-mm-dd_HH-MM-SS}``."""
    safe = (
        "".join(c if c.isalnum() or c in "_.-" else "_" for c in entrypoint).strip("_.-") or "run"
    )
    return f"{safe}_{time.strftime('%Y-%m-%d_%H-%M-%S')}"


def validate_gpus(scaling: ScalingConfig) -> None:
    """Raise before any process starts when ``use_gpu`` asks for more GPUs than this host has."""
    if not scaling.use_gpu:
        return
    import torch

    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < scaling.num_workers:
        raise ValueError(
            f"ScalingConfig(use_gpu=True, num_workers={scaling.num_workers}) needs "
            f"{scaling.num_workers} CUDA devices, this machine has {available} "
            f"(use num_workers<={available}" + (")" if available else ", or use_gpu=False)")
        )


class Trainer:
    """Runs ``train_fn`` as ``scaling_config.num_workers`` data-parallel workers.

    Args:
        train_fn: the per-worker training function, ``train_fn(config)`` or ``train_fn()``. It is
            shipped to the workers with cloudpickle (closures, lambdas and functions of
            ``__main__`` work).
        scaling_config: how many workers and on what (default: 1 worker on CPU).
        run_config: where to write and how to handle failures (default: ``./runs/<name>``).
        train_loop_config: the ``config`` passed to ``train_fn``.
        launcher: how workers start (default: local processes per ``scaling_config.backend``).

    Raises:
        TypeError: for arguments of the wrong type (before any process starts).
    """

    def __init__(
        self,
        train_fn: Callable[..., Any],
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        *,
        train_loop_config: dict[str, Any] | None = None,
        launcher: Launcher | None = None,
    ) -> None:
        if not callable(train_fn):
            raise TypeError(
                f"Trainer(train_fn=...) must be callable, got {type(train_fn).__name__}"
            )
        if scaling_config is None:
            scaling_config = ScalingConfig()
        if not isinstance(scaling_config, ScalingConfig):
            raise TypeError(
                "Trainer(scaling_config=...) must be a ringtrain.ScalingConfig, got "
                f"{type(scaling_config).__name__}"
            )
        if run_config is None:
            run_config = RunConfig()
        if not isinstance(run_config, RunConfig):
            raise TypeError(
                "Trainer(run_config=...) must be a ringtrain.RunConfig, got "
                f"{type(run_config).__name__}"
            )
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise TypeError(
                "Trainer(train_loop_config=...) must be a dict, got "
                f"{type(train_loop_config).__name__}"
            )
        self.train_fn = train_fn
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.train_loop_config = train_loop_config
        self.launcher = launcher

    def fit(self, raise_on_error: bool = True) -> Result:
        """Run the job to completion.

        Inside a process that a launcher already started as one rank (``ringtrain run``,
        torchrun, SLURM), runs ``train_fn`` in this process as that rank instead of starting
        workers, so one script serves both ways.

        Returns:
            The :class:`Result`.

        Raises:
            TrainingFailedError: when a worker failed beyond ``FailureConfig.max_failures``
                (unless ``raise_on_error=False``: then ``Result.error`` holds it).
            ValueError: when the configuration cannot run on this machine (too few GPUs).
        """
        if detect_source() != "single":
            return self._fit_in_process()
        validate_gpus(self.scaling_config)
        payload = _pickle_payload(self.train_fn, self.train_loop_config)
        entrypoint = getattr(self.train_fn, "__name__", "train")
        name = self.run_config.name or default_run_name(entrypoint)
        result = run_workers(
            name=name,
            entrypoint=entrypoint,
            scaling_config=self.scaling_config,
            run_config=self.run_config,
            payload=payload,
            train_loop_config=self.train_loop_config,
            launcher=self.launcher,
        )
        if result.error is not None and raise_on_error:
            raise result.error
        return result

    def _fit_in_process(self) -> Result:
        from ringtrain.distributed import init_process_group
        from ringtrain.session import current_session

        session = current_session()
        ctx = session.context
        if ctx.world_size != self.scaling_config.num_workers:
            logger.info(
                "running in-process as rank %d of %d (started by %s); "
                "ScalingConfig.num_workers=%d does not apply",
                ctx.world_rank,
                ctx.world_size,
                ctx.source,
                self.scaling_config.num_workers,
            )
        init_process_group(ctx)
        config = self.train_loop_config if self.train_loop_config is not None else {}
        from ringtrain.launch.worker import _takes_config

        if _takes_config(self.train_fn):
            self.train_fn(config)
        else:
            self.train_fn()
        metrics = dict(session.last_metrics)
        return Result(
            metrics=metrics,
            metrics_per_rank={ctx.world_rank: metrics},
            checkpoint=session.latest_checkpoint,
            path=ctx.run_dir,
        )


def _refuse_if_running(run_dir: RunDirectory) -> None:
    """Two drivers writing one run directory would interleave rounds and overwrite each other's
    checkpoints; a run whose driver is still alive on this host cannot be started again."""
    import json
    import os

    if not run_dir.is_local:
        return  # no way to see another host's processes; object stores are on the user
    path = os.path.join(run_dir.path, "result.json")
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return
    pid = previous.get("driver_pid")
    if previous.get("status") != "RUNNING" or not isinstance(pid, int) or pid == os.getpid():
        return
    if not pid_alive(pid):
        return  # that driver died: resuming its run is what the user wants
    raise RuntimeError(
        f"run {run_dir.name!r} is already running (driver pid {pid}, {run_dir.uri}); "
        "wait for it, stop it, or use another RunConfig(name=...)"
    )


def _pickle_payload(train_fn: Callable[..., Any], config: dict[str, Any] | None) -> bytes:
    import cloudpickle

    try:
        return bytes(cloudpickle.dumps((train_fn, config)))
    except Exception as exc:
        raise TypeError(
            f"train_fn and train_loop_config must be picklable to reach the workers, but "
            f"pickling failed: {type(exc).__name__}: {exc} (move unpicklable objects such as open "
            "files, locks or loaded datasets inside train_fn)"
        ) from exc


def run_workers(
    *,
    name: str,
    entrypoint: str,
    scaling_config: ScalingConfig,
    run_config: RunConfig,
    payload: bytes | None = None,
    script: str | None = None,
    script_args: tuple[str, ...] = (),
    train_loop_config: dict[str, Any] | None = None,
    launcher: Launcher | None = None,
) -> Result:
    """Set up the run directory and drive the workers to completion (used by ``Trainer.fit`` and
    ``ringtrain run``). Returns the Result; never raises TrainingFailedError itself."""
    run_dir = RunDirectory(run_config.storage_path, name)
    if "memory" in protocols(run_dir.fs):
        raise ValueError(
            f"RunConfig.storage_path={run_config.storage_path!r}: memory:// lives inside one "
            "process, and the workers are other processes, so their checkpoints would be lost "
            "(use a local directory or a shared fsspec URL such as s3://)"
        )
    _refuse_if_running(run_dir)
    run_dir.create()
    checkpoints = CheckpointManager(run_dir.fs, run_dir.path, run_config.checkpoint_config)
    notes = checkpoints.scan()
    progress = make_progress(run_config.progress)
    for note in notes:
        progress.message(note)
    if checkpoints.latest is not None:
        progress.message(
            f"run {name!r} exists: workers resume from {checkpoints.latest.checkpoint}"
        )
    run_dir.write_json(
        "config.json",
        {
            "name": name,
            "storage_path": run_config.storage_path,
            "entrypoint": entrypoint,
            "script": script,
            "script_args": list(script_args),
            "ringtrain_version": ringtrain.__version__,
            "created": time.time(),
            "scaling_config": scaling_config.to_dict(),
            "run_config": {**run_config.to_dict(), "name": name},
            "train_loop_config": train_loop_config,
        },
    )
    threads = scaling_config.threads_per_worker()
    timeout = run_config.failure_config.worker_timeout_s
    worker_env = {
        ENV_WORKER_TIMEOUT: "" if timeout is None else repr(float(timeout)),
        ENV_ASYNC_CHECKPOINT: "1" if run_config.checkpoint_config.async_save else "0",
    }

    def make_spec(attempt: int, start_round: int, latest: str | None) -> WorkerSpec:
        return WorkerSpec(
            world_size=scaling_config.num_workers,
            run_dir=run_dir.uri,
            payload=payload,
            script=script,
            script_args=tuple(script_args),
            use_gpu=scaling_config.use_gpu,
            threads=threads,
            attempt=attempt,
            start_round=start_round,
            latest_checkpoint=latest,
            env=dict(worker_env),
        )

    controller = Controller(
        launcher=launcher or LocalLauncher(),
        make_spec=make_spec,
        world_size=scaling_config.num_workers,
        run_dir=run_dir,
        checkpoints=checkpoints,
        failure_policy=FailurePolicy(run_config.failure_config),
        progress=progress,
        callbacks=run_config.callbacks,
        worker_timeout_s=timeout,
    )
    with _sigterm_as_interrupt():
        return controller.run()


class DriverTerminated(KeyboardInterrupt):
    """The driver received SIGTERM; raised like Ctrl-C so that workers are stopped and the run
    directory records ``ABORTED``."""


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While the run is active, turn SIGTERM (a scheduler's preemption notice) into an
    interruption with the same orderly shutdown as Ctrl-C. Only possible on the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise DriverTerminated(f"the driver received {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
