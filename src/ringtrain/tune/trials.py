"""One trial of a sweep, seen from the driver: its bookkeeping (:class:`TrialRun`), how its end
is judged (:func:`judge`), and its table row rebuilt from the study (:func:`row_from_study`).

Pure bookkeeping: the :class:`~ringtrain.tune.Tuner` starts trials, talks to Optuna and updates
the display; nothing here touches the study or the display.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ringtrain.result import Result
from ringtrain.rundir import RunDirectory
from ringtrain.tune.progress import TrialRow
from ringtrain.tune.result import ResultGrid, _finite, _result_from_dir
from ringtrain.tune.search import SearchSpace


def trial_dir_name(number: int) -> str:
    """``trial_NNNN`` for Optuna trial number ``number`` (0-based)."""
    return f"trial_{number:04d}"


@dataclass
class TrialRun:
    """One trial run by this driver (its controller runs in :attr:`thread`)."""

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


@dataclass(frozen=True)
class Outcome:
    """How a trial ended: ``status`` is ``"COMPLETE"``, ``"PRUNED"`` or ``"FAILED"`` (also the
    Optuna ``TrialState`` name, ``FAIL`` for ``FAILED``); ``message`` the display's line;
    ``error`` why it failed; ``value`` the final metric of a complete trial."""

    status: str
    message: str
    error: str | None = None
    value: float | None = None


def judge(trial: TrialRun, metric: str | None, last: Any) -> Outcome:
    """The outcome of a trial whose controller returned.

    Args:
        trial: the trial (its ``exception``, ``result`` and ``pruned_at`` are read).
        metric: ``TuneConfig.metric``: a complete trial's last report must have it, finite;
            ``None`` (a sweep without a metric): a trial that finished is complete.
        last: the metric's last intermediate value (for the PRUNED line).
    """
    result = trial.result
    if trial.exception is not None or result is None:
        exc = trial.exception
        why = f"{type(exc).__name__}: {exc}" if exc is not None else "no result"
        return Outcome("FAILED", f"FAILED: {why}", error=why)
    if trial.pruned_at is not None:
        return Outcome("PRUNED", f"PRUNED at iteration {trial.pruned_at} ({metric}={fmt(last)})")
    if result.error is not None:
        why = str(result.error).splitlines()[0]
        return Outcome("FAILED", f"FAILED after {len(result.failures)} failures: {why}", error=why)
    if metric is None:
        return Outcome("COMPLETE", "COMPLETE")
    value = result.metrics.get(metric)
    if not _finite(value):
        why = (
            f"the train function's last report() has no finite {metric!r} "
            f"(TuneConfig.metric); it reported {sorted(result.metrics)}"
        )
        return Outcome("FAILED", f"FAILED: {why}", error=why)
    final = float(value)  # type: ignore[arg-type]  # _finite: a real number
    return Outcome("COMPLETE", f"COMPLETE: {metric}={fmt(final)}", value=final)


def row_from_study(ft: Any, space: SearchSpace, mode: str | None) -> TrialRow:
    """The table row of a trial as the study holds it (a previous driver's trials).

    Args:
        ft: an Optuna ``FrozenTrial``.
        space: the sweep's search space (to rebuild the trial's config).
        mode: ``"max"`` or ``"min"`` (which intermediate value is the best); ``None``: a sweep
            without a metric (no value is shown).
    """
    from optuna.trial import TrialState

    status = {
        TrialState.COMPLETE: "COMPLETE",
        TrialState.PRUNED: "PRUNED",
        TrialState.FAIL: "FAILED",
        TrialState.RUNNING: "PENDING",
    }.get(ft.state, str(ft.state))
    config = space.config(ft.params) if ft.params else {}
    values = [v for _, v in sorted(ft.intermediate_values.items()) if _finite(v)]
    last = ft.value if ft.value is not None else (values[-1] if values else None)
    if mode is None:  # the 0 Optuna was told is no metric's value
        values, last = [], None
    pick = max if mode == "max" else min
    row = TrialRow(
        ft.number,
        {c: dig(config, c) for c in space.param_columns()},
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


def result_grid(
    study: Any,
    sweep: RunDirectory,
    rows: Mapping[int, TrialRow],
    space: SearchSpace,
    metric: str | None,
    mode: str | None,
) -> ResultGrid:
    """The :class:`ResultGrid` of the trials of ``rows`` (in trial order), each trial's
    :class:`~ringtrain.Result` read from its directory in ``sweep``."""
    results: list[Result] = []
    ordered: list[TrialRow] = []
    for ft in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if ft.number not in rows:
            continue
        row = rows[ft.number]
        config = space.config(ft.params) if ft.params else {}
        results.append(_result_from_dir(sweep, trial_dir_name(ft.number), config))
        ordered.append(row)
    return ResultGrid(
        results,
        ordered,
        path=sweep.uri,
        metric=metric,
        mode=mode,
        columns=space.param_columns(),
        study=study,
    )


def dig(config: Mapping[str, Any], flat_key: str) -> Any:
    """``config``'s value at ``flat_key`` (``"model/width"``: ``config["model"]["width"]``), or
    None."""
    cur: Any = config
    for part in flat_key.split("/"):
        if not isinstance(cur, Mapping) or part not in cur:
            return None
        cur = cur[part]
    return cur


def fmt(v: Any) -> str:
    """A metric value for the display (4 significant digits)."""
    return f"{v:.4g}" if isinstance(v, int | float) else str(v)


def fmt_resources(r: Mapping[str, float]) -> str:
    """``{"CPU": 4, "GPU": 1}`` as ``"4 CPU, 1 GPU"``."""
    return ", ".join(f"{v:g} {k}" for k, v in sorted(r.items()))


def tell_study(
    lock: threading.RLock,
    study: Any,
    otrial: Any,
    state: Any,
    value: float | None = None,
    error: str | None = None,
) -> None:
    """Tell the Optuna ``study`` that ``otrial`` ended in ``state`` (with its final ``value``,
    or the ``error`` it failed with, kept as a user attribute), holding ``lock``."""
    with lock:
        if error is not None:
            otrial.set_user_attr("error", error)
        if value is not None:
            study.tell(otrial, value)
        else:
            study.tell(otrial, state=state)
