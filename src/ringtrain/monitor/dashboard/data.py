"""What the dashboard serves, read from run directories as they grow.

A :class:`RunLog` follows one run directory: ``events.jsonl`` is read from the byte offset where
the previous read stopped (a poll of a big run reads only the lines written since), and
``config.json`` / ``result.json`` / checkpoint manifests are read again only when they changed. A
:class:`RunStore` lists the runs under a storage path (or serves the one run it points at) and
keeps one ``RunLog`` per run.

Statuses, durations and last metrics come from the same code as ``ringtrain ls``
(:mod:`ringtrain.monitor.runs`), so both always agree. Everything here only reads.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from fsspec.core import url_to_fs

from ringtrain.monitor import runs
from ringtrain.monitor.runs import CheckpointInfo, RunSummary
from ringtrain.monitor.sweeps import list_sweeps

__all__ = ["Cursors", "EventTail", "RunLog", "RunStore"]

#: Event types drawn on the run's timeline (reports and timing windows have their own charts).
TIMELINE_TYPES = frozenset(
    {
        "run_start",
        "resume",
        "failure",
        "decision",
        "hang",
        "checkpoint",
        "checkpoint_failed",
        "checkpoint_invalid",
        "checkpoint_deleted",
        "straggler",
        "straggler_cleared",
        "resize",
        "resize_fallback",
        "run_end",
    }
)

#: Most items of one list (metrics, timing, timeline) sent in one response; the page asks again
#: at once for the rest (a long run opened for the first time).
DEFAULT_LIMIT = 20_000

_CHUNK_BYTES = 8 << 20
_RUN_FILES = frozenset({runs.CONFIG_FILE, runs.RESULT_FILE, runs.EVENTS_FILE})
_NAME_RE = re.compile(r"^[^/\\]+$")


def clean_json(value: Any) -> Any:
    """Makes a value safe for strict JSON (what browsers parse).

    Args:
        value: Parsed JSON (dicts, lists, numbers, strings, None).

    Returns:
        The same structure with NaN and infinities replaced by the strings ``"NaN"``,
        ``"Infinity"`` and ``"-Infinity"`` (how Python's ``json`` writes them).
    """
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {str(k): clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v) for v in value]
    return value


def _signature(info: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What identifies one version of a file; None when the filesystem gives no timestamp."""
    stamp = info.get("mtime", info.get("LastModified", info.get("created")))
    if stamp is None:
        return None
    return (info.get("size"), stamp, info.get("ino"))


class _JsonFile:
    """A JSON file re-read only when its size or modification time changed."""

    def __init__(self, fs: Any, path: str) -> None:
        self._fs = fs
        self._path = path
        self._sig: tuple[Any, ...] | None = None
        self.value: dict[str, Any] | None = None

    def read(self) -> dict[str, Any] | None:
        try:
            info = self._fs.info(self._path)
        except (OSError, ValueError):
            self._sig, self.value = None, None
            return None
        sig = _signature(info)
        if sig is not None and sig == self._sig:
            return self.value
        value = runs._read_json(self._fs, self._path)
        if value is None:
            # Caught half-written (storage without atomic rename): keep the last good version.
            return self.value
        self._sig, self.value = sig, clean_json(value)
        return self.value


class EventTail:
    """Reads ``events.jsonl`` incrementally, from the byte offset the last read stopped at.

    A line is parsed once it is complete; a last line still being written waits for the next
    read. A file that shrank or was replaced (another inode) is read again from the start.

    Args:
        fs: The fsspec filesystem.
        path: The file's path on ``fs``.
    """

    def __init__(self, fs: Any, path: str) -> None:
        self._fs = fs
        self._path = path
        self._identity: Any = None
        self._partial = b""
        self.offset = 0
        """Bytes of the file consumed so far."""
        self.skipped = 0
        """Lines that were not a JSON object with a ``type``."""

    def check(self) -> bool:
        """Looks at the file; True when it was replaced or truncated and must be read again from
        the start (the offset is then reset to 0)."""
        try:
            info = self._fs.info(self._path)
        except (OSError, ValueError):
            return False
        size = int(info.get("size") or 0)
        identity = info.get("ino")
        reset = size < self.offset or (
            self._identity is not None and identity is not None and identity != self._identity
        )
        self._identity = identity
        if reset:
            self.offset, self._partial, self.skipped = 0, b"", 0
        return reset

    def read_new(self) -> Iterator[dict[str, Any]]:
        """Yields the events appended since the last read, in file order."""
        try:
            f = self._fs.open(self._path, "rb")
        except (OSError, ValueError):
            return
        with f:
            f.seek(self.offset)
            while True:
                chunk = f.read(_CHUNK_BYTES)
                if not chunk:
                    break
                self.offset += len(chunk)
                lines = (self._partial + chunk).split(b"\n")
                self._partial = lines.pop()
                for raw in lines:
                    event = self._parse(raw)
                    if event is not None:
                        yield event
        if self._partial.strip():
            # A last line without its newline: complete if it parses (a strict prefix of a JSON
            # object never does), else still being written.
            try:
                obj = json.loads(self._partial.decode("utf-8"))
            except (ValueError, UnicodeDecodeError):
                return
            self._partial = b""
            if isinstance(obj, dict) and isinstance(obj.get("type"), str):
                yield obj
            else:
                self.skipped += 1

    def _parse(self, raw: bytes) -> dict[str, Any] | None:
        if not raw.strip():
            return None
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            self.skipped += 1
            return None
        if isinstance(obj, dict) and isinstance(obj.get("type"), str):
            return obj
        self.skipped += 1
        return None


@dataclass(frozen=True)
class Cursors:
    """How much of a run's lists the page already has.

    Attributes:
        generation: The :attr:`RunLog.generation` those counts belong to; another value (or
            None) means "send everything".
        metrics: Items of the ``metrics`` list already received.
        timing: Items of the ``timing`` list already received.
        timeline: Items of the ``timeline`` list already received.
    """

    generation: str | None = None
    metrics: int = 0
    timing: int = 0
    timeline: int = 0


def _window(event: Mapping[str, Any]) -> dict[str, Any]:
    """A timing event's window fields (nested under ``window`` or at the top level)."""
    nested = event.get("window")
    source = nested if isinstance(nested, dict) else event
    return {
        k: v
        for k, v in source.items()
        if k not in ("type", "time", "rank", "attempt", "window")
        and (v is None or isinstance(v, (int, float, str)))
    }


class RunLog:
    """Everything the dashboard shows about one run, kept up to date by :meth:`refresh`.

    The lists ``metrics``, ``timing`` and ``timeline`` only grow (until the events file is
    replaced, which starts a new :attr:`generation`), so a page can ask for what is new by count.

    Args:
        name: The run's name (its directory name).
        run_dir: The run directory, a local path or fsspec URL.
    """

    def __init__(self, name: str, run_dir: str) -> None:
        self.name = name
        self.run_dir = run_dir
        self._fs, self._fs_dir = url_to_fs(run_dir)
        self._local = runs._is_local(self._fs)
        self._config = _JsonFile(self._fs, runs._join_fs(self._fs_dir, runs.CONFIG_FILE))
        self._result = _JsonFile(self._fs, runs._join_fs(self._fs_dir, runs.RESULT_FILE))
        self._tail = EventTail(self._fs, runs._join_fs(self._fs_dir, runs.EVENTS_FILE))
        self._manifests: dict[str, CheckpointInfo] = {}
        self._id = uuid.uuid4().hex[:8]
        self._resets = 0
        self.lock = threading.Lock()
        """Held while refreshing or reading; requests are served from several threads."""
        self.checkpoints: list[CheckpointInfo] = []
        self._clear()

    def _clear(self) -> None:
        self.events_read = False
        self.digest = runs._EventDigest()
        self.attempt = 0
        self.metrics: list[dict[str, Any]] = []
        """Rank 0's reports in file order: ``{"round", "time", "attempt", "metrics"}``. A
        restarted run reports some rounds again; the later item wins."""
        self.timing: list[dict[str, Any]] = []
        """Timing windows in file order: ``{"time", "rank", "attempt", **window}``."""
        self.timeline: list[dict[str, Any]] = []
        """Run starts, failures, decisions, checkpoints, stragglers, the end (no tracebacks)."""
        self.stragglers: dict[int, dict[str, Any]] = {}
        """Ranks flagged as stragglers now (cleared by ``straggler_cleared``, a new attempt or a
        resize)."""

    @property
    def generation(self) -> str:
        """Changes when the lists start over (the events file was replaced)."""
        return f"{self._id}.{self._resets}"

    @property
    def config(self) -> dict[str, Any] | None:
        return self._config.value

    @property
    def result(self) -> dict[str, Any] | None:
        return self._result.value

    def refresh(self, *, events: bool = True, entries: list[dict[str, Any]] | None = None) -> None:
        """Reads what changed on storage.

        Args:
            events: Whether to read ``events.jsonl`` (what is new of it). The runs table skips
                it for finished runs whose ``result.json`` has everything.
            entries: The run directory's listing if the caller has it (saves one ``ls``).
        """
        self._config.read()
        self._result.read()
        if entries is None:
            entries = runs._ls(self._fs, self._fs_dir)
        self.checkpoints = self._list_checkpoints(entries)
        if events:
            if self._tail.check():
                self._resets += 1
                self._clear()
            for event in self._tail.read_new():
                self._add(event)
            self.events_read = True
            self.digest.skipped = self._tail.skipped

    def _add(self, event: dict[str, Any]) -> None:
        event = clean_json(event)
        self.digest.add(event)
        kind = event["type"]
        t = runs._as_float(event.get("time"))
        rank = runs._as_int(event.get("rank"))
        if kind == "report":
            if rank == 0 and runs._as_int(event.get("round")) is not None:
                self.metrics.append(
                    {
                        "round": runs._as_int(event.get("round")),
                        "time": t,
                        "attempt": self.attempt,
                        "metrics": runs._as_dict(event.get("metrics")),
                    }
                )
            return
        if kind == "timing":
            if rank is not None:
                attempt = runs._as_int(event.get("attempt"))
                self.timing.append(
                    {
                        "time": t,
                        "rank": rank,
                        "attempt": self.attempt if attempt is None else attempt,
                        **_window(event),
                    }
                )
            return
        if kind == "run_start":
            attempt = runs._as_int(event.get("attempt"))
            self.attempt = attempt if attempt is not None else self.attempt + 1
            self.stragglers.clear()  # a new worker group: earlier flags describe old processes
        elif kind == "straggler" and rank is not None:
            self.stragglers[rank] = {k: v for k, v in event.items() if k != "type"}
        elif kind == "straggler_cleared" and rank is not None:
            self.stragglers.pop(rank, None)
        elif kind == "resize":
            # Ranks are renumbered in a resized group: a flag names a process no longer there.
            self.stragglers.clear()
        elif kind == "checkpoint" and isinstance(event.get("path"), str):
            # A round written again after a restart: its manifest is new.
            self._manifests.pop(runs._basename(event["path"]), None)
        if kind in TIMELINE_TYPES:
            self.timeline.append({k: v for k, v in event.items() if k != "traceback"})

    def _list_checkpoints(self, entries: list[dict[str, Any]]) -> list[CheckpointInfo]:
        """The complete checkpoints; a manifest is read once (published checkpoints do not
        change)."""
        present = {
            runs._basename(str(e["name"]))
            for e in entries
            if e.get("type") == "directory"
            and runs._CHECKPOINT_RE.match(runs._basename(str(e["name"])))
        }
        for name in list(self._manifests):
            if name not in present:
                del self._manifests[name]
        new = present - set(self._manifests)
        missing = [e for e in entries if runs._basename(str(e["name"])) in new]
        for info in runs._list_checkpoints(self._fs, self._fs_dir, self.run_dir, missing):
            self._manifests[info.name] = info
        return sorted(self._manifests.values(), key=lambda c: (c.round, c.name))

    def summary(self, now: float | None = None) -> RunSummary:
        """The run's ``ringtrain ls`` line (status, duration, world size, rounds, metrics)."""
        return runs._summarize(
            self.name,
            self.run_dir,
            self.config,
            self.result,
            self._local,
            len(self.checkpoints),
            self.digest if self.events_read else None,
            time.time() if now is None else now,
        )

    def snapshot(self, cursors: Cursors, limit: int = DEFAULT_LIMIT) -> dict[str, Any]:
        """The run as the page's JSON: the summary, small tables in full, and the items of the
        growing lists that the page does not have yet.

        Args:
            cursors: What the page has.
            limit: At most this many items per list; ``more`` is true when some were held back.

        Returns:
            A JSON-ready dict (see docs/dashboard.md, ``GET /api/runs/{name}``).
        """
        reset = cursors.generation != self.generation
        lists: dict[str, Any] = {}
        more = False
        for key, have in (
            ("metrics", cursors.metrics),
            ("timing", cursors.timing),
            ("timeline", cursors.timeline),
        ):
            items: list[dict[str, Any]] = getattr(self, key)
            start = 0 if reset or have > len(items) else max(0, have)
            chunk = items[start : start + limit]
            more = more or start + len(chunk) < len(items)
            lists[key] = {"start": start, "items": chunk, "total": len(items)}
        summary = self.summary()
        result = self.result or {}
        best = {
            runs._basename(b["path"])
            for b in result.get("best_checkpoints") or []
            if isinstance(b, dict) and isinstance(b.get("path"), str)
        }
        latest = result.get("checkpoint")
        latest_name = runs._basename(latest) if isinstance(latest, str) else None
        config = self.config or {}
        return {
            "name": self.name,
            "path": self.run_dir,
            "generation": self.generation,
            "reset": bool(reset),
            "more": more,
            "summary": clean_json(asdict(summary)),
            "attempt": self.attempt,
            "train_loop_config": clean_json(config.get("train_loop_config")),
            "scaling_config": clean_json(config.get("scaling_config")),
            "checkpoints": [
                {
                    "name": c.name,
                    "round": c.round,
                    "size_bytes": c.size_bytes,
                    "created": c.created,
                    "metrics": clean_json(c.metrics),
                    "latest": c.name == latest_name,
                    "best": c.name in best,
                }
                for c in self.checkpoints
            ],
            "failures": [clean_json(asdict(f)) for f in self._failures()],
            **self._elastic(),
            "stragglers": [self.stragglers[r] for r in sorted(self.stragglers)],
            "rank_metrics": {
                str(rank): {"round": m.round, "time": m.time, "metrics": m.metrics}
                for rank, m in sorted(self.digest.rank_metrics.items())
            },
            "skipped_event_lines": self._tail.skipped,
            **lists,
        }

    def _elastic(self) -> dict[str, Any]:
        """The world size over time, resizes and ranks that left (docs/dashboard.md)."""
        limits = runs.worker_range(self.config)
        return {
            "elastic": None
            if limits is None
            else {"min_workers": limits[0], "max_workers": limits[1]},
            "world_sizes": [clean_json(asdict(c)) for c in self.digest.world_sizes],
            "resizes": [clean_json(asdict(r)) for r in self.digest.resizes],
            "left_ranks": [
                {"rank": rank, "time": t}
                for rank, t in runs.departed_ranks(self.digest.world_sizes).items()
            ],
        }

    def _failures(self) -> list[runs.FailureInfo]:
        if self.digest.failures:
            return list(self.digest.failures)
        listed = (self.result or {}).get("failures")
        if not isinstance(listed, list):
            return []
        return [
            runs._failure_from(f, runs._as_float(f.get("time")))
            for f in listed
            if isinstance(f, dict)
        ]


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
        names = {
            runs._basename(str(e["name"]))
            for e in runs._ls(self._fs, self._fs_root)
            if e.get("type") == "file"
        }
        return runs._basename(self._fs_root) if names & _RUN_FILES else None

    def _log(self, name: str, run_dir: str) -> RunLog:
        with self._lock:
            log = self._logs.get(name)
            if log is None or log.run_dir != run_dir:
                log = self._logs[name] = RunLog(name, run_dir)
            return log

    def _run_dirs(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        """(name, run directory, its listing) of every run, by name."""
        runs._invalidate(self._fs)
        top = runs._ls(self._fs, self._fs_root)
        if {runs._basename(str(e["name"])) for e in top if e.get("type") == "file"} & _RUN_FILES:
            return [(runs._basename(self._fs_root), self.path, top)]
        found = []
        for entry in sorted(top, key=lambda e: str(e["name"])):
            if entry.get("type") != "directory":
                continue
            name = runs._basename(str(entry["name"]))
            listing = runs._ls(self._fs, runs._join_fs(self._fs_root, name))
            files = {runs._basename(str(e["name"])) for e in listing if e.get("type") == "file"}
            if files & _RUN_FILES:
                found.append((name, runs._join_user(self.path, name), listing))
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
                complete = status in runs.TERMINAL_STATUSES and bool((result or {}).get("metrics"))
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
        runs._invalidate(self._fs)  # listings of a run still being written must be fresh
        single = self.single
        if single is not None:
            if name != single:
                return None
            run_dir = self.path
        else:
            listing = runs._ls(self._fs, runs._join_fs(self._fs_root, name))
            files = {runs._basename(str(e["name"])) for e in listing if e.get("type") == "file"}
            if not files & _RUN_FILES:
                return None
            run_dir = runs._join_user(self.path, name)
        log = self._log(name, run_dir)
        with log.lock:
            log.refresh(events=True)
            return log.snapshot(cursors, limit=limit)
