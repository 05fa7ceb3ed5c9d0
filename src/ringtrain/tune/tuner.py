"""``Tuner(train_fn, param_space=..., tune_config=...).fit() -> ResultGrid``.

Every trial is an ordinary ringtrain run (an N-worker training job with the full fault
tolerance) in ``{storage_path}/{name}/trial_NNNN/``. Optuna chooses the hyperparameters and
decides pruning; ringtrain owns the rest:

- **asking**: each trial's configuration comes from ``study.ask()`` (grid points are enqueued
  first, ``num_samples`` times each), so any Optuna sampler drives the search;
- **gang scheduling**: a trial starts only when all its workers fit in the free capacity
  (:mod:`ringtrain.tune.resources`); trials run concurrently, each driven by its own controller
  in a thread of this process;
- **pruning**: rank 0's metrics of every completed report round are the trial's intermediate
  values (``trial.report(value, step=round + 1)``); when the pruner says so, the trial's
  controller stops its workers before they start another round, and the trial is recorded as
  pruned (not failed);
- **durability**: the study lives in an Optuna storage (SQLite in the sweep directory by
  default). A sweep whose driver died resumes with :meth:`Tuner.restore` or by running it again
  with the same name: finished trials are kept, trials that were running are run again, each
  resuming from its own latest checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.launch.backends import backend_for
from ringtrain.result import Result
from ringtrain.rundir import RunDirectory
from ringtrain.tune.progress import SweepDisplay, TrialRow
from ringtrain.tune.resources import (
    ResourcePool,
    check_fits,
    trial_demand,
)
from ringtrain.tune.result import ResultGrid, _finite, _result_from_dir

logger = logging.getLogger("ringtrain")

TUNER_FILE = "tuner.json"
TUNER_PAYLOAD = "tuner.pkl"
STUDY_FILE = "study.db"
_MODES = ("max", "min")


def trial_dir_name(number: int) -> str:
    """``trial_NNNN`` for Optuna trial number ``number`` (0-based)."""
    return f"trial_{number:04d}"


@dataclass(frozen=True)
class TuneConfig:
    """How a sweep searches.

    Attributes:
        metric: the name of the reported metric to optimise (a key of the ``report()`` metrics;
            rank 0's value of each report round is used).
        mode: ``"max"`` or ``"min"``.
        num_samples: trials to run; with ``grid_search`` values in the space, the number of
            times the whole grid is visited (total trials = ``num_samples`` x grid size, as Ray
            Tune).
        max_concurrent_trials: at most this many trials at once; ``None``: as many as the
            capacity holds (a trial needs all its workers at once).
        search_alg: ``"tpe"`` (default), ``"random"``, ``"grid"`` (every ``choice`` is a grid
            axis too) or any ``optuna.samplers.BaseSampler``.
        scheduler: ``ASHAScheduler``, ``HyperbandScheduler``, ``MedianStoppingRule``, any
            ``optuna.pruners.BasePruner``, or ``None`` (no pruning).
        resources: the capacity to schedule trials into, e.g. ``{"CPU": 16, "GPU": 4}``;
            ``None``: this host's cores and CUDA devices (local backend) or the Ray cluster's
            resources (``backend="ray"``).
        seed: the sampler's seed (reproducible suggestions).
        storage: an Optuna storage URL (``"postgresql://..."``, ``"sqlite:///path.db"``);
            ``None``: ``sqlite:///{storage_path}/{name}/study.db``.
        time_attr: the Optuna step of each intermediate value: ``"training_iteration"`` (report
            rounds counted from 1) or the name of an integer metric the train function reports
            (e.g. ``"epoch"``).
        progress: the sweep's display: ``"auto"``, ``"rich"``, ``"plain"`` or ``"off"``;
            ``None``: ``RunConfig.progress``. Trials themselves print nothing.

    Raises:
        ValueError / TypeError: on a bad value, naming the field (when constructed).
    """

    metric: str | None = None
    mode: str | None = None
    num_samples: int = 1
    max_concurrent_trials: int | None = None
    search_alg: Any = "tpe"
    scheduler: Any = None
    resources: Mapping[str, float] | None = None
    seed: int | None = None
    storage: str | None = None
    time_attr: str = "training_iteration"
    progress: str | None = None

    def __post_init__(self) -> None:
        if self.metric is not None and (not isinstance(self.metric, str) or not self.metric):
            raise TypeError(f"TuneConfig.metric must be a metric name, got {self.metric!r}")
        if self.mode is not None and self.mode not in _MODES:
            raise ValueError(f"TuneConfig.mode must be 'max' or 'min', got {self.mode!r}")
        if not _is_int(self.num_samples) or self.num_samples < 1:
            raise ValueError(
                f"TuneConfig.num_samples must be an int >= 1, got {self.num_samples!r}"
            )
        if self.max_concurrent_trials is not None and (
            not _is_int(self.max_concurrent_trials) or self.max_concurrent_trials < 1
        ):
            raise ValueError(
                "TuneConfig.max_concurrent_trials must be None (as many as fit) or an int >= 1, "
                f"got {self.max_concurrent_trials!r}"
            )
        if self.resources is not None:
            if not isinstance(self.resources, Mapping) or not self.resources:
                raise TypeError(
                    "TuneConfig.resources must be a dict like {'CPU': 8, 'GPU': 2}, got "
                    f"{self.resources!r}"
                )
            for k, v in self.resources.items():
                if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int | float):
                    raise TypeError(f"TuneConfig.resources[{k!r}] must be a number, got {v!r}")
                if v < 0 or not math.isfinite(v):
                    raise ValueError(f"TuneConfig.resources[{k!r}] must be >= 0, got {v!r}")
            object.__setattr__(self, "resources", {k: float(v) for k, v in self.resources.items()})
        if self.seed is not None and not _is_int(self.seed):
            raise TypeError(f"TuneConfig.seed must be an int or None, got {self.seed!r}")
        if self.storage is not None and (
            not isinstance(self.storage, str) or "://" not in self.storage
        ):
            raise ValueError(
                "TuneConfig.storage must be an Optuna storage URL such as "
                f"'sqlite:///sweep.db' or 'postgresql://user@host/db', got {self.storage!r}"
            )
        if not isinstance(self.time_attr, str) or not self.time_attr:
            raise TypeError(f"TuneConfig.time_attr must be a metric name, got {self.time_attr!r}")
        if self.progress is not None and str(self.progress).lower() not in (
            "auto",
            "rich",
            "plain",
            "off",
        ):
            raise ValueError(
                "TuneConfig.progress must be 'auto', 'rich', 'plain', 'off' or None, got "
                f"{self.progress!r}"
            )
        # The sampler and pruner are checked here, before anything starts (their errors name
        # the field).
        from ringtrain.tune.schedulers import make_pruner
        from ringtrain.tune.search import make_sampler

        make_sampler(self.search_alg, self.seed)
        make_pruner(self.scheduler)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able description (samplers and pruners by their repr)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v if v is None or isinstance(v, str | int | float | dict) else repr(v)
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# ---------------------------------------------------------------------------------- tuner
@dataclass
class _Trial:
    """One trial run by this driver."""

    number: int
    optuna_trial: Any
    config: dict[str, Any]
    demand: dict[str, float]
    gpus: list[int]
    stop: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    pruned_at: int | None = None
    result: Result | None = None
    exception: BaseException | None = None
    started: float = field(default_factory=time.time)
    thread: threading.Thread | None = None


class _TrialReporter:
    """The trial's driver-side callback: rank 0's metrics of each report round become the
    Optuna trial's intermediate values; a pruning decision stops the trial's workers."""

    def __init__(self, tuner: Tuner, trial: _Trial) -> None:
        self.tuner = tuner
        self.trial = trial

    def on_round(self, round_: int, metrics: dict[str, Any]) -> None:
        self.tuner._on_round(self.trial, round_, metrics)


class Tuner:
    """Runs a hyperparameter sweep whose trials are distributed training runs.

    Args:
        train_fn: the training function, as for :class:`~ringtrain.Trainer`; it receives each
            trial's configuration as ``config`` (``config["lr"]``, nested dicts as dicts).
        param_space: the search space: ``tune.uniform``, ``loguniform``, ``randint``,
            ``choice``, ``grid_search``, constants, and nested dicts of them.
        tune_config: metric, mode, number of trials, search algorithm, scheduler, capacity.
        scaling_config: every trial's workers (default: 1 worker).
        run_config: the sweep's name and storage path (the sweep directory is
            ``{storage_path}/{name}``), each trial's ``failure_config`` and
            ``checkpoint_config``, and the callbacks every trial gets.

    Raises:
        TypeError / ValueError: for a bad argument, before anything starts or is written.
    """

    def __init__(
        self,
        train_fn: Callable[..., Any],
        *,
        param_space: Mapping[str, Any] | None = None,
        tune_config: TuneConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
    ) -> None:
        from ringtrain.tune.search import build_space

        if not callable(train_fn):
            raise TypeError(f"Tuner(train_fn=...) must be callable, got {type(train_fn).__name__}")
        if param_space is None:
            param_space = {}
        if not isinstance(param_space, Mapping):
            raise TypeError(
                f"Tuner(param_space=...) must be a dict, got {type(param_space).__name__}"
            )
        tune_config = tune_config or TuneConfig()
        if not isinstance(tune_config, TuneConfig):
            raise TypeError(
                "Tuner(tune_config=...) must be a ringtrain.tune.TuneConfig, got "
                f"{type(tune_config).__name__}"
            )
        if tune_config.metric is None or tune_config.mode is None:
            raise ValueError(
                "TuneConfig needs metric= and mode=: the name of a metric your train function "
                "passes to report() and whether to 'max' or 'min' it, e.g. "
                "TuneConfig(metric='val_acc', mode='max')"
            )
        scaling_config = scaling_config or ScalingConfig()
        if not isinstance(scaling_config, ScalingConfig):
            raise TypeError(
                "Tuner(scaling_config=...) must be a ringtrain.ScalingConfig, got "
                f"{type(scaling_config).__name__}"
            )
        run_config = run_config or RunConfig()
        if not isinstance(run_config, RunConfig):
            raise TypeError(
                "Tuner(run_config=...) must be a ringtrain.RunConfig, got "
                f"{type(run_config).__name__}"
            )
        self.train_fn = train_fn
        self.param_space = dict(param_space)
        self.tune_config = tune_config
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.space = build_space(self.param_space, tune_config.search_alg)
        self.metric: str = tune_config.metric
        self.mode: str = tune_config.mode
        self._lock = threading.RLock()  # all Optuna calls, and the trial table
        self._display: SweepDisplay | None = None

    # ------------------------------------------------------------------ restore
    @classmethod
    def restore(
        cls,
        path: str,
        train_fn: Callable[..., Any] | None = None,
        *,
        signing_key: bytes | str | None = None,
        signing_key_file: str | None = None,
        trust_unsigned: bool = False,
    ) -> Tuner:
        """A Tuner that continues the sweep in directory ``path`` (after its driver died, was
        interrupted, or finished: ``fit()`` then only collects the results).

        Args:
            path: the sweep directory, ``{storage_path}/{name}``.
            train_fn: the training function; default: the one the sweep was started with
                (stored in the sweep directory with cloudpickle).
            signing_key: the key ``tuner.pkl`` was signed with (default:
                ``$RINGTRAIN_SIGNING_KEY`` or your key file).
            signing_key_file: a file holding that key, instead of ``signing_key``.
            trust_unsigned: accept ``tuner.pkl`` unsigned (it is code: only if you trust
                whoever can write the storage).

        Raises:
            FileNotFoundError: if ``path`` is not a sweep directory (no ``tuner.pkl``).
            SignatureError (a ValueError): ``tuner.pkl`` is not signed for this sweep with the
                key (checked before it is unpickled).
        """
        import cloudpickle
        import fsspec

        from ringtrain.checkpoint.signing import SIG_SUFFIX, resolve

        signer = resolve(signing_key, signing_key_file, trust_unsigned)
        fs, stripped = fsspec.core.url_to_fs(path)
        payload = stripped.rstrip("/") + "/" + TUNER_PAYLOAD
        if not fs.exists(payload):
            raise FileNotFoundError(f"{path} is not a sweep directory (no {TUNER_PAYLOAD})")
        parent, _, name = stripped.rstrip("/").rpartition("/")
        with fs.open(payload, "rb") as f:
            data = f.read()
        try:
            with fs.open(payload + SIG_SUFFIX, "rb") as f:
                sidecar = f.read()
        except FileNotFoundError:
            sidecar = None
        signer.check_sidecar(data, sidecar, TUNER_PAYLOAD, name, f"{path}/{TUNER_PAYLOAD}")
        saved = cloudpickle.loads(data)
        from ringtrain.checkpoint.storage import is_local_fs

        storage_path = os.path.abspath(parent) if is_local_fs(fs) else fs.unstrip_protocol(parent)
        run_config = dataclasses.replace(
            saved["run_config"],
            name=name,
            storage_path=storage_path,
            signing_key=signing_key if signing_key is not None else signer.key,
            signing_key_file=signing_key_file,
            trust_unsigned=trust_unsigned,
        )
        return cls(
            train_fn or saved["train_fn"],
            param_space=saved["param_space"],
            tune_config=saved["tune_config"],
            scaling_config=saved["scaling_config"],
            run_config=run_config,
        )

    # ------------------------------------------------------------------ fit
    def fit(self) -> ResultGrid:
        """Run the sweep until ``num_samples`` trials (x grid size) have ended.

        Returns:
            the :class:`ResultGrid` of every trial of the sweep (including those a previous
            driver finished).

        Raises:
            ValueError: when a trial cannot fit in the capacity, or the sweep directory is on
                remote storage without ``TuneConfig(storage=...)``.
            KeyboardInterrupt: on Ctrl-C / SIGTERM, after every trial's workers stopped; the
                running trials stay ``RUNNING`` in the study and resume with
                :meth:`Tuner.restore`.
        """
        import optuna

        from ringtrain.trainer import _sigterm_as_interrupt, default_run_name
        from ringtrain.tune.schedulers import make_pruner
        from ringtrain.tune.search import make_sampler

        tc = self.tune_config
        name = self.run_config.name or default_run_name(getattr(self.train_fn, "__name__", "tune"))
        sweep = RunDirectory(self.run_config.storage_path, name)
        if not sweep.is_local and tc.storage is None:
            raise ValueError(
                f"the sweep directory {sweep.uri} is not on a local disk, where the default "
                "SQLite study lives: pass TuneConfig(storage='postgresql://...') (any Optuna "
                "RDB URL)"
            )
        demand = trial_demand(self.scaling_config)
        backend = backend_for(self.scaling_config)
        if tc.resources is not None:
            capacity, where = dict(tc.resources), "TuneConfig.resources"
        else:  # this machine's, or the Ray cluster's (joined, or started, here)
            found = backend.capacity()
            capacity, where = found.resources, found.where
        try:
            check_fits(demand, capacity, where)
            pool = ResourcePool(capacity, tc.max_concurrent_trials)
            sweep.create()
            self._write_sweep_files(sweep, name, capacity)
            storage = tc.storage or f"sqlite:///{os.path.join(sweep.path, STUDY_FILE)}"
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.create_study(
                study_name=name,
                storage=storage,
                sampler=make_sampler(tc.search_alg, tc.seed),
                pruner=make_pruner(tc.scheduler),
                direction="maximize" if self.mode == "max" else "minimize",
                load_if_exists=True,
            )
            with _sigterm_as_interrupt():
                return self._run(study, sweep, name, pool, demand, where)
        finally:
            backend.close()  # a Ray instance its capacity() started

    def _write_sweep_files(
        self, sweep: RunDirectory, name: str, capacity: dict[str, float]
    ) -> None:
        import cloudpickle

        from ringtrain import __version__

        sweep.write_json(
            TUNER_FILE,
            {
                "name": name,
                "kind": "sweep",
                "ringtrain_version": __version__,
                "created": time.time(),
                "metric": self.metric,
                "mode": self.mode,
                "tune_config": self.tune_config.to_dict(),
                "param_space": self.space.to_json(),
                "scaling_config": self.scaling_config.to_dict(),
                "capacity": capacity,
                "storage": self.tune_config.storage
                or f"sqlite:///{os.path.join(sweep.path, STUDY_FILE)}",
            },
        )
        from ringtrain.checkpoint.signing import from_run_config

        signer = from_run_config(self.run_config)
        # The key never goes to storage, nor does the choice to trust unsigned data.
        run_config = dataclasses.replace(
            self.run_config, signing_key=None, signing_key_file=None, trust_unsigned=False
        )
        saved = {
            "train_fn": self.train_fn,
            "param_space": self.param_space,
            "tune_config": self.tune_config,
            "scaling_config": self.scaling_config,
            "run_config": run_config,
        }
        try:
            data = cloudpickle.dumps(saved)
        except Exception as exc:  # e.g. a callback holding a socket
            logger.warning(
                "RunConfig.callbacks cannot be pickled (%s); Tuner.restore will run without them",
                exc,
            )
            saved["run_config"] = dataclasses.replace(run_config, callbacks=[])
            try:
                data = cloudpickle.dumps(saved)
            except Exception as exc2:
                raise TypeError(
                    "train_fn and param_space must be picklable (they are stored in the sweep "
                    f"directory for Tuner.restore and shipped to the workers): {exc2}"
                ) from exc2
        sweep.write_bytes(TUNER_PAYLOAD, data)
        sweep.write_bytes(TUNER_PAYLOAD + ".sig", signer.sidecar(data, TUNER_PAYLOAD, name))

    def _run(
        self,
        study: Any,
        sweep: RunDirectory,
        name: str,
        pool: ResourcePool,
        demand: dict[str, float],
        where: str,
    ) -> ResultGrid:
        from optuna.trial import TrialState

        tc = self.tune_config
        grid = self.space.grid_points()
        total = tc.num_samples * len(grid)
        distributions = self.space.all_distributions()
        if not study.user_attrs.get("ringtrain_enqueued"):
            for _ in range(tc.num_samples):
                for point in grid:
                    if point:
                        study.enqueue_trial(self.space.encode(point), skip_if_exists=False)
            study.set_user_attr("ringtrain_enqueued", True)
            study.set_user_attr("ringtrain_total_trials", total)

        display = SweepDisplay(
            name,
            self.metric,
            self.mode,
            self.space.param_columns(),
            tc.progress or self.run_config.progress,
            total=total,
        )
        self._display = display
        rows: dict[int, TrialRow] = {}
        resume: list[Any] = []
        started = 0
        for ft in study.get_trials(deepcopy=False):
            if ft.state == TrialState.WAITING:
                continue
            started += 1
            row = self._row_of(ft)
            rows[ft.number] = row
            display.add(row)
            if ft.state == TrialState.RUNNING:
                resume.append(ft)
        if started:
            display.line(
                f"[{name}] resuming the sweep in {sweep.uri}: {started} trials known, "
                f"{len(resume)} to continue from their checkpoints"
            )
        display.start(
            f"{total} trials, each {self.scaling_config.max_workers} workers "
            f"({_fmt_resources(demand)}), up to {pool.concurrency(demand)} at once in "
            f"{_fmt_resources(pool.capacity)} ({where}); study {study.study_name!r}"
        )
        running: dict[int, _Trial] = {}
        try:
            while True:
                for number in [n for n, t in running.items() if t.done.is_set()]:
                    trial = running.pop(number)
                    pool.give_back(trial.demand, trial.gpus)
                    self._finish(study, trial, rows[number])
                if not running and not resume and started >= total:
                    break
                while (resume or started < total) and pool.fits(demand):
                    if resume:
                        ft = resume.pop(0)
                        import optuna

                        otrial = optuna.trial.Trial(study, ft._trial_id)
                        params = dict(ft.params)
                    else:
                        with self._lock:
                            otrial = study.ask(distributions)
                        params = dict(otrial.params)
                        started += 1
                    gpus = pool.take(demand)
                    trial = self._start(otrial, params, demand, gpus, sweep)
                    running[trial.number] = trial
                    rows[trial.number] = display.rows[trial.number]
                time.sleep(0.05)
        except BaseException:
            for trial in running.values():
                trial.stop.set()
            for trial in running.values():
                if trial.thread is not None:
                    trial.thread.join()
            display.close()
            display.line(
                f"[{name}] sweep interrupted: {len(running)} running trials stopped; continue "
                f"with Tuner.restore({sweep.uri!r}) or `ringtrain tune --resume {sweep.uri}`"
            )
            raise
        display.summary()  # replaces the live table, so that the final one is shown once
        display.close()
        return self._grid(study, sweep, rows)

    # ------------------------------------------------------------------ one trial
    def _start(
        self,
        otrial: Any,
        params: dict[str, Any],
        demand: dict[str, float],
        gpus: list[int],
        sweep: RunDirectory,
    ) -> _Trial:
        from ringtrain.trainer import _pickle_payload, run_workers

        number = otrial.number
        config = self.space.config(params)
        trial = _Trial(number, otrial, config, demand, gpus)
        dir_name = trial_dir_name(number)
        with self._lock:
            otrial.set_user_attr("path", f"{sweep.uri}/{dir_name}")
            otrial.set_user_attr("num_workers", self.scaling_config.max_workers)
        assert self._display is not None
        shown = {c: _dig(config, c) for c in self.space.param_columns()}
        existing = self._display.rows.get(number)
        row = TrialRow(number, shown, status="RUNNING", started=time.time())
        if existing is not None:  # a trial a previous driver started: keep what it showed
            row.iterations, row.last, row.best = existing.iterations, existing.last, existing.best
        self._display.add(row)
        self._display.update(number, "started")
        scaling = self.scaling_config
        if not (scaling.resources_per_worker and "CPU" in scaling.resources_per_worker):
            # Each worker gets the 1 CPU it was scheduled with (its torch thread count).
            scaling = dataclasses.replace(
                scaling, resources_per_worker={**(scaling.resources_per_worker or {}), "CPU": 1}
            )
        extra_env = backend_for(scaling).trial_env(gpus)
        run_config = dataclasses.replace(
            self.run_config,
            name=dir_name,
            storage_path=sweep.uri,
            progress="off",
            callbacks=[*self.run_config.callbacks, _TrialReporter(self, trial)],
        )
        payload = _pickle_payload(self.train_fn, config)

        def target() -> None:
            try:
                trial.result = run_workers(
                    name=dir_name,
                    entrypoint=getattr(self.train_fn, "__name__", "train"),
                    scaling_config=scaling,
                    run_config=run_config,
                    payload=payload,
                    train_loop_config=config,
                    stop_event=trial.stop,
                    extra_env=extra_env,
                )
            except BaseException as exc:  # reported by the main thread
                trial.exception = exc
            finally:
                trial.done.set()

        trial.thread = threading.Thread(target=target, name=f"ringtrain-{dir_name}", daemon=True)
        trial.thread.start()
        return trial

    def _on_round(self, trial: _Trial, round_: int, metrics: dict[str, Any]) -> None:
        """Called on the trial's controller thread once every rank reported round ``round_``."""
        value = metrics.get(self.metric)
        if self.tune_config.time_attr == "training_iteration":
            step: Any = round_ + 1
        else:
            step = metrics.get(self.tune_config.time_attr)
            if not _is_int(step):
                logger.warning(
                    "trial %d: report round %d has no integer %r (TuneConfig.time_attr); its "
                    "%r is not used for pruning",
                    trial.number,
                    round_,
                    self.tune_config.time_attr,
                    self.metric,
                )
                return
        assert self._display is not None
        row = self._display.rows[trial.number]
        changes: dict[str, Any] = {"iterations": round_ + 1}
        if not _finite(value):
            self._display.update(trial.number, None, **changes)
            return
        value = float(value)  # type: ignore[arg-type]  # _finite: a real number
        best = row.best
        if best is None or (value > best if self.mode == "max" else value < best):
            best = value
        changes.update(last=value, best=best)
        self._display.update(trial.number, None, **changes)
        if trial.stop.is_set():
            return
        with self._lock:
            trial.optuna_trial.report(value, step)
            prune = trial.optuna_trial.should_prune()
        if prune:
            trial.pruned_at = round_ + 1
            trial.stop.set()  # the controller stops the workers before their next round

    def _finish(self, study: Any, trial: _Trial, row: TrialRow) -> None:
        """Record a trial whose controller returned: complete, pruned or failed."""
        from optuna.trial import TrialState

        assert self._display is not None
        result = trial.result
        duration = time.time() - trial.started
        worker_seconds = duration * self.scaling_config.max_workers
        with self._lock:
            otrial = trial.optuna_trial
            otrial.set_user_attr("duration_s", duration)
            otrial.set_user_attr("worker_seconds", worker_seconds)
        row.extra["worker_seconds"] = worker_seconds
        if trial.exception is not None or result is None:
            exc = trial.exception
            why = f"{type(exc).__name__}: {exc}" if exc is not None else "no result"
            self._tell(study, otrial, TrialState.FAIL, error=why)
            self._display.update(
                trial.number, f"FAILED: {why}", status="FAILED", error=why, ended=time.time()
            )
            return
        if trial.pruned_at is not None:
            self._tell(study, otrial, TrialState.PRUNED)
            self._display.update(
                trial.number,
                f"PRUNED at iteration {trial.pruned_at} ({self.metric}={_fmt(row.last)})",
                status="PRUNED",
                ended=time.time(),
            )
            return
        if result.error is not None:
            why = str(result.error).splitlines()[0]
            self._tell(study, otrial, TrialState.FAIL, error=why)
            self._display.update(
                trial.number,
                f"FAILED after {len(result.failures)} failures: {why}",
                status="FAILED",
                error=why,
                ended=time.time(),
            )
            return
        value = result.metrics.get(self.metric)
        if not _finite(value):
            why = (
                f"the train function's last report() has no finite {self.metric!r} "
                f"(TuneConfig.metric); it reported {sorted(result.metrics)}"
            )
            self._tell(study, otrial, TrialState.FAIL, error=why)
            self._display.update(
                trial.number, f"FAILED: {why}", status="FAILED", error=why, ended=time.time()
            )
            return
        final = float(value)  # type: ignore[arg-type]  # _finite: a real number
        self._tell(study, otrial, TrialState.COMPLETE, value=final)
        self._display.update(
            trial.number,
            f"COMPLETE: {self.metric}={_fmt(final)}",
            status="COMPLETE",
            last=final,
            ended=time.time(),
        )

    def _tell(
        self,
        study: Any,
        otrial: Any,
        state: Any,
        value: float | None = None,
        error: str | None = None,
    ) -> None:
        with self._lock:
            if error is not None:
                otrial.set_user_attr("error", error)
            if value is not None:
                study.tell(otrial, value)
            else:
                study.tell(otrial, state=state)

    # ------------------------------------------------------------------ outputs
    def _row_of(self, ft: Any) -> TrialRow:
        """The table row of a trial as the study holds it (a previous driver's trials)."""
        from optuna.trial import TrialState

        status = {
            TrialState.COMPLETE: "COMPLETE",
            TrialState.PRUNED: "PRUNED",
            TrialState.FAIL: "FAILED",
            TrialState.RUNNING: "PENDING",
        }.get(ft.state, str(ft.state))
        config = self.space.config(ft.params) if ft.params else {}
        values = [v for _, v in sorted(ft.intermediate_values.items()) if _finite(v)]
        last = ft.value if ft.value is not None else (values[-1] if values else None)
        pick = max if self.mode == "max" else min
        row = TrialRow(
            ft.number,
            {c: _dig(config, c) for c in self.space.param_columns()},
            status=status,
            iterations=max(ft.intermediate_values, default=0),
            last=last,
            best=pick(values) if values else last,
            error=ft.user_attrs.get("error"),
        )
        if ft.datetime_start is not None:
            row.started = ft.datetime_start.timestamp()
            end = ft.datetime_complete or ft.datetime_start
            row.ended = end.timestamp()
        if "duration_s" in ft.user_attrs:
            row.started = (row.ended or time.time()) - float(ft.user_attrs["duration_s"])
        row.extra["worker_seconds"] = ft.user_attrs.get("worker_seconds")
        return row

    def _grid(self, study: Any, sweep: RunDirectory, rows: dict[int, TrialRow]) -> ResultGrid:
        results: list[Result] = []
        ordered: list[TrialRow] = []
        for ft in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
            if ft.number not in rows:
                continue
            row = rows[ft.number]
            config = self.space.config(ft.params) if ft.params else {}
            results.append(_result_from_dir(sweep, trial_dir_name(ft.number), config))
            ordered.append(row)
        return ResultGrid(
            results,
            ordered,
            path=sweep.uri,
            metric=self.metric,
            mode=self.mode,
            columns=self.space.param_columns(),
            study=study,
        )


def _dig(config: Mapping[str, Any], flat_key: str) -> Any:
    cur: Any = config
    for part in flat_key.split("/"):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, int | float) else str(v)


def _fmt_resources(r: Mapping[str, float]) -> str:
    return ", ".join(f"{v:g} {k}" for k, v in sorted(r.items()))
