"""Reading sweep directories for ``ringtrain ls`` and the dashboard's runs table.

``ringtrain tune`` (and ``Tuner.fit``) writes a sweep to ``{storage_path}/{name}/``: ``tuner.json``
(``"kind": "sweep"``, the metric, mode and configs), the Optuna study (``study.db`` by default) and
one run directory per trial, ``trial_NNNN/`` (docs/tune.md). A sweep is listed as one row: its
trial counts come from the study when it is the default SQLite file on a local disk (read only),
else from the trials' ``result.json``: ``FINISHED`` counts as completed, ``STOPPED`` (the status a
pruned trial's run ends with) as pruned, ``ERRORED``/``ABORTED`` as failed.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from dataclasses import dataclass
from typing import Any

from fsspec.core import url_to_fs

from ringtrain.monitor.records import RunSummary
from ringtrain.monitor.runs import list_runs
from ringtrain.monitor.storage import (
    as_float,
    as_int,
    basename,
    invalidate,
    is_local,
    join_fs,
    join_user,
    ls,
    read_json,
)

__all__ = ["SweepSummary", "list_sweeps"]

TUNER_FILE = "tuner.json"
STUDY_FILE = "study.db"

_TRIAL_STATES = {"FINISHED": "completed", "STOPPED": "pruned", "ERRORED": "failed"}
_STUDY_STATES = {"COMPLETE": "completed", "PRUNED": "pruned", "FAIL": "failed"}


@dataclass
class SweepSummary:
    """One sweep: a row of ``ringtrain ls``.

    Attributes:
        name: The sweep's directory name.
        path: The sweep directory (local path or fsspec URL, as listed).
        status: ``RUNNING`` while trials run, ``FINISHED`` when every trial ended, ``ABORTED``
            when it stopped before (``ringtrain tune --resume`` continues it).
        start_time: When the sweep was created, Unix time in seconds, or None.
        duration_s: From creation to the last trial's end (until now while running), or None.
        metric: The metric the sweep optimises; ``mode``: ``"max"`` or ``"min"``.
        total: The number of trials the sweep will run, or None if unknown.
        completed: Trials that completed; ``pruned``, ``failed``, ``running`` likewise.
        world_size: Workers per trial, or None.
        best: The best final value of ``metric`` among completed trials, or None.
        best_trial: The trial number of ``best``, or None.
        trials: The trials' run summaries, by name.
    """

    name: str
    path: str
    status: str
    start_time: float | None
    duration_s: float | None
    metric: str
    mode: str
    total: int | None
    completed: int = 0
    pruned: int = 0
    failed: int = 0
    running: int = 0
    world_size: int | None = None
    best: float | None = None
    best_trial: int | None = None
    trials: tuple[RunSummary, ...] = ()

    @property
    def done(self) -> int:
        """Trials that ended: completed + pruned + failed."""
        return self.completed + self.pruned + self.failed

    def counts_text(self, short: bool = False) -> str:
        """``"5/6 trials: 3 completed, 1 pruned, 1 failed, 1 running"`` (zero counts left out,
        except completed); ``short``: ``"3 ok, 1 pruned, 1 failed, 1 running"``."""
        total = "?" if self.total is None else str(self.total)
        parts = [f"{self.completed} {'ok' if short else 'completed'}"]
        parts += [f"{n} {k}" for k, n in (("pruned", self.pruned), ("failed", self.failed)) if n]
        if self.running:
            parts.append(f"{self.running} running")
        return ("" if short else f"{self.done}/{total} trials: ") + ", ".join(parts)


def _study_counts(path: str) -> tuple[dict[str, int], int | None, dict[int, float]] | None:
    """Trial states, the planned total and the completed values, from a local ``study.db``
    (read only); None when it cannot be read."""
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
    except sqlite3.Error:
        return None
    try:
        counts: dict[str, int] = {}
        for state, n in con.execute("SELECT state, COUNT(*) FROM trials GROUP BY state"):
            counts[str(state)] = int(n)
        total = None
        row = con.execute(
            "SELECT value_json FROM study_user_attributes WHERE key = 'ringtrain_total_trials'"
        ).fetchone()
        if row is not None:
            with contextlib.suppress(ValueError, TypeError):
                total = as_int(json.loads(row[0]))
        values: dict[int, float] = {}
        query = (
            "SELECT t.number, v.value FROM trials t JOIN trial_values v "
            "ON v.trial_id = t.trial_id WHERE t.state = 'COMPLETE' AND v.objective = 0"
        )
        for number, value in con.execute(query):
            if isinstance(value, (int, float)):
                values[int(number)] = float(value)
        return counts, total, values
    except sqlite3.Error:
        return None
    finally:
        con.close()


def _trial_counts(trials: list[RunSummary], metric: str) -> tuple[dict[str, int], dict[int, float]]:
    """Trials per outcome (from their ``result.json``) and the final ``metric`` of each
    completed one, by trial number."""
    counts = {"completed": 0, "pruned": 0, "failed": 0, "running": 0}
    values: dict[int, float] = {}
    for t in trials:
        if t.status == "RUNNING":
            counts["running"] += 1
        elif t.status in ("ABORTED", "UNKNOWN"):
            counts["failed"] += 1
        elif t.status in _TRIAL_STATES:
            counts[_TRIAL_STATES[t.status]] += 1
        value = as_float(t.metrics.get(metric))
        number = as_int(t.name.removeprefix("trial_"))
        if t.status == "FINISHED" and value is not None and number is not None:
            values[number] = value
    return counts, values


def _read_sweep(fs: Any, fs_dir: str, path: str, tuner: dict[str, Any], now: float) -> SweepSummary:
    metric = str(tuner.get("metric") or "")
    mode = "min" if tuner.get("mode") == "min" else "max"
    scaling = tuner.get("scaling_config") if isinstance(tuner.get("scaling_config"), dict) else {}
    workers = scaling.get("num_workers") if isinstance(scaling, dict) else None
    if isinstance(workers, list) and workers:
        workers = workers[-1]
    try:
        trials = [r for r in list_runs(path) if r.name.startswith("trial_")]
    except FileNotFoundError:
        trials = []
    counts, values = _trial_counts(trials, metric)
    total = None
    study = join_fs(fs_dir, STUDY_FILE)
    if is_local(fs) and fs.exists(study):
        read = _study_counts(study)
        if read is not None:
            states, total, study_values = read
            counts["completed"] = states.get("COMPLETE", 0)
            counts["pruned"] = states.get("PRUNED", 0)
            counts["failed"] = states.get("FAIL", 0)
            counts["running"] = states.get("RUNNING", 0)
            values = study_values or values
    if total is None:
        tune_config = tuner.get("tune_config")
        if isinstance(tune_config, dict):
            total = as_int(tune_config.get("num_samples"))
    done = counts["completed"] + counts["pruned"] + counts["failed"]
    alive = any(t.status == "RUNNING" for t in trials)
    if alive:
        status = "RUNNING"
    elif total is not None and done >= total:
        status = "FINISHED"
    else:
        status = "ABORTED"
    start = as_float(tuner.get("created"))
    ends = [
        t.start_time + t.duration_s
        for t in trials
        if t.start_time is not None and t.duration_s is not None
    ]
    duration = None
    if start is not None:
        duration = now - start if alive else (max(ends) - start if ends else None)
    best = best_trial = None
    if values:
        pick = min if mode == "min" else max
        best_trial = pick(values, key=lambda n: values[n])
        best = values[best_trial]
    return SweepSummary(
        name=basename(fs_dir),
        path=path,
        status=status,
        start_time=start,
        duration_s=None if duration is None else max(0.0, duration),
        metric=metric,
        mode=mode,
        total=total,
        world_size=as_int(workers),
        best=best,
        best_trial=best_trial,
        trials=tuple(trials),
        **counts,
    )


def list_sweeps(storage_path: str, now: float | None = None) -> list[SweepSummary]:
    """Lists the sweeps under a storage path: its subdirectories with a ``tuner.json``.

    Args:
        storage_path: A local directory or fsspec URL (``./runs``, the default of ``ringtrain
            tune``).
        now: The current Unix time (a running sweep's duration); ``time.time()`` if None.

    Returns:
        One summary per sweep, oldest first; empty when there are none or the path is missing.
    """
    import time

    now = time.time() if now is None else now
    fs, fs_root = url_to_fs(storage_path)
    invalidate(fs)
    sweeps: list[SweepSummary] = []
    for entry in sorted(ls(fs, fs_root), key=lambda e: str(e["name"])):
        if entry.get("type") != "directory":
            continue
        name = basename(str(entry["name"]))
        fs_dir = join_fs(fs_root, name)
        tuner = read_json(fs, join_fs(fs_dir, TUNER_FILE))
        if tuner is None or tuner.get("kind", "sweep") != "sweep":
            continue
        sweeps.append(_read_sweep(fs, fs_dir, join_user(storage_path, name), tuner, now))
    sweeps.sort(key=lambda s: (s.start_time is not None, s.start_time or 0.0, s.name))
    return sweeps
