"""Trial schedulers, named as in Ray Tune, mapped onto Optuna's pruners.

Units: a *step* is what the Tuner passes to ``trial.report(value, step)``: the report round
counted from 1 (``training_iteration``, as Ray Tune: the metrics of round ``r``, 0-based, are
step ``r + 1``), or the value of ``TuneConfig.time_attr``. ``grace_period=1`` lets a trial be
stopped right after its first report. The study's direction (``mode="max"``/``"min"``) decides
what "better" means; the schedulers take no ``metric``/``mode`` of their own.

Optuna's pruners decide when ``trial.should_prune()`` is called after each report; ASHA and
Hyperband record a trial's rung values at those calls, so the Tuner calls it after every report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna


def _whole(owner: str, name: str, value: Any, minimum: int, hint: str = "") -> None:
    ok = not isinstance(value, bool) and isinstance(value, int | float)
    ok = ok and float(value).is_integer() and value >= minimum
    if not ok:
        raise ValueError(f"{owner}.{name} must be a whole number >= {minimum}, got {value!r}{hint}")


_RF_HINT = " (Optuna's pruners take an int reduction factor; 2, 3 or 4 are usual)"


@dataclass(frozen=True)
class ASHAScheduler:
    """Asynchronous successive halving, ASHA (Li et al., "A System for Massively Parallel
    Hyperparameter Tuning", MLSys 2020, arXiv:1810.05934), as Optuna's
    ``SuccessiveHalvingPruner(min_resource=grace_period, reduction_factor,
    min_early_stopping_rate=0)``.

    Rungs are at steps ``grace_period * reduction_factor**k`` (k = 0, 1, ...): with the defaults,
    after reports 1, 3, 9, 27... A trial reaching a rung goes on only if its value there is in the
    top ``1 / reduction_factor`` of the values every trial had at that rung so far (the first
    ``reduction_factor - 1`` trials of a rung go on only if they are the best so far). No trial
    waits for others (asynchronous), so no worker idles.

    Args:
        grace_period: the first rung, in steps (int >= 1): no trial stops before it.
        reduction_factor: rung spacing, and the inverse of the fraction kept (int >= 2).
        max_t: the longest a trial runs, in steps (int >= grace_period), or None. Optuna's pruner
            has no maximum: the rungs go on while trials report, and a trial ends when its
            train function returns. Informative; the Tuner may stop trials there.

    Raises:
        ValueError: a field out of range, naming it.
    """

    grace_period: int = 1
    reduction_factor: float = 3
    max_t: int | None = None

    def __post_init__(self) -> None:
        _whole("ASHAScheduler", "grace_period", self.grace_period, 1)
        _whole("ASHAScheduler", "reduction_factor", self.reduction_factor, 2, _RF_HINT)
        if self.max_t is not None:
            _whole("ASHAScheduler", "max_t", self.max_t, int(self.grace_period), " (or None)")

    def to_pruner(self) -> optuna.pruners.BasePruner:
        """``optuna.pruners.SuccessiveHalvingPruner`` with these settings."""
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=int(self.grace_period),
            reduction_factor=int(self.reduction_factor),
            min_early_stopping_rate=0,
        )


@dataclass(frozen=True)
class HyperbandScheduler:
    """Hyperband (Li et al., "Hyperband: A Novel Bandit-Based Approach to Hyperparameter
    Optimization", JMLR 2018), as Optuna's ``HyperbandPruner(min_resource=grace_period,
    max_resource=max_t, reduction_factor)``.

    Hyperband hedges ASHA's choice of grace period: it runs ``floor(log_rf(max_t /
    grace_period)) + 1`` successive-halving brackets, bracket ``s`` with its first rung at
    ``grace_period * reduction_factor**s`` steps; each trial is assigned to a bracket (by Optuna,
    from a hash of its number) and competes only with the trials of its bracket.

    Args:
        grace_period: the smallest first rung, in steps (int >= 1).
        max_t: the largest resource, in steps (int >= grace_period), or ``"auto"``: Optuna
            takes the last step of the first finished trial, so nothing is stopped before one
            trial has finished.
        reduction_factor: int >= 2.

    Raises:
        ValueError: a field out of range, naming it.
    """

    grace_period: int = 1
    max_t: int | str = "auto"
    reduction_factor: float = 3

    def __post_init__(self) -> None:
        _whole("HyperbandScheduler", "grace_period", self.grace_period, 1)
        _whole("HyperbandScheduler", "reduction_factor", self.reduction_factor, 2, _RF_HINT)
        if self.max_t != "auto":
            _whole(
                "HyperbandScheduler", "max_t", self.max_t, int(self.grace_period), " (or 'auto')"
            )

    def to_pruner(self) -> optuna.pruners.BasePruner:
        """``optuna.pruners.HyperbandPruner`` with these settings."""
        return optuna.pruners.HyperbandPruner(
            min_resource=int(self.grace_period),
            max_resource=self.max_t if self.max_t == "auto" else int(self.max_t),
            reduction_factor=int(self.reduction_factor),
        )


@dataclass(frozen=True)
class MedianStoppingRule:
    """Stop a trial whose best value so far is worse than the median of the finished trials'
    values at the same step (the median stopping rule of Golovin et al., "Google Vizier", KDD
    2017), as Optuna's ``MedianPruner(n_startup_trials=min_samples_required,
    n_warmup_steps=grace_period, n_min_trials=min_samples_required)``.

    Differences from Vizier and Ray Tune: the median is over *finished* trials' values at that
    step (not running averages, and not running trials).

    Args:
        grace_period: the first step at which a trial may be stopped (int >= 1; Optuna's
            ``n_warmup_steps``, which allows pruning at ``step >= n_warmup_steps``).
        min_samples_required: how many finished trials must have reported that step before
            any trial is stopped there (int >= 0; 0 behaves as 1, the median needs a value).

    Raises:
        ValueError: a field out of range, naming it.
    """

    grace_period: int = 1
    min_samples_required: int = 3

    def __post_init__(self) -> None:
        _whole("MedianStoppingRule", "grace_period", self.grace_period, 1)
        _whole("MedianStoppingRule", "min_samples_required", self.min_samples_required, 0)

    def to_pruner(self) -> optuna.pruners.BasePruner:
        """``optuna.pruners.MedianPruner`` with these settings."""
        n = int(self.min_samples_required)
        return optuna.pruners.MedianPruner(
            n_startup_trials=n, n_warmup_steps=int(self.grace_period), n_min_trials=max(1, n)
        )


@dataclass(frozen=True)
class FIFOScheduler:
    """No early stopping: every trial runs until its train function returns (``NopPruner``)."""

    def to_pruner(self) -> optuna.pruners.BasePruner:
        """``optuna.pruners.NopPruner()``."""
        return optuna.pruners.NopPruner()


SCHEDULERS = (ASHAScheduler, HyperbandScheduler, MedianStoppingRule, FIFOScheduler)


def make_pruner(scheduler: Any) -> optuna.pruners.BasePruner:
    """The Optuna pruner of ``TuneConfig.scheduler``.

    Args:
        scheduler: ``None`` (no early stopping), one of this module's schedulers, or any
            ``optuna.pruners.BasePruner`` instance (used as is).

    Raises:
        TypeError: anything else (a scheduler class instead of an instance is named as such).
    """
    if scheduler is None:
        return optuna.pruners.NopPruner()
    if isinstance(scheduler, optuna.pruners.BasePruner):
        return scheduler
    if isinstance(scheduler, SCHEDULERS):
        return scheduler.to_pruner()
    if isinstance(scheduler, type) and issubclass(
        scheduler, (*SCHEDULERS, optuna.pruners.BasePruner)
    ):
        prefix = "tune." if scheduler in SCHEDULERS else ""
        raise TypeError(
            f"TuneConfig.scheduler must be an instance: {prefix}{scheduler.__name__}(), not the "
            "class"
        )
    raise TypeError(
        "TuneConfig.scheduler must be None, tune.ASHAScheduler(), tune.HyperbandScheduler(), "
        "tune.MedianStoppingRule(), tune.FIFOScheduler() or an optuna.pruners.BasePruner, got "
        f"{type(scheduler).__name__}"
    )
