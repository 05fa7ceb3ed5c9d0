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
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.launch.backends import backend_for
from ringtrain.rundir import RunDirectory
from ringtrain.tune.progress import SweepDisplay, TrialRow
from ringtrain.tune.resources import (
    ResourcePool,
    check_fits,
    trial_demand,
)
from ringtrain.tune.result import ResultGrid, _finite
from ringtrain.tune.sweep_files import (
    STUDY_FILE,
    SavedSweep,
    load_saved_sweep,
    write_sweep_files,
)
from ringtrain.tune.trial_launch import _TrialReporter, launch_trial, sweep_pool
from ringtrain.tune.trials import (
    TrialRun,
    dig,
    fmt_resources,
    judge,
    result_grid,
    row_from_study,
    tell_study,
    trial_dir_name,
)
from ringtrain.tune.tune_config import TuneConfig, checked_tuner_args, is_int, merge_loop_config

if TYPE_CHECKING:
    from ringtrain.launch.pool import WorkerPool

logger = logging.getLogger("ringtrain")


# ---------------------------------------------------------------------------------- tuner
class Tuner:
    """Runs a hyperparameter sweep whose trials are distributed training runs.

    Args:
        train_fn: the training function, as for :class:`~ringtrain.Trainer`; it receives each
            trial's configuration as ``config`` (``config["lr"]``, nested dicts as dicts). Or,
            as Ray Tune's ``trainable``, a :class:`~ringtrain.Trainer` (``TorchTrainer``): its
            function, scaling and run configs are used, and ``param_space={"train_loop_config":
            {...}}`` is merged into its ``train_loop_config`` for each trial.
        param_space: the search space: ``tune.uniform``, ``loguniform``, ``randint``,
            ``choice``, ``grid_search``, constants, and nested dicts of them.
        tune_config: metric, mode, number of trials, search algorithm, scheduler, capacity.
            Without ``metric`` and ``mode`` (as in Ray Tune) every trial runs, nothing is
            optimised (the default TPE gives way to random draws), and ``get_best_result``
            takes them.
        scaling_config: every trial's workers (default: the trainer's, else 1 worker).
        run_config: the sweep's name and storage path (the sweep directory is
            ``{storage_path}/{name}``), each trial's ``failure_config`` and
            ``checkpoint_config``, and the callbacks every trial gets (default: the trainer's).
        trainable: Ray Tune's name for ``train_fn`` (give one of the two).

    Raises:
        TypeError / ValueError: for a bad argument, before anything starts or is written.
    """

    def __init__(
        self,
        train_fn: Any = None,
        *,
        param_space: Mapping[str, Any] | None = None,
        tune_config: TuneConfig | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        trainable: Any = None,
    ) -> None:
        from ringtrain.tune.search import build_space

        if trainable is not None:
            if train_fn is not None:
                raise TypeError("Tuner() got both train_fn and trainable (Ray's name): give one")
            train_fn = trainable
        checked = checked_tuner_args(train_fn, param_space, tune_config, scaling_config, run_config)
        self.train_fn: Callable[..., Any] = checked[0]
        self._trainer_loop_config: dict[str, Any] | None = checked[1]
        self.param_space = dict(checked[2])
        self.tune_config = tune_config = checked[3]
        self.scaling_config = checked[4]
        self.run_config = checked[5]
        self.space = build_space(self.param_space, tune_config.search_alg)
        self.metric: str | None = tune_config.metric  # checked: both or neither
        self.mode: str | None = tune_config.mode
        self._lock = threading.RLock()  # all Optuna calls, and the trial table
        self._display: SweepDisplay | None = None

    def trial_loop_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The sampled ``config``, or for a trainer's sweep its ``train_loop_config`` with the
        sampled ``config["train_loop_config"]`` merged in (as Ray Tune): the trial's config."""
        if self._trainer_loop_config is None:
            return dict(config)
        return merge_loop_config(self._trainer_loop_config, config.get("train_loop_config", {}))

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
        from ringtrain.checkpoint.signing import resolve

        signer = resolve(signing_key, signing_key_file, trust_unsigned)
        saved, name, storage_path = load_saved_sweep(path, signer)
        run_config = dataclasses.replace(
            saved.run_config,
            name=name,
            storage_path=storage_path,
            signing_key=signing_key if signing_key is not None else signer.key,
            signing_key_file=signing_key_file,
            trust_unsigned=trust_unsigned,
        )
        tuner = cls(
            train_fn or saved.train_fn,
            param_space=saved.param_space,
            tune_config=saved.tune_config,
            scaling_config=saved.scaling_config,
            run_config=run_config,
        )
        tuner._trainer_loop_config = saved.trainer_loop_config
        return tuner

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
        # One warm worker pool for the whole sweep (an open rt.warm_pool block's, if any):
        # every trial forks its workers from it.
        self._worker_pool: WorkerPool | None
        self._worker_pool, end_pool = sweep_pool(self.scaling_config)
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
                # Without a metric TPE has no values to model: random draws (Ray's default).
                sampler=make_sampler(
                    "random" if self.metric is None and tc.search_alg == "tpe" else tc.search_alg,
                    tc.seed,
                ),
                pruner=make_pruner(tc.scheduler),
                direction="maximize" if self.mode == "max" else "minimize",
                load_if_exists=True,
            )
            with _sigterm_as_interrupt():
                return self._run(study, sweep, name, pool, demand, where)
        finally:
            backend.close()  # a Ray instance its capacity() started
            self._worker_pool = None
            end_pool()

    def _write_sweep_files(
        self, sweep: RunDirectory, name: str, capacity: dict[str, float]
    ) -> None:
        write_sweep_files(
            sweep,
            name,
            description={
                "metric": self.metric,
                "mode": self.mode,
                "tune_config": self.tune_config.to_dict(),
                "param_space": self.space.to_json(),
                "scaling_config": self.scaling_config.to_dict(),
                "capacity": capacity,
                "storage": self.tune_config.storage
                or f"sqlite:///{os.path.join(sweep.path, STUDY_FILE)}",
            },
            saved=SavedSweep(
                train_fn=self.train_fn,
                param_space=self.param_space,
                tune_config=self.tune_config,
                scaling_config=self.scaling_config,
                run_config=self.run_config,
                trainer_loop_config=self._trainer_loop_config,
            ),
        )

    def _run(
        self,
        study: Any,
        sweep: RunDirectory,
        name: str,
        pool: ResourcePool,
        demand: dict[str, float],
        where: str,
    ) -> ResultGrid:
        """Run the sweep's trials in ``study`` until ``num_samples`` x grid size have ended."""
        tc = self.tune_config
        grid = self.space.grid_points()
        total = tc.num_samples * len(grid)
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
        rows, resume = self._known_trials(study)
        started = len(rows)
        if started:
            display.line(
                f"[{name}] resuming the sweep in {sweep.uri}: {started} trials known, "
                f"{len(resume)} to continue from their checkpoints"
            )
        display.start(
            f"{total} trials, each {self.scaling_config.max_workers} workers "
            f"({fmt_resources(demand)}), up to {pool.concurrency(demand)} at once in "
            f"{fmt_resources(pool.capacity)} ({where}); study {study.study_name!r}"
        )
        running: dict[int, TrialRun] = {}
        try:
            self._schedule(study, sweep, pool, demand, rows, resume, running, started, total)
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

    def _known_trials(self, study: Any) -> tuple[dict[int, TrialRow], list[Any]]:
        """The rows of the trials a previous driver started (added to the display), and those
        of them still RUNNING in the study (to resume from their checkpoints)."""
        from optuna.trial import TrialState

        assert self._display is not None
        rows: dict[int, TrialRow] = {}
        resume: list[Any] = []
        for ft in study.get_trials(deepcopy=False):
            if ft.state == TrialState.WAITING:
                continue
            row = row_from_study(ft, self.space, self.mode)
            rows[ft.number] = row
            self._display.add(row)
            if ft.state == TrialState.RUNNING:
                resume.append(ft)
        return rows, resume

    def _schedule(
        self,
        study: Any,
        sweep: RunDirectory,
        pool: ResourcePool,
        demand: dict[str, float],
        rows: dict[int, TrialRow],
        resume: list[Any],
        running: dict[int, TrialRun],
        started: int,
        total: int,
    ) -> None:
        """Gang-schedule trials until ``total`` have started and every one has ended: record
        those that ended, then start (resumed ones first) as many as the free capacity holds.
        ``running`` is updated in place (the caller stops what it holds on an interrupt)."""
        import optuna

        assert self._display is not None
        distributions = self.space.all_distributions()
        while True:
            for number in [n for n, t in running.items() if t.done.is_set()]:
                trial = running.pop(number)
                pool.give_back(trial.demand, trial.gpus)
                self._finish(study, trial, rows[number])
            if not running and not resume and started >= total:
                return
            while (resume or started < total) and pool.fits(demand):
                if resume:
                    ft = resume.pop(0)
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
                rows[trial.number] = self._display.rows[trial.number]
            time.sleep(0.05)

    # ------------------------------------------------------------------ one trial
    def _start(
        self,
        otrial: Any,
        params: dict[str, Any],
        demand: dict[str, float],
        gpus: list[int],
        sweep: RunDirectory,
    ) -> TrialRun:
        number = otrial.number
        config = self.space.config(params)
        trial = TrialRun(number, otrial, self.trial_loop_config(config), demand, gpus)
        dir_name = trial_dir_name(number)
        with self._lock:
            otrial.set_user_attr("path", f"{sweep.uri}/{dir_name}")
            otrial.set_user_attr("num_workers", self.scaling_config.max_workers)
        assert self._display is not None
        shown = {c: dig(config, c) for c in self.space.param_columns()}
        existing = self._display.rows.get(number)
        row = TrialRow(number, shown, status="RUNNING", started=time.time())
        if existing is not None:  # a trial a previous driver started: keep what it showed
            row.iterations, row.last, row.best = existing.iterations, existing.last, existing.best
        self._display.add(row)
        self._display.update(number, "started")
        launch_trial(
            trial,
            train_fn=self.train_fn,
            dir_name=dir_name,
            sweep=sweep,
            scaling_config=self.scaling_config,
            run_config=self.run_config,
            worker_pool=getattr(self, "_worker_pool", None),
            on_round=self._on_round,
        )
        return trial

    def _on_round(self, trial: TrialRun, round_: int, metrics: dict[str, Any]) -> None:
        """Called on the trial's controller thread once every rank reported round ``round_``."""
        value = metrics.get(self.metric) if self.metric is not None else None
        if self.tune_config.time_attr == "training_iteration":
            step: Any = round_ + 1
        else:
            step = metrics.get(self.tune_config.time_attr)
            if not is_int(step):
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

    def _finish(self, study: Any, trial: TrialRun, row: TrialRow) -> None:
        """Record a trial whose controller returned: complete, pruned or failed."""
        from optuna.trial import TrialState

        assert self._display is not None
        duration = time.time() - trial.started
        worker_seconds = duration * self.scaling_config.max_workers
        with self._lock:
            otrial = trial.optuna_trial
            otrial.set_user_attr("duration_s", duration)
            otrial.set_user_attr("worker_seconds", worker_seconds)
        row.extra["worker_seconds"] = worker_seconds
        outcome = judge(trial, self.metric, row.last)
        changes: dict[str, Any] = {"status": outcome.status}
        if outcome.status == "COMPLETE":
            # Optuna records a value with every complete trial: 0 when the sweep has no metric.
            value = 0.0 if outcome.value is None else outcome.value
            tell_study(self._lock, study, otrial, TrialState.COMPLETE, value=value)
            changes["last"] = outcome.value
        elif outcome.status == "PRUNED":
            tell_study(self._lock, study, otrial, TrialState.PRUNED)
        else:
            tell_study(self._lock, study, otrial, TrialState.FAIL, error=outcome.error)
            changes["error"] = outcome.error
        self._display.update(trial.number, outcome.message, **changes, ended=time.time())

    # ------------------------------------------------------------------ outputs
    def _grid(self, study: Any, sweep: RunDirectory, rows: dict[int, TrialRow]) -> ResultGrid:
        return result_grid(study, sweep, rows, self.space, self.metric, self.mode)


_sweep_pool = sweep_pool  # the name it had before it moved to trial_launch.py
__all__ = ["ResultGrid", "TuneConfig", "Tuner", "_TrialReporter", "_sweep_pool"]
