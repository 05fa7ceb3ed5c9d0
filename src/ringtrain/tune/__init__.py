"""Hyperparameter sweeps whose trials are distributed training runs (docs/tune.md).

::

    from ringtrain import tune

    tuner = tune.Tuner(
        train_fn,
        param_space={"lr": tune.loguniform(1e-4, 1e-1), "width": tune.choice([64, 128])},
        tune_config=tune.TuneConfig(metric="val_acc", mode="max", num_samples=16,
                                    scheduler=tune.ASHAScheduler(grace_period=1)),
        scaling_config=rt.ScalingConfig(num_workers=2),
    )
    best = tuner.fit().get_best_result()

Search and pruning come from Optuna (``pip install 'ringtrain[tune]'``); ringtrain schedules the
trials (gang scheduling on the local host or a Ray cluster) and runs each as a fault-tolerant
N-worker job.
"""

from __future__ import annotations

try:
    import optuna  # noqa: F401
except ImportError as exc:  # the base install (tests/e2e/test_base_install.py)
    raise ImportError(
        f"ringtrain.tune needs Optuna, which cannot be imported ({exc}): "
        "pip install 'ringtrain[tune]'",
        name=exc.name,
    ) from exc

from ringtrain.tune.schedulers import (
    ASHAScheduler,
    FIFOScheduler,
    HyperbandScheduler,
    MedianStoppingRule,
)
from ringtrain.tune.search import (
    choice,
    grid_search,
    lograndint,
    loguniform,
    qrandint,
    quniform,
    randint,
    uniform,
)
from ringtrain.tune.tuner import ResultGrid, TuneConfig, Tuner

__all__ = [
    "ASHAScheduler",
    "FIFOScheduler",
    "HyperbandScheduler",
    "MedianStoppingRule",
    "ResultGrid",
    "TuneConfig",
    "Tuner",
    "choice",
    "grid_search",
    "lograndint",
    "loguniform",
    "qrandint",
    "quniform",
    "randint",
    "uniform",
]
