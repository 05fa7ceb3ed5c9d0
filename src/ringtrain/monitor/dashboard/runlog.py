"""One run as the dashboard shows it, kept up to date as its directory grows.

A :class:`RunLog` follows one run directory: ``events.jsonl`` is read through the shared
incremental reader (:class:`~ringtrain.rundir.reader.EventReader`: only the lines written since
the previous poll), and ``config.json`` / ``result.json`` / checkpoint manifests are read again
only when they changed. Statuses, durations and last metrics come from the same code as
``ringtrain ls`` (:func:`ringtrain.monitor.runs.summarize`), so both always agree.
"""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from fsspec.core import url_to_fs

from ringtrain.monitor import runs
from ringtrain.monitor.outer_loop import OuterSum
from ringtrain.monitor.records import CheckpointInfo, FailureInfo, RunSummary
from ringtrain.monitor.storage import (
    CHECKPOINT_RE,
    basename,
    is_local,
    join_fs,
    list_checkpoints,
    ls,
    read_json,
)
from ringtrain.rundir.reader import EventReader
from ringtrain.rundir.schema import (
    CONFIG_FILE,
    EVENTS_FILE,
    RESULT_FILE,
    CheckpointDeletedEvent,
    CheckpointEvent,
    CheckpointFailedEvent,
    CheckpointInvalidEvent,
    DecisionEvent,
    EventRecord,
    FailureEvent,
    ReplicaMismatchEvent,
    ReportEvent,
    ResizeEvent,
    ResizeFallbackEvent,
    ResumeEvent,
    RunEndEvent,
    RunStartEvent,
    SpareEvent,
    StragglerClearedEvent,
    StragglerEvent,
    TimingEvent,
)

__all__ = ["DEFAULT_LIMIT", "TIMELINE_TYPES", "Cursors", "RunLog", "clean_json"]

#: Event kinds drawn on the run's timeline (reports and timing windows have their own charts).
TIMELINE_TYPES: frozenset[type[EventRecord]] = frozenset(
    {
        RunStartEvent,
        ResumeEvent,
        FailureEvent,
        DecisionEvent,
        CheckpointEvent,
        CheckpointFailedEvent,
        CheckpointInvalidEvent,
        CheckpointDeletedEvent,
        StragglerEvent,
        StragglerClearedEvent,
        ResizeEvent,
        ResizeFallbackEvent,
        SpareEvent,
        ReplicaMismatchEvent,
        RunEndEvent,
    }
)

#: Most items of one list (metrics, timing, timeline) sent in one response; the page asks again
#: at once for the rest (a long run opened for the first time).
DEFAULT_LIMIT = 20_000


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
        """The file's object now (the last good version if it is caught half-written)."""
        try:
            info = self._fs.info(self._path)
        except (OSError, ValueError):
            self._sig, self.value = None, None
            return None
        sig = _signature(info)
        if sig is not None and sig == self._sig:
            return self.value
        value = read_json(self._fs, self._path)
        if value is None:
            # Caught half-written (storage without atomic rename): keep the last good version.
            return self.value
        self._sig, self.value = sig, clean_json(value)
        return self.value


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


def _window(window: Mapping[str, Any]) -> dict[str, Any]:
    """A timing window's scalar fields, safe for strict JSON."""
    return clean_json(
        {k: v for k, v in window.items() if v is None or isinstance(v, int | float | str)}
    )


def _json_item(event: EventRecord) -> dict[str, Any]:
    """An event as a page item: its JSON object (``type`` included), without a traceback."""
    return clean_json({k: v for k, v in event.to_json().items() if k != "traceback"})


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
        self._local = is_local(self._fs)
        self._config = _JsonFile(self._fs, join_fs(self._fs_dir, CONFIG_FILE))
        self._result = _JsonFile(self._fs, join_fs(self._fs_dir, RESULT_FILE))
        self._reader = EventReader(self._fs, join_fs(self._fs_dir, EVENTS_FILE))
        self._manifests: dict[str, CheckpointInfo] = {}
        self._id = uuid.uuid4().hex[:8]
        self._resets = 0
        self.lock = threading.Lock()
        """Held while refreshing or reading; requests are served from several threads."""
        self.checkpoints: list[CheckpointInfo] = []
        self._clear()

    def _clear(self) -> None:
        self.events_read = False
        self.digest = runs.EventDigest()
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
        self.outer: dict[int, OuterSum] = {}
        """DiLoCo's outer loop per rank, summed over its timing windows (empty: not DiLoCo)."""

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
            entries = ls(self._fs, self._fs_dir)
        self.checkpoints = self._list_checkpoints(entries)
        if events:
            if self._reader.check():
                self._resets += 1
                self._clear()
            for event in self._reader.read_new():
                self._add(event)
            self.events_read = True
            self.digest.skipped = self._reader.skipped

    def _add(self, event: EventRecord) -> None:
        self.digest.add(event)
        match event:
            case ReportEvent():
                if event.rank == 0:
                    self.metrics.append(
                        {
                            "round": event.round,
                            "time": event.time,
                            "attempt": self.attempt,
                            "metrics": clean_json(dict(event.metrics)),
                        }
                    )
            case TimingEvent():
                attempt = self.attempt if event.attempt is None else event.attempt
                item = {"time": event.time, "rank": event.rank, "attempt": attempt}
                self.timing.append(item | _window(event.window))
                if "outer_bytes" in event.window:
                    self.outer.setdefault(event.rank, OuterSum()).add(event.window)
            case RunStartEvent():
                self.attempt = event.attempt if event.attempt is not None else self.attempt + 1
                self.stragglers.clear()  # a new worker group: earlier flags describe old processes
            case StragglerEvent():
                self.stragglers[event.rank] = {
                    k: v for k, v in _json_item(event).items() if k != "type"
                }
            case StragglerClearedEvent():
                self.stragglers.pop(event.rank, None)
            case ResizeEvent():
                # Ranks are renumbered in a resized group: a flag names a process no longer there.
                self.stragglers.clear()
            case CheckpointEvent() if event.path is not None:
                # A round written again after a restart: its manifest is new.
                self._manifests.pop(basename(event.path), None)
        if type(event) in TIMELINE_TYPES:
            self.timeline.append(_json_item(event))

    def _list_checkpoints(self, entries: list[dict[str, Any]]) -> list[CheckpointInfo]:
        """The complete checkpoints; a manifest is read once (published checkpoints do not
        change)."""
        present = {
            basename(str(e["name"]))
            for e in entries
            if e.get("type") == "directory" and CHECKPOINT_RE.match(basename(str(e["name"])))
        }
        for name in list(self._manifests):
            if name not in present:
                del self._manifests[name]
        new = present - set(self._manifests)
        missing = [e for e in entries if basename(str(e["name"])) in new]
        for info in list_checkpoints(self._fs, self._fs_dir, self.run_dir, missing):
            self._manifests[info.name] = info
        return sorted(self._manifests.values(), key=lambda c: (c.round, c.name))

    def summary(self, now: float | None = None) -> RunSummary:
        """The run's ``ringtrain ls`` line (status, duration, world size, rounds, metrics)."""
        return runs.summarize(
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
            basename(b["path"])
            for b in result.get("best_checkpoints") or []
            if isinstance(b, dict) and isinstance(b.get("path"), str)
        }
        latest = result.get("checkpoint")
        latest_name = basename(latest) if isinstance(latest, str) else None
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
                str(rank): {"round": m.round, "time": m.time, "metrics": clean_json(m.metrics)}
                for rank, m in sorted(self.digest.rank_metrics.items())
            },
            "skipped_event_lines": self._reader.skipped,
            "diloco": self._diloco(),
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

    def _diloco(self) -> dict[str, Any] | None:
        """DiLoCo's outer loop (docs/dashboard.md): the run's outer steps (rank 0's latest
        window's, else ``result.json``'s) and each rank's sums; ``None`` for other runs."""
        figures = {r: f for r, s in sorted(self.outer.items()) if (f := s.figures()) is not None}
        if not figures:
            return None
        count = figures[0].outer_steps if 0 in figures else None
        if count is None:
            count = (self.result or {}).get("outer_steps")
        ranks = {str(r): clean_json(f.to_dict()) for r, f in figures.items()}
        return {"outer_steps": count if isinstance(count, int) else None, "ranks": ranks}

    def _failures(self) -> list[FailureInfo]:
        return list(self.digest.failures) or runs.result_failures(self.result)
