"""Trial schedulers, named as in Ray Tune, backed by Optuna's pruners.

Units: a *step* is a report round counted from 1 (``training_iteration``), or the value of
``TuneConfig.time_attr``. ``grace_period=1`` lets a trial be stopped after its first report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import optuna


def _check(name: str, field: str, value: Any, minimum: float, strict: bool = False) -> None:
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if not bad:
        bad = value <= minimum if strict else value < minimum
    if bad:
        op = ">" if strict else ">="
        raise ValueError(f"{name}.{field} must be a number {op} {minimum:g}, got {value!r}")


def _integral(name: str, field: str, value: Any) -> None:
    if not float(value).is_integer():
        raise ValueError(f"{name}.{field} must be a whole number (Optuna's pruner), got {value!r}")


@dataclass(frozen=True)
class ASHAScheduler:
    """Asynchronous successive halving (ASHA; Li et al., "A System for Massively Parallel
    Hyperparameter Tuning", MLSys 2020), as Optuna's ``SuccessiveHalvingPruner``.

    Rungs are at steps ``grace_period * reduction_factor**k``. A trial reaching a rung continues
    only if its value is in the top ``1 / reduction_factor`` of the trials that reached that rung
    so far; trials are never waited for (asynchronous), so workers never idle.

    Args:
        grace_period: the first rung (steps, >= 1).
        reduction_factor: rung spacing and the inverse of the fraction kept (an int >= 2).
        max_t: informative only (a trial ends when its train function returns).
    """

    grace_period: int = 1
    reduction_factor: float = 3
    max_t: int | None = None

    def __post_init__(self) -> None:
        _check("ASHAScheduler", "grace_period", self.grace_period, 1)
        _check("ASHAScheduler", "reduction_factor", self.reduction_factor, 2)
        _integral("ASHAScheduler", "reduction_factor", self.reduction_factor)

    def to_pruner(self) -> optuna.pruners.BasePruner:
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=int(self.grace_period),
            reduction_factor=int(self.reduction_factor),
            min_early_stopping_rate=0,
        )


@dataclass(frozen=True)
class HyperbandScheduler:
    """Hyperband (Li et al., JMLR 2018): several successive-halving brackets with different
    grace periods, as Optuna's ``HyperbandPruner``.

    Args:
        grace_period: the smallest resource (steps, >= 1).
        max_t: the largest resource (steps), or ``"auto"`` (estimated from the first finished
            trial).
        reduction_factor: an int >= 2.
    """

    grace_period: int = 1
    max_t: int | str = "auto"
    reduction_factor: float = 3

    def __post_init__(self) -> None:
        _check("HyperbandScheduler", "grace_period", self.grace_period, 1)
        _check("HyperbandScheduler", "reduction_factor", self.reduction_factor, 2)
        _integral("HyperbandScheduler", "reduction_factor", self.reduction_factor)
        if self.max_t != "auto":
            _check("HyperbandScheduler", "max_t", self.max_t, self.grace_period, strict=True)

    def to_pruner(self) -> optuna.pruners.BasePruner:
        return optuna.pruners.HyperbandPruner(
            min_resource=int(self.grace_period),
            max_resource=self.max_t,
            reduction_factor=int(self.reduction_factor),
        )


@dataclass(frozen=True)
class MedianStoppingRule:
    """Stop a trial whose value at a step is worse than the median of the other trials' values at
    that step (Golovin et al., "Google Vizier", KDD 2017), as Optuna's ``MedianPruner``.

    Args:
        grace_period: never stop a trial before this step (>= 1).
        min_samples_required: trials that must have finished before any is stopped.
    """

    grace_period: int = 1
    min_samples_required: int = 3

    def __post_init__(self) -> None:
        _check("MedianStoppingRule", "grace_period", self.grace_period, 1)
        _check("MedianStoppingRule", "min_samples_required", self.min_samples_required, 0)

    def to_pruner(self) -> optuna.pruners.BasePruner:
        # Optuna's earliest pruning step is n_warmup_steps itself; steps count from 1 here.
        return optuna.pruners.MedianPruner(
            n_startup_trials=int(self.min_samples_required),
            n_warmup_steps=int(self.grace_period),
        )


@dataclass(frozen=True)
class FIFOScheduler:
    """No early stopping: every trial runs to its end."""

    def to_pruner(self) -> optuna.pruners.BasePruner:
        return optuna.pruners.NopPruner()


SCHEDULERS = (ASHAScheduler, HyperbandScheduler, MedianStoppingRule, FIFOScheduler)


def make_pruner(scheduler: Any) -> optuna.pruners.BasePruner:
    """The Optuna pruner of ``TuneConfig.scheduler``.

    Raises:
        TypeError: neither ``None``, one of this module's schedulers, nor an Optuna pruner.
    """
    if scheduler is None:
        return optuna.pruners.NopPruner()
    if isinstance(scheduler, optuna.pruners.BasePruner):
        return scheduler
    if isinstance(scheduler, SCHEDULERS):
        return scheduler.to_pruner()
    raise TypeError(
        "TuneConfig.scheduler must be None, tune.ASHAScheduler, tune.HyperbandScheduler, "
        "tune.MedianStoppingRule, tune.FIFOScheduler or an optuna.pruners.BasePruner, got "
        f"{type(scheduler).__name__}"
    )
