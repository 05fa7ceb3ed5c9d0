"""Experiment trackers as driver-side callbacks: MLflow and Weights & Biases.

Neither package is a dependency of ringtrain: each callback imports its package when it is
constructed and raises ``ImportError`` with the ``pip install`` line when it is missing. Both log
the same things:

- params / config: the ``config`` dict given to the callback (nothing else is read), once, when
  the tracker run is created on the first event;
- rank 0's metrics of every completed round (``on_round``), under their own names, at step = the
  round's int ``"step"`` metric, else the round;
- each rank's timing windows (``on_timing``) as ``timing/rank_<r>/<field>`` at the window's step;
- straggler events (``on_straggler``): ``stragglers/rank_<r>`` = 1 (flagged) or 0 (cleared), and
  the message as a tag (MLflow) or summary entry (W&B);
- failures the run recovered from or died of (``on_failure``), as a tag / summary entry;
- the end (``on_end``): the tracker run ends ``FINISHED``, or ``FAILED`` when the run failed.

A driver interrupted by Ctrl-C gets no ``on_end``: its tracker run stays "running" there.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import Any

from ringtrain.monitor.sinks import TIMING_FIELDS, is_number, step_of, window_step

__all__ = ["MLflowCallback", "WandbCallback"]


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"opt": {"lr": 0.1}}`` -> ``{"opt.lr": 0.1}``."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def _timing_values(rank: int, window: dict[str, Any]) -> dict[str, float]:
    return {
        f"timing/rank_{rank}/{field}": float(window[field])
        for field in TIMING_FIELDS
        if is_number(window.get(field))
    }


class MLflowCallback:
    """Logs a run to MLflow (the ``mlflow`` or ``mlflow-skinny`` package).

    Uses an ``MlflowClient`` (no global active run is touched, so a run of your own stays
    active). The MLflow run is created on the first event. Metric names keep letters, digits and
    ``_ - . / space``; other characters become ``_``. Param values longer than 500 characters are
    cut (the limit of older MLflow servers).

    Args:
        tracking_uri: where MLflow stores runs: ``http://host:5000``, ``databricks``, a
            ``sqlite:///mlflow.db`` or ``file:/path/mlruns`` store (default: MLflow's own,
            ``MLFLOW_TRACKING_URI``).
        experiment_name: the experiment, created if missing (default: ``"Default"``).
        run_name: the MLflow run's name (default: MLflow picks one).
        config: logged as the run's params (nested dicts as ``outer.inner`` keys), e.g. your
            ``train_loop_config``.

    Raises:
        ImportError: when MLflow is not installed (``pip install mlflow-skinny``).
    """

    MAX_PARAM_LENGTH = 500

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        try:
            from mlflow.entities import Metric, Param
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(
                "MLflowCallback needs MLflow: pip install mlflow-skinny (or pip install mlflow)"
            ) from exc
        self._Metric: Any = Metric
        self._Param: Any = Param
        self.client: Any = MlflowClient(tracking_uri=tracking_uri)
        self.experiment_name = experiment_name or "Default"
        self.run_name = run_name
        self.config = dict(config or {})
        self.run_id: str | None = None
        self._last_step: dict[int, int] = {}
        self._step = 0

    def _run(self) -> str:
        if self.run_id is None:
            experiment = self.client.get_experiment_by_name(self.experiment_name)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else self.client.create_experiment(self.experiment_name)
            )
            run = self.client.create_run(experiment_id, run_name=self.run_name)
            self.run_id = str(run.info.run_id)
            params = [
                self._Param(_name(k), str(v)[: self.MAX_PARAM_LENGTH])
                for k, v in _flatten(self.config).items()
            ]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        return self.run_id

    def _log(self, values: Mapping[str, float], step: int) -> None:
        run_id = self._run()
        now = int(time.time() * 1000)
        metrics = [self._Metric(_name(k), float(v), now, step) for k, v in values.items()]
        if metrics:
            self.client.log_batch(run_id, metrics=metrics)

    def on_round(self, round: int, metrics: dict[str, Any]) -> None:
        self._step = step_of(metrics, round)
        self._log({k: v for k, v in metrics.items() if is_number(v)}, self._step)

    def on_timing(self, rank: int, window: dict[str, Any]) -> None:
        step = window_step(window, self._last_step.get(rank, 0))
        self._last_step[rank] = step
        self._log(_timing_values(rank, window), step)

    def on_straggler(self, event: Any) -> None:
        rank = int(event.rank)
        self._log(
            {f"stragglers/rank_{rank}": 1.0 if event.flagged else 0.0},
            self._last_step.get(rank, self._step),
        )
        self.client.set_tag(self._run(), f"straggler.rank_{rank}", str(event.message)[:5000])

    def on_failure(self, failure: Any) -> None:
        self.client.set_tag(self._run(), "ringtrain.failure", failure.describe()[:5000])

    def on_end(self, result: Any) -> None:
        status = "FAILED" if getattr(result, "error", None) is not None else "FINISHED"
        self.client.set_terminated(self._run(), status=status)


def _name(key: str) -> str:
    return re.sub(r"[^\w\-. /]", "_", str(key))


class WandbCallback:
    """Logs a run to Weights & Biases (the ``wandb`` package).

    The W&B run is created on the first event with ``wandb.init(project=project, config=config,
    **init_kwargs)``; set ``WANDB_MODE=offline`` to write it locally (``wandb sync`` uploads it
    later). Rank 0's round metrics are plotted against ``trainer/step`` (the ``"step"`` metric,
    else the round; ``trainer/round`` is logged too), each rank's timing against
    ``timing/rank_<r>/step``; W&B's own ``_step`` just counts log calls.

    Args:
        project: the W&B project (default: W&B's, ``WANDB_PROJECT``).
        config: the run's config (e.g. your ``train_loop_config``).
        **init_kwargs: passed on to ``wandb.init`` (``entity``, ``name``, ``tags``, ``dir``...).

    Raises:
        ImportError: when wandb is not installed (``pip install wandb``).
    """

    def __init__(
        self,
        project: str | None = None,
        config: Mapping[str, Any] | None = None,
        **init_kwargs: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError("WandbCallback needs Weights & Biases: pip install wandb") from exc
        self._wandb: Any = wandb
        self.project = project
        self.config = dict(config or {})
        self.init_kwargs = init_kwargs
        self.run: Any = None
        self._defined: set[str] = set()
        self._last_step: dict[int, int] = {}

    def _run(self) -> Any:
        if self.run is None:
            self.run = self._wandb.init(
                project=self.project, config=self.config, **self.init_kwargs
            )
            self._define("trainer/step")
            self._define("trainer/round", step_metric="trainer/step")
            self._define("stragglers/*", step_metric="trainer/step")
        return self.run

    def _define(self, name: str, step_metric: str | None = None) -> None:
        if name not in self._defined:
            self._defined.add(name)
            if step_metric is None:
                self.run.define_metric(name)
            else:
                self.run.define_metric(name, step_metric=step_metric)

    def on_round(self, round: int, metrics: dict[str, Any]) -> None:
        run = self._run()
        values = {k: v for k, v in metrics.items() if is_number(v)}
        for name in values:
            self._define(name, step_metric="trainer/step")
        run.log({**values, "trainer/step": step_of(metrics, round), "trainer/round": round})

    def on_timing(self, rank: int, window: dict[str, Any]) -> None:
        run = self._run()
        prefix = f"timing/rank_{rank}"
        self._define(f"{prefix}/step")
        self._define(f"{prefix}/*", step_metric=f"{prefix}/step")
        step = window_step(window, self._last_step.get(rank, 0))
        self._last_step[rank] = step
        run.log({**_timing_values(rank, window), f"{prefix}/step": step})

    def on_straggler(self, event: Any) -> None:
        run = self._run()
        rank = int(event.rank)
        run.log({f"stragglers/rank_{rank}": 1 if event.flagged else 0})
        run.summary[f"stragglers/rank_{rank}/message"] = str(event.message)

    def on_failure(self, failure: Any) -> None:
        self._run().summary["ringtrain/failure"] = failure.describe()

    def on_end(self, result: Any) -> None:
        failed = getattr(result, "error", None) is not None
        self._run().finish(exit_code=1 if failed else 0)
