"""``Trainer(train_fn, scaling_config, run_config).fit() -> Result``."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from typing import Any

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.checkpoint.signing import from_run_config
from ringtrain.checkpoint.storage import protocols
from ringtrain.cluster.env import detect_source
from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.config.spares import spares_run_refusal
from ringtrain.config.validation import short_error
from ringtrain.controller.controller import Controller
from ringtrain.controller.policy import FailurePolicy
from ringtrain.controller.signals import (
    DriverTerminated,
    _requeue_if_preempted,
    _sigterm_as_interrupt,
    interrupted,
)
from ringtrain.launch.backends import backend_for
from ringtrain.launch.base import Launcher, NoticeProvider, WorkerSpec
from ringtrain.launch.pool import ColdStartReporter, with_auto_preload
from ringtrain.monitor.progress import make_progress
from ringtrain.monitor.sinks import default_sinks
from ringtrain.monitor.straggler import StragglerDetector
from ringtrain.preemption import SignalNotice
from ringtrain.result import Result
from ringtrain.rundir import RunDirectory
from ringtrain.rundir.saved_run import (  # re-exported: cli, tests and users import them from here
    CONFIG_FILE,
    PAYLOAD_FILE,
    RunContinuedWarning,
    RunNameTaken,
    SavedRun,
    default_run_name,
    finished_note,
    load_saved_run,
    refuse_if_running,
    write_run_config,
)
from ringtrain.rundir.schema import ColdStartEvent
from ringtrain.wire.worker_config import build_worker_config

__all__ = [
    "CONFIG_FILE",
    "PAYLOAD_FILE",
    "DriverTerminated",
    "RunContinuedWarning",
    "RunNameTaken",
    "SavedRun",
    "Trainer",
    "_sigterm_as_interrupt",
    "default_run_name",
    "finished_note",
    "load_saved_run",
    "run_workers",
    "short_error",
    "validate_gpus",
]

logger = logging.getLogger("ringtrain")
# The progress display already shows every decision; without a handler of the application's,
# logging's last resort would print each warning a second time.
logger.addHandler(logging.NullHandler())


def validate_gpus(scaling: ScalingConfig) -> None:
    """Raise before any process starts when ``use_gpu`` asks for more GPUs than this host has.
    (On Ray the GPUs are the cluster's: its placement group checks them.)"""
    backend_for(scaling).check_host()


def make_launcher(scaling: ScalingConfig) -> Launcher:
    """The launcher ``scaling.backend`` names: local processes, or Ray actors (Ray is imported
    only then; ImportError naming ``pip install 'ringtrain[ray]'`` when it is missing)."""
    return backend_for(scaling).launcher()


def _resolve_train_fn(
    train_fn: Callable[..., Any] | None,
    train_loop_per_worker: Callable[..., Any] | None,
    datasets: dict[str, Any] | None,
) -> Callable[..., Any]:
    """The train function from ringtrain's name or Ray Train's; refuses ``datasets``."""
    if datasets is not None:
        raise ValueError(
            "Trainer(datasets=...): Ray Data datasets are not supported; build a torch "
            "DataLoader inside the train function and pass it through prepare_data_loader() "
            "(it shards the data across workers like get_dataset_shard())"
        )
    if train_fn is not None and train_loop_per_worker is not None:
        raise TypeError(
            "Trainer got both train_fn and train_loop_per_worker (Ray Train's name for the same "
            "argument): give only one"
        )
    chosen = train_fn if train_fn is not None else train_loop_per_worker
    if chosen is None:
        raise TypeError(
            "Trainer needs the per-worker training function: Trainer(train_fn) or "
            "Trainer(train_loop_per_worker=train_fn)"
        )
    return chosen


class Trainer:
    """Runs ``train_fn`` as ``scaling_config.num_workers`` data-parallel workers.

    Ray Train's keyword names work too, so ``TorchTrainer(train_loop_per_worker=...,
    train_loop_config=..., scaling_config=..., run_config=...)`` ports by renaming the class
    (see docs/ray.md).

    Args:
        train_fn: the per-worker training function, ``train_fn(config)`` or ``train_fn()``. It is
            shipped to the workers with cloudpickle (closures, lambdas and functions of
            ``__main__`` work).
        scaling_config: how many workers and on what (default: 1 worker on CPU).
        run_config: where to write and how to handle failures (default: ``./runs/<name>``).
        train_loop_config: the ``config`` passed to ``train_fn``.
        launcher: how workers start (default: local processes per ``scaling_config.backend``).
        train_loop_per_worker: Ray Train's name for ``train_fn`` (give one of the two).
        datasets: Ray Data datasets: not supported; always raises (feed a torch ``DataLoader``
            through ``prepare_data_loader`` inside the train function instead).

    Raises:
        TypeError: for arguments of the wrong type, when neither or both of ``train_fn`` and
            ``train_loop_per_worker`` are given (before any process starts).
        ValueError: when ``datasets`` is given.
    """

    def __init__(
        self,
        train_fn: Callable[..., Any] | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        *,
        train_loop_config: dict[str, Any] | None = None,
        launcher: Launcher | None = None,
        train_loop_per_worker: Callable[..., Any] | None = None,
        datasets: dict[str, Any] | None = None,
    ) -> None:
        train_fn = _resolve_train_fn(train_fn, train_loop_per_worker, datasets)
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
        self._continue_finished = False  # Trainer.restore: continuing a finished run is the point

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
            TypeError: when ``train_fn`` or ``train_loop_config`` cannot be pickled (the
                message names the variable).
            RunNameTaken: when ``RunConfig.name`` names a run whose driver is still running.

        A ``RunConfig.name`` taken by an earlier run continues that run from its latest valid
        checkpoint (the run directory contract); when that run had FINISHED, a
        :class:`RunContinuedWarning` says so, naming ``RunConfig(name=...)`` for a fresh run.

        These errors are raised before any worker starts, with one line that names the fix and
        no traceback through ringtrain (``RINGTRAIN_DEBUG=1`` keeps it).
        """
        if detect_source() != "single":
            return self._fit_in_process()
        entrypoint = getattr(self.train_fn, "__name__", "train")
        name = self.run_config.name or default_run_name(entrypoint)
        try:
            validate_gpus(self.scaling_config)
            payload = _pickle_payload(self.train_fn, self.train_loop_config)
        except (TypeError, ValueError) as exc:
            raise short_error(exc) from None
        note = (
            None if self._continue_finished else finished_note(self.run_config.storage_path, name)
        )
        if note is not None:
            warnings.warn(note, RunContinuedWarning, stacklevel=2)
        try:
            result = run_workers(
                name=name,
                entrypoint=entrypoint,
                scaling_config=with_auto_preload(self.scaling_config, self.train_fn),
                run_config=self.run_config,
                payload=payload,
                train_loop_config=self.train_loop_config,
                launcher=self.launcher,
            )
        except RunNameTaken as exc:  # its driver is still running
            raise short_error(exc) from None
        except KeyboardInterrupt as exc:  # the run is ABORTED, its workers stopped
            raise short_error(interrupted(exc, self.run_config.storage_path, name)) from None
        if result.error is not None and raise_on_error:
            raise result.error
        return result

    @classmethod
    def restore(
        cls,
        path: str,
        train_fn: Callable[..., Any] | None = None,
        *,
        signing_key: bytes | str | None = None,
        signing_key_file: str | None = None,
        trust_unsigned: bool = False,
        **overrides: Any,
    ) -> Trainer:
        """A Trainer that continues the run in directory ``path`` after its driver died (or
        after it finished or failed: ``fit()`` then starts from its latest valid checkpoint).

        Args:
            path: the run directory, ``{storage_path}/{name}`` (a local path or fsspec URL).
            train_fn: the train function; default: the one the run was started with (stored in
                the run directory, as cloudpickle).
            signing_key: the key the run was signed with (default: the ``run_config``
                override's, else ``$RINGTRAIN_SIGNING_KEY`` or your key file).
            signing_key_file: a file holding that key, instead of ``signing_key``.
            trust_unsigned: accept a ``config.json`` / ``payload.pkl`` / checkpoints not signed
                with the key (``payload.pkl`` is code: only if you trust whoever can write the
                storage).
            **overrides: ``scaling_config``, ``run_config`` or ``train_loop_config`` to use
                instead of the stored ones (the run's name and storage path always stay).

        Raises:
            FileNotFoundError: if ``path`` has no ``config.json``.
            SignatureError (a ValueError): ``config.json`` or ``payload.pkl`` is not signed with
                the key (checked before anything is unpickled).
            ValueError: if the run was a ``ringtrain run SCRIPT`` run (resume it with
                ``ringtrain run --resume PATH``), or ``overrides`` has an unknown key.
        """
        unknown = set(overrides) - {"scaling_config", "run_config", "train_loop_config"}
        if unknown:
            raise ValueError(f"Trainer.restore: unknown overrides {sorted(unknown)}")
        base = overrides.get("run_config") or RunConfig()
        signing_fields = {
            "signing_key": signing_key if signing_key is not None else base.signing_key,
            "signing_key_file": signing_key_file or base.signing_key_file,
            "trust_unsigned": trust_unsigned or base.trust_unsigned,
        }
        signer = from_run_config(RunConfig(**signing_fields))  # type: ignore[arg-type]
        saved = load_saved_run(path, signer)
        if train_fn is None:
            if saved.payload is None:
                raise ValueError(
                    f"{path} was started by `ringtrain run {saved.script or 'SCRIPT'}`: resume it "
                    f"with `ringtrain run --resume {path}`"
                )
            import cloudpickle

            train_fn, stored_config, *_ = cloudpickle.loads(saved.payload)
        else:
            stored_config = saved.train_loop_config
        run_config = overrides.get("run_config") or saved.run_config
        run_config = dataclasses.replace(
            run_config, name=saved.name, storage_path=saved.storage_path, **signing_fields
        )
        trainer = cls(
            train_fn,
            overrides.get("scaling_config") or saved.scaling_config,
            run_config,
            train_loop_config=overrides.get("train_loop_config", stored_config),
        )
        trainer._continue_finished = True
        return trainer

    def _fit_in_process(self) -> Result:
        from ringtrain.cluster.distributed import init_process_group
        from ringtrain.worker.in_process import latest_published, send_run_settings
        from ringtrain.worker.session import call_train_fn, current_session

        session = current_session()
        ctx = session.context
        if ctx.world_size != self.scaling_config.num_workers:
            logger.info(
                "running in-process as rank %d of %d (started by %s); "
                "ScalingConfig.num_workers=%s does not apply",
                ctx.world_rank,
                ctx.world_size,
                ctx.source,
                self.scaling_config.num_workers,
            )
        init_process_group(ctx)
        send_run_settings(session, self.run_config)  # honoured by the driver, or said
        config = self.train_loop_config if self.train_loop_config is not None else {}
        call_train_fn(self.train_fn, config)
        metrics = dict(session.last_metrics)
        return Result(
            metrics=metrics,
            metrics_per_rank={ctx.world_rank: metrics},
            checkpoint=latest_published(session),  # this run's newest, once published
            path=ctx.run_dir,
        )


def _pickle_payload(train_fn: Callable[..., Any], config: dict[str, Any] | None) -> bytes:
    from ringtrain.wire.payload import pickle_payload

    return pickle_payload(train_fn, config)


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
    max_steps: int | None = None,
    stop_event: threading.Event | None = None,
    extra_env: dict[str, str] | None = None,
) -> Result:
    """Set up the run directory and drive the workers to completion (used by ``Trainer.fit``,
    ``ringtrain run`` and ``ringtrain bench``). Returns the Result; never raises
    TrainingFailedError itself.

    ``max_steps``: every worker stops cleanly when its prepared data loader is asked for a batch
    after this many steps (the run then ends FINISHED); ``None`` runs the job to its end.
    ``stop_event``: set from another thread to stop the run early (it ends ``STOPPED``).
    ``extra_env``: environment variables added to every worker's (e.g. ``CUDA_VISIBLE_DEVICES``
    for a sweep trial's share of the GPUs)."""
    own_launcher = launcher is None
    refusal = spares_run_refusal(
        scaling_config.spares,
        max_failures=run_config.failure_config.max_failures,
        script=script is not None,
    )
    if refusal is not None:  # before any process starts
        raise ValueError(refusal)
    signer = from_run_config(run_config)  # an unusable key file fails before anything starts
    launcher = launcher or make_launcher(scaling_config)  # before anything is written
    # The launcher may hold processes already (the warm pool starts at once): whatever fails
    # before the run starts (a run name taken, an unreadable run directory) closes it.
    try:
        run_dir = RunDirectory(run_config.storage_path, name)
        staging_dir = None
        if "memory" in protocols(run_dir.fs):
            # memory:// lives inside this process; workers are other processes. They stage their
            # files on local disk and the driver carries each completed checkpoint over.
            staging_dir = tempfile.mkdtemp(prefix=f"ringtrain-{name}-")
        refuse_if_running(run_dir)
        run_dir.create()
        checkpoints = CheckpointManager(
            run_dir.fs,
            run_dir.path,
            run_config.checkpoint_config,
            staging_dir=staging_dir,
            signer=signer,
        )
        notes = checkpoints.scan()
        progress = make_progress(run_config.progress)
        for note in notes:
            progress.message(note)
        if checkpoints.latest is not None:
            progress.message(f"run {name!r} exists: resuming from its latest valid checkpoint")
        write_run_config(
            run_dir,
            signer,
            entrypoint=entrypoint,
            script=script,
            script_args=script_args,
            scaling_config=scaling_config,
            run_config=run_config,
            train_loop_config=train_loop_config,
            payload=payload,
        )
        threads = scaling_config.threads_per_worker()
        timeout = run_config.failure_config.worker_timeout_s
        monitor = run_config.monitor_config
        # Everything the workers are told travels typed in Start (ringtrain.wire.worker_config).
        worker_config = build_worker_config(scaling_config, run_config, max_steps=max_steps)
        elastic = None
        if worker_config.elastic is not None:  # num_workers=(min, max) or spares: in place
            from ringtrain.elastic.policy import ElasticPolicy

            elastic = ElasticPolicy(
                worker_config.elastic.min_workers,
                worker_config.elastic.max_workers,
                grow_after_s=scaling_config.elastic_grow_after_s,
            )

        def make_spec(attempt: int, start_round: int, latest: str | None) -> WorkerSpec:
            return WorkerSpec(
                world_size=scaling_config.max_workers,
                run_dir=checkpoints.workers_run_dir or run_dir.uri,
                payload=payload,
                script=script,
                script_args=tuple(script_args),
                use_gpu=scaling_config.use_gpu,
                threads=threads,
                attempt=attempt,
                start_round=start_round,
                latest_checkpoint=latest,
                env=dict(extra_env or {}),
                checkpoint_files=checkpoints.resume_files if latest is not None else None,
                config=worker_config,
                preload=scaling_config.preload_modules,
            )

        # TensorBoard and CSV logs: driver-side callbacks, ahead of the user's.
        sinks = default_sinks(run_dir, monitor)
        controller = Controller(
            launcher=launcher,
            make_spec=make_spec,
            world_size=scaling_config.max_workers,
            run_dir=run_dir,
            checkpoints=checkpoints,
            failure_policy=FailurePolicy(run_config.failure_config),
            progress=progress,
            callbacks=[*sinks, *run_config.callbacks],
            worker_timeout_s=timeout,
            stragglers=StragglerDetector(monitor.straggler_threshold, monitor.straggler_patience)
            if monitor.timing
            else None,
            elastic=elastic,
            stop_event=stop_event,
            # SIGTERM/SIGUSR1 to the driver are preemption notices (docs/fault-tolerance.md).
            notice_sources=[
                SignalNotice(),
                *run_config.failure_config.notice_sources,
                # The backend's own: a Ray node drain (launch.ray_drain).
                *(launcher.notice_sources() if isinstance(launcher, NoticeProvider) else ()),
            ],
            preemption_grace_s=run_config.failure_config.preemption_grace_s,
            spares=scaling_config.spares,
        )
        if isinstance(launcher, ColdStartReporter):  # the warm pool lost: an event, not a log
            launcher.on_cold_start(lambda reason: run_dir.write(ColdStartEvent(reason=reason)))
    except BaseException:
        if own_launcher:
            _close_launcher(launcher)
        raise
    try:
        result = controller.run()
        _requeue_if_preempted(controller.state.value, run_config)
        return result
    finally:
        for sink in sinks:  # also after Ctrl-C, when on_end is not called: files complete
            sink.close()  # type: ignore[attr-defined]
        if own_launcher:
            _close_launcher(launcher)
        if staging_dir is not None:
            shutil.rmtree(staging_dir, ignore_errors=True)


def _close_launcher(launcher: Launcher) -> None:
    """Release what a launcher holds (its warm worker pool, a Ray instance it started)."""
    if callable(getattr(launcher, "close", None)):
        launcher.close()  # type: ignore[attr-defined]
