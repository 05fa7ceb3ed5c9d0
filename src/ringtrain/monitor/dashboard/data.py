"""What the dashboard serves, read from run directories as they grow.

A :class:`RunStore` lists the runs under a storage path (or serves the one run it points at) and
keeps one :class:`~ringtrain.monitor.dashboard.runlog.RunLog` per run, which reads each run's
``events.jsonl`` incrementally (:class:`~ringtrain.rundir.reader.EventReader`). Everything here
only reads.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import asdict
from typing import Any

from fsspec.core import url_to_fs

from ringtrain.monitor.dashboard.runlog import DEFAULT_LIMIT, Cursors, RunLog, clean_json
from ringtrain.monitor.storage import basename, file_names, invalidate, join_fs, join_user, ls
from ringtrain.monitor.sweeps import list_sweeps
from ringtrain.rundir.reader import EventTail
from ringtrain.rundir.schema import RUN_FILES, TERMINAL_STATUSES

__all__ = ["Cursors", "EventTail", "RunLog", "RunStore", "clean_json", "flatten_config"]

_NAME_RE = re.compile(r"^[^/\\]+$")


def flatten_config(config: Any, prefix: str = "") -> dict[str, Any]:
    """Flattens ``train_loop_config`` into table columns: nested dicts become dotted keys, lists
    and other values that are not numbers, strings or booleans become their JSON text.

    Args:
        config: The parsed ``train_loop_config`` (usually a dict; None gives no columns).
        prefix: Prepended to every key (used for nesting).

    Returns:
        Column name -> scalar value.
    """
    if not isinstance(config, dict):
        return {}
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_config(value, prefix=name + "."))
        elif value is None or isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value, default=repr)
    return clean_json(flat)


class RunStore:
    """The runs under a storage path, or the one run a run directory holds.

    Args:
        path: A storage path (a directory of run directories, e.g. ``./runs`` or a sweep's
            directory of trials) or one run directory; a local path or an fsspec URL. It may not
            exist yet (``ringtrain run --dashboard`` before the first run): the list is then
            empty.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fs, self._fs_root = url_to_fs(path)
        self._logs: dict[str, RunLog] = {}
        self._lock = threading.Lock()

    @property
    def single(self) -> str | None:
        """The run's name when ``path`` is itself a run directory, else None."""
        names = file_names(ls(self._fs, self._fs_root))
        return basename(self._fs_root) if names & RUN_FILES else None

    def _log(self, name: str, run_dir: str) -> RunLog:
        with self._lock:
            log = self._logs.get(name)
            if log is None or log.run_dir != run_dir:
                log = self._logs[name] = RunLog(name, run_dir)
            return log

    def _run_dirs(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        """(name, run directory, its listing) of every run, by name."""
        invalidate(self._fs)
        top = ls(self._fs, self._fs_root)
        if file_names(top) & RUN_FILES:
            return [(basename(self._fs_root), self.path, top)]
        found = []
        for entry in sorted(top, key=lambda e: str(e["name"])):
            if entry.get("type") != "directory":
                continue
            name = basename(str(entry["name"]))
            listing = ls(self._fs, join_fs(self._fs_root, name))
            files = file_names(listing)
            if files & RUN_FILES:
                found.append((name, join_user(self.path, name), listing))
        return found

    def list(self) -> dict[str, Any]:
        """The runs table: every run's summary and hyperparameters.

        Returns:
            ``{"path", "exists", "single", "runs": [...], "sweeps": [...], "hparams": [...],
            "metrics": [...]}``; ``sweeps``: the sweeps under the path (``name``, ``path``,
            ``status``, ``counts``: e.g. ``"6/6 trials: 4 completed, 1 pruned, 1 failed"``);
            ``hparams`` and ``metrics`` are the column names found in any run, in first-seen
            order. Runs are sorted by start time, newest last.
        """
        exists = self._fs.exists(self._fs_root)
        rows = []
        hparams: dict[str, None] = {}
        metric_keys: dict[str, None] = {}
        now = time.time()
        single = None
        for name, run_dir, listing in self._run_dirs() if exists else []:
            log = self._log(name, run_dir)
            with log.lock:
                result = log._result.read()
                status = (result or {}).get("status")
                complete = status in TERMINAL_STATUSES and bool((result or {}).get("metrics"))
                log.refresh(events=log.events_read or not complete, entries=listing)
                summary = log.summary(now)
                config = flatten_config((log.config or {}).get("train_loop_config"))
                stragglers = sorted(log.stragglers)
            if run_dir == self.path:
                single = name
            for key in config:
                hparams.setdefault(key, None)
            for key in summary.metrics:
                metric_keys.setdefault(key, None)
            rows.append({**clean_json(asdict(summary)), "config": config, "stragglers": stragglers})
        rows.sort(key=lambda r: (r["start_time"] is not None, r["start_time"] or 0.0, r["name"]))
        sweeps = [
            {"name": s.name, "path": s.path, "status": s.status, "counts": s.counts_text()}
            for s in (list_sweeps(self.path, now) if exists and single is None else [])
        ]
        return {
            "path": self.path,
            "exists": bool(exists),
            "single": single,
            "runs": rows,
            "sweeps": sweeps,
            "hparams": list(hparams),
            "metrics": list(metric_keys),
        }

    def run(self, name: str, cursors: Cursors, limit: int = DEFAULT_LIMIT) -> dict[str, Any] | None:
        """One run, for the run page.

        Args:
            name: The run's directory name.
            cursors: What the page already has (see :class:`Cursors`).
            limit: At most this many new items per list.

        Returns:
            :meth:`RunLog.snapshot`'s dict, or None when there is no such run.
        """
        if not _NAME_RE.match(name) or name in (".", ".."):
            return None
        invalidate(self._fs)  # listings of a run still being written must be fresh
        single = self.single
        if single is not None:
            if name != single:
                return None
            run_dir = self.path
        else:
            listing = ls(self._fs, join_fs(self._fs_root, name))
            files = file_names(listing)
            if not files & RUN_FILES:
                return None
            run_dir = join_user(self.path, name)
        log = self._log(name, run_dir)
        with log.lock:
            log.refresh(events=True)
            return log.snapshot(cursors, limit=limit)
