"""What a sweep returns: :class:`ResultGrid`, one :class:`~ringtrain.Result` per trial."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from typing import Any

from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.result import Result
from ringtrain.rundir import RunDirectory
from ringtrain.rundir.schema import RESULT_FILE, ReportEvent
from ringtrain.tune.progress import TrialRow

_MODES = ("max", "min")


class ResultGrid(Sequence[Result]):
    """The trials of a sweep: a sequence of :class:`~ringtrain.Result` (one per trial, in trial
    order; ``Result.config`` holds its hyperparameters).

    Attributes:
        path: the sweep directory, ``{storage_path}/{name}``.
        metric, mode: what the sweep optimised (``None`` when it had no metric).
        statuses: trial status per result: ``"COMPLETE"``, ``"PRUNED"``, ``"FAILED"``.
    """

    def __init__(
        self,
        results: list[Result],
        rows: list[TrialRow],
        *,
        path: str,
        metric: str | None,
        mode: str | None,
        columns: Sequence[str],
        study: Any = None,
    ) -> None:
        self._results = results
        self._rows = rows
        self.path = path
        self.metric = metric
        self.mode = mode
        self._columns = list(columns)
        self.study = study
        self.statuses = [r.status for r in rows]

    def __len__(self) -> int:
        return len(self._results)

    def __getitem__(self, i: int) -> Result:  # type: ignore[override]
        return self._results[i]

    def __iter__(self) -> Iterator[Result]:
        return iter(self._results)

    @property
    def errors(self) -> list[BaseException]:
        """The errors of the trials that failed."""
        return [r.error for r in self._results if r.error is not None]

    @property
    def num_errors(self) -> int:
        return sum(1 for s in self.statuses if s == "FAILED")

    @property
    def num_pruned(self) -> int:
        return sum(1 for s in self.statuses if s == "PRUNED")

    def get_best_result(
        self, metric: str | None = None, mode: str | None = None, scope: str = "last"
    ) -> Result:
        """The trial with the best value of ``metric``.

        Args:
            metric: default: ``TuneConfig.metric``.
            mode: ``"max"`` or ``"min"``; default: ``TuneConfig.mode``.
            scope: ``"last"`` (each trial's last reported value, as the study records it) or
                ``"all"`` (the best value a trial reported at any round).

        Raises:
            ValueError: on a bad ``mode`` / ``scope``, or no ``metric`` / ``mode`` given to a
                sweep that had none.
            RuntimeError: if no trial reported ``metric``.
        """
        metric = metric or self.metric
        mode = mode or self.mode
        if metric is None or mode is None:
            raise ValueError(
                f"the sweep {self.path} had no TuneConfig(metric=..., mode=...): say which trial "
                "is best with get_best_result(metric=..., mode=...), e.g. metric='loss', "
                "mode='min'"
            )
        if mode not in _MODES:
            raise ValueError(f"mode must be 'max' or 'min', got {mode!r}")
        if scope not in ("last", "all"):
            raise ValueError(f"scope must be 'last' or 'all', got {scope!r}")
        candidates: list[tuple[float, int]] = []
        for i, (result, row) in enumerate(zip(self._results, self._rows, strict=True)):
            if row.status == "FAILED":
                continue
            raw = [m.get(metric) for m in result.metrics_history] or [result.metrics.get(metric)]
            values = [float(v) for v in raw if _finite(v)]  # type: ignore[arg-type]
            if not values:
                continue
            if scope == "last":
                candidates.append((values[-1], i))
            else:
                candidates.append((max(values) if mode == "max" else min(values), i))
        if not candidates:
            raise RuntimeError(f"no trial of {self.path} reported a finite {metric!r}")
        sign = -1.0 if mode == "max" else 1.0
        _, best = min(candidates, key=lambda c: (sign * c[0], c[1]))
        return self._results[best]

    def get_dataframe(self) -> Any:
        """One row per trial: ``trial_id``, ``status``, ``config/<param>`` for each searched
        hyperparameter, ``<metric>`` (last value), ``<metric>_best``, ``iterations`` (report
        rounds), ``duration_s``, ``worker_seconds`` (duration x workers), ``path``, ``error``.

        Returns:
            a ``pandas.DataFrame`` when pandas is installed, else a list of dicts.
        """
        records = []
        for result, row in zip(self._results, self._rows, strict=True):
            rec: dict[str, Any] = {"trial_id": row.number, "status": row.status}
            for c in self._columns:
                rec[f"config/{c}"] = row.params.get(c)
            if self.metric is not None:
                rec[self.metric] = row.last
                rec[f"{self.metric}_best"] = row.best
            rec["iterations"] = row.iterations
            rec["duration_s"] = row.duration_s
            rec["worker_seconds"] = row.extra.get("worker_seconds")
            rec["path"] = result.path
            rec["error"] = row.error
            records.append(rec)
        try:
            import pandas as pd
        except ImportError:
            return records
        return pd.DataFrame.from_records(records)

    def __repr__(self) -> str:
        return f"ResultGrid({len(self)} trials, {self.path})"


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _result_from_dir(sweep: RunDirectory, dir_name: str, config: dict[str, Any]) -> Result:
    """A trial's Result from its run directory (``result.json`` and ``events.jsonl``), so that
    trials of an earlier driver and of this one look the same."""
    from ringtrain.result import TrainingFailedError, WorkerFailure

    run = RunDirectory(sweep.uri, dir_name)
    raw = run.read_bytes(RESULT_FILE)
    info = json.loads(raw) if raw else {}
    history = {
        ev.round: ev.metrics for ev in run.events() if isinstance(ev, ReportEvent) and ev.rank == 0
    }
    failures = [WorkerFailure(**f) for f in info.get("failures") or []]
    error = None
    if info.get("status") == "ERRORED" and failures:
        error = TrainingFailedError(failures)
    ckpt = info.get("checkpoint")
    return Result(
        metrics=dict(info.get("metrics") or {}),
        metrics_per_rank={int(r): m for r, m in (info.get("metrics_per_rank") or {}).items()},
        checkpoint=Checkpoint(ckpt) if ckpt else None,
        best_checkpoints=[
            (Checkpoint(b["path"]), b.get("metrics") or {})
            for b in info.get("best_checkpoints") or []
        ],
        path=run.uri,
        error=error,
        failures=failures,
        metrics_history=[history[r] for r in sorted(history)],
        config=config,
        status=str(info.get("status") or "UNKNOWN"),
        preemptions=int(info.get("preemptions") or 0),
        outer_steps=outer if isinstance(outer := info.get("outer_steps"), int) else None,
    )
