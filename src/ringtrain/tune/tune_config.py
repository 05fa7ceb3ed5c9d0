"""``TuneConfig``: how a sweep searches (metric, mode, trials, sampler, scheduler, capacity),
checked when constructed."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ringtrain.config import RunConfig, ScalingConfig

_MODES = ("max", "min")


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
        if not is_int(self.num_samples) or self.num_samples < 1:
            raise ValueError(
                f"TuneConfig.num_samples must be an int >= 1, got {self.num_samples!r}"
            )
        if self.max_concurrent_trials is not None and (
            not is_int(self.max_concurrent_trials) or self.max_concurrent_trials < 1
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
        if self.seed is not None and not is_int(self.seed):
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


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def checked_tuner_args(
    train_fn: Any,
    param_space: Mapping[str, Any] | None,
    tune_config: TuneConfig | None,
    scaling_config: ScalingConfig | None,
    run_config: RunConfig | None,
) -> tuple[
    Callable[..., Any],
    dict[str, Any] | None,
    Mapping[str, Any],
    TuneConfig,
    ScalingConfig,
    RunConfig,
]:
    """:class:`~ringtrain.tune.Tuner`'s arguments checked, with the defaults filled in.

    ``train_fn`` may be a :class:`ringtrain.Trainer` (``TorchTrainer``), as Ray Tune's
    ``trainable``: its train function, ``train_loop_config`` (which each trial's
    ``param_space["train_loop_config"]`` is merged into), scaling and run configs are used,
    the Tuner's own ``scaling_config`` and ``run_config`` taking precedence when given.

    Returns:
        ``(train_fn, trainer_loop_config, param_space, tune_config, scaling_config,
        run_config)``; ``trainer_loop_config`` is ``None`` for a plain function, else the
        trainer's ``train_loop_config`` (``{}`` when it has none).

    Raises:
        TypeError: an argument of the wrong type (naming it).
        ValueError: a ``metric`` without a ``mode`` (or the reverse), a scheduler without them,
            or a trainer's ``param_space`` key other than ``train_loop_config``.
    """
    from ringtrain.trainer import Trainer

    trainer_loop_config: dict[str, Any] | None = None
    if isinstance(train_fn, Trainer):
        trainer = train_fn
        train_fn = trainer.train_fn
        trainer_loop_config = dict(trainer.train_loop_config or {})
        scaling_config = scaling_config or trainer.scaling_config
        run_config = run_config or trainer.run_config
    if not callable(train_fn):
        raise TypeError(
            "Tuner(train_fn=...) must be callable or a ringtrain.Trainer (a TorchTrainer), got "
            f"{type(train_fn).__name__}"
        )
    if param_space is None:
        param_space = {}
    if not isinstance(param_space, Mapping):
        raise TypeError(f"Tuner(param_space=...) must be a dict, got {type(param_space).__name__}")
    if trainer_loop_config is not None:
        for key in param_space:
            if key != "train_loop_config":
                raise ValueError(
                    f"Tuner(trainer, param_space=...): param_space[{key!r}] cannot be searched; "
                    "a trainer's sweep searches param_space={'train_loop_config': {...}} (merged "
                    "into the trainer's train_loop_config); give the workers with "
                    "Tuner(scaling_config=...) or the trainer's"
                )
        if not isinstance(param_space.get("train_loop_config", {}), Mapping):
            raise TypeError("Tuner(param_space={'train_loop_config': ...}) must hold a dict")
    tune_config = tune_config or TuneConfig()
    if not isinstance(tune_config, TuneConfig):
        raise TypeError(
            "Tuner(tune_config=...) must be a ringtrain.tune.TuneConfig, got "
            f"{type(tune_config).__name__}"
        )
    _check_metric(tune_config)
    scaling_config = scaling_config or ScalingConfig()
    if not isinstance(scaling_config, ScalingConfig):
        raise TypeError(
            "Tuner(scaling_config=...) must be a ringtrain.ScalingConfig, got "
            f"{type(scaling_config).__name__}"
        )
    run_config = run_config or RunConfig()
    if not isinstance(run_config, RunConfig):
        raise TypeError(
            f"Tuner(run_config=...) must be a ringtrain.RunConfig, got {type(run_config).__name__}"
        )
    return train_fn, trainer_loop_config, param_space, tune_config, scaling_config, run_config


def _check_metric(tune_config: TuneConfig) -> None:
    """Metric and mode come together, or not at all (then nothing is optimised: every trial
    runs, and a scheduler has nothing to prune by)."""
    metric, mode = tune_config.metric, tune_config.mode
    if metric is not None and mode is None:
        raise ValueError(
            f"TuneConfig(metric={metric!r}) needs mode='max' or mode='min' (whether to maximise "
            "or minimise it)"
        )
    if mode is not None and metric is None:
        raise ValueError(
            f"TuneConfig(mode={mode!r}) needs metric=: the name of a metric your train function "
            "passes to report()"
        )
    if metric is None and tune_config.scheduler is not None:
        raise ValueError(
            f"TuneConfig(scheduler={tune_config.scheduler!r}) needs TuneConfig(metric=..., "
            "mode=...): the metric it prunes by"
        )


def merge_loop_config(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` updated with ``update``, nested dicts merged key by key (Ray Tune's
    ``merge_dicts``: a trial's ``param_space["train_loop_config"]`` over the trainer's
    ``train_loop_config``)."""
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_loop_config(out[key], value)
        else:
            out[key] = value
    return out
