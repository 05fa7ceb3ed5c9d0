"""Reading run directories for ``ringtrain ls`` and ``ringtrain show``.

A run directory follows ``docs/run-directory.md``: ``config.json``, ``events.jsonl``,
``checkpoint_NNNNNN/manifest.json`` and ``result.json`` under ``{storage_path}/{name}/``. The
storage path may be a local path or any fsspec URL (``memory://``, ``s3://``, ...).

Everything here only reads, and tolerates runs that are still being written: a truncated last
line in ``events.jsonl``, a ``result.json`` caught half-rewritten, a checkpoint directory whose
``manifest.json`` is not there yet (such a checkpoint does not exist and is not listed).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs

# The records this module fills; re-exported: import them from here.
from ringtrain.monitor.records import (
    CheckpointInfo,
    FailureInfo,
    ResizeInfo,
    RoundMetrics,
    RunDetails,
    RunSummary,
    WorldSizeChange,
)
from ringtrain.monitor.storage import (
    basename,
    file_names,
    invalidate,
    is_local,
    join_fs,
    join_user,
    list_checkpoints,
    ls,
    read_json,
)
from ringtrain.rundir.reader import read_events
from ringtrain.rundir.schema import (
    CONFIG_FILE,
    EVENTS_FILE,
    MANIFEST_FILE,
    RESULT_FILE,
    TERMINAL_STATUSES,
    ConfigRecord,
    EventRecord,
    FailureEvent,
    ReportEvent,
    ResizeEvent,
    ResizeFallbackEvent,
    ResultRecord,
    RunEndEvent,
    RunStartEvent,
    parse_event,
)

__all__ = [
    "CONFIG_FILE",
    "EVENTS_FILE",
    "MANIFEST_FILE",
    "RESULT_FILE",
    "TERMINAL_STATUSES",
    "CheckpointInfo",
    "EventDigest",
    "FailureInfo",
    "ResizeInfo",
    "RoundMetrics",
    "RunDetails",
    "RunSummary",
    "WorldSizeChange",
    "departed_ranks",
    "elastic_history",
    "failure_info",
    "list_runs",
    "load_run",
    "pid_alive",
    "result_failures",
    "summarize",
    "worker_range",
]

#: Rendering lives in :mod:`ringtrain.monitor.render`; these names are re-exported from here
#: (lazily: render imports this module) so that ``from ringtrain.monitor.runs import render_runs``
#: keeps working.
_RENDER_NAMES = frozenset(
    {
        "format_bytes",
        "format_duration",
        "format_metrics",
        "format_timestamp",
        "format_value",
        "render_run",
        "render_runs",
    }
)


def __getattr__(name: str) -> Any:
    if name in _RENDER_NAMES:
        from ringtrain.monitor import render

        return getattr(render, name)
    if name in ("SweepSummary", "list_sweeps"):
        from ringtrain.monitor import sweeps

        return getattr(sweeps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, but belongs to someone else
    except OSError:
        return False
    return True


def _driver_gone(result: ResultRecord) -> bool:
    """Whether a RUNNING result's driver process is known to be dead (local storage only)."""
    if result.driver_pid is None:
        return False
    # The contract does not require a host name; honour one if the driver records it, so that a
    # run on shared storage started on another machine is not declared dead from here.
    if result.hostname and result.hostname != socket.gethostname():
        return False
    return not pid_alive(result.driver_pid)


def _error_text(error: Any) -> str | None:
    if error is None or error == "":
        return None
    if isinstance(error, dict):
        for key in ("message", "error", "type"):
            if isinstance(error.get(key), str):
                return str(error[key])
        return json.dumps(error)
    return str(error)


def failure_info(event: FailureEvent) -> FailureInfo:
    """What ``ringtrain show`` and the dashboard tell about a ``failure`` event (or an item of
    ``result.json``'s ``failures``, read as one)."""
    return FailureInfo(
        rank=event.rank,
        kind=event.kind or "unknown",
        message=event.message or "",
        traceback=event.traceback or None,
        time=event.time,
        follow_on=event.follow_on,
    )


def _result_failures(result: ResultRecord) -> list[FailureInfo]:
    records = (FailureEvent.from_json(f) for f in result.failures if isinstance(f, dict))
    return [failure_info(r) for r in records if r is not None]


@dataclass
class EventDigest:
    """What the summary and details need out of ``events.jsonl``, folded one record at a time
    (in file order; the dashboard adds them as the file grows)."""

    rounds: dict[int, RoundMetrics] = field(default_factory=dict)
    rank_metrics: dict[int, RoundMetrics] = field(default_factory=dict)
    failures: list[FailureInfo] = field(default_factory=list)
    first_time: float | None = None
    last_time: float | None = None
    world_size: int | None = None
    end_status: str | None = None
    end_duration_s: float | None = None
    resizes: list[ResizeInfo] = field(default_factory=list)
    world_sizes: list[WorldSizeChange] = field(default_factory=list)
    skipped: int = 0

    def add(self, ev: EventRecord) -> None:
        """Folds one event into the digest (other kinds than those below only move the time)."""
        t = ev.time
        if t is not None:
            if self.first_time is None:
                self.first_time = t
            self.last_time = t if self.last_time is None else max(self.last_time, t)
        match ev:
            case ReportEvent():
                entry = RoundMetrics(round=ev.round, time=t, metrics=dict(ev.metrics))
                self.rank_metrics[ev.rank] = entry
                if ev.rank == 0:
                    self.rounds[ev.round] = entry
            case RunStartEvent():
                if ev.world_size is not None:
                    self.world_size = ev.world_size
                    self.world_sizes.append(WorldSizeChange(t, ev.world_size, "run_start"))
                # A new attempt: an earlier run_end does not describe the run any more.
                self.end_status = None
                self.end_duration_s = None
            case FailureEvent():
                self.failures.append(failure_info(ev))
            case ResizeEvent():
                self._resize(ev)
            case ResizeFallbackEvent():
                self.resizes.append(ResizeInfo(kind="fallback", time=t, cause=ev.reason or ""))
            case RunEndEvent():
                self.end_status = ev.status.upper() if ev.status is not None else None
                self.end_duration_s = ev.duration_s

    def _resize(self, ev: ResizeEvent) -> None:
        t = ev.time
        self.resizes.append(
            ResizeInfo(
                kind="resize",
                time=t,
                old_world_size=ev.old_world_size,
                new_world_size=ev.new_world_size,
                cause=ev.cause or "",
                generation=ev.generation,
                snapshot_step=ev.snapshot_step,
                steps_rolled_back=ev.steps_rolled_back,
                failure_time=ev.failure_time,
                resume_s=ev.resume_s,
            )
        )
        if ev.new_world_size is None:
            return
        self.world_size = ev.new_world_size
        since = ev.failure_time if ev.failure_time is not None else t
        if self.world_sizes and since is not None:
            # A change never draws before the previous one (clocks, unknown times).
            last = self.world_sizes[-1].time
            since = since if last is None else max(since, last)
        self.world_sizes.append(WorldSizeChange(since, ev.new_world_size, "resize"))


def elastic_history(
    events: Iterable[Mapping[str, Any] | EventRecord],
) -> tuple[list[ResizeInfo], list[WorldSizeChange]]:
    """An elastic run's resizes and its world size over time, from its events.

    Args:
        events: ``events.jsonl``'s records (or its parsed lines), in file order (other kinds are
            ignored).

    Returns:
        ``(resizes, world_sizes)``: every ``resize`` and ``resize_fallback`` event in file order,
        and one :class:`WorldSizeChange` per ``run_start`` and per ``resize`` (its last entry
        is the current world size). Both are empty for events with neither.
    """
    digest = EventDigest()
    for ev in events:
        record = ev if isinstance(ev, EventRecord) else parse_event(ev)
        if record is not None:
            digest.add(record)
    return digest.resizes, digest.world_sizes


def departed_ranks(world_sizes: Sequence[WorldSizeChange]) -> dict[int, float | None]:
    """The ranks that left the group: in it at some point, beyond the current world size.

    Args:
        world_sizes: The world size over time (:func:`elastic_history`), oldest first.

    Returns:
        Rank -> when it left (the time of the change from which on it was no longer in the
        group, Unix seconds, or None if unknown), sorted by rank. Empty when the group is as
        large as it ever was (a rank that grew back is in the group again).
    """
    left: dict[int, float | None] = {}
    size = 0
    for change in world_sizes:
        for rank in range(change.world_size, size):
            left[rank] = change.time
        for rank in range(size, change.world_size):
            left.pop(rank, None)
        size = change.world_size
    return {rank: left[rank] for rank in sorted(left)}


def worker_range(config: Mapping[str, Any] | None) -> tuple[int, int] | None:
    """An elastic run's ``(min, max)`` workers, from its ``config.json``.

    Args:
        config: The parsed ``config.json`` (or None).

    Returns:
        ``scaling_config.num_workers`` when it is a ``[min, max]`` pair of ints; None for a
        fixed world size or when unknown.
    """
    record = ConfigRecord.from_json(config or {})
    return None if record is None else record.worker_range()


def _status(
    result: ResultRecord | None, local: bool, digest: EventDigest | None
) -> tuple[str, str | None]:
    """The run's status, and the one ``result.json`` says (upper case; None if unknown)."""
    file_status = result.status.upper() if result is not None and result.status else None
    if result is None or file_status is None:
        return "UNKNOWN", None
    if file_status == "RUNNING" and digest is not None and digest.end_status:
        # The driver logged the end but died before rewriting result.json.
        return digest.end_status, file_status
    if file_status == "RUNNING" and local and _driver_gone(result):
        return "ABORTED", file_status
    return file_status, file_status


def _duration(
    status: str,
    file_status: str | None,
    start_time: float | None,
    res: ResultRecord,
    digest: EventDigest | None,
    now: float,
) -> float | None:
    if status == "RUNNING":
        return None if start_time is None else max(0.0, now - start_time)
    duration: float | None = None
    if file_status != "RUNNING":
        duration = res.duration_s
        if duration is None and res.end_time is not None and start_time is not None:
            duration = max(0.0, res.end_time - start_time)
    if duration is None and digest is not None:
        if digest.end_duration_s is not None:
            duration = digest.end_duration_s
        elif digest.last_time is not None and start_time is not None:
            duration = max(0.0, digest.last_time - start_time)
    if duration is None:
        # A dead run's last result.json: its duration is how long it had run when written.
        duration = res.duration_s
    return duration


def summarize(
    name: str,
    run_dir: str,
    config: Mapping[str, Any] | None,
    result: Mapping[str, Any] | None,
    local: bool,
    num_checkpoints: int,
    digest: EventDigest | None,
    now: float,
) -> RunSummary:
    """A run's ``ringtrain ls`` line from its parsed ``config.json`` and ``result.json`` (None
    when unreadable) and, when they were read, its events' digest."""
    cfg = ConfigRecord.from_json(config or {}) or ConfigRecord()
    record = ResultRecord.from_json(result) if result is not None else None
    res = record or ResultRecord()
    status, file_status = _status(record, local, digest)

    start_time = res.start_time if res.start_time is not None else cfg.created
    if start_time is None and digest is not None:
        start_time = digest.first_time
    duration = _duration(status, file_status, start_time, res, digest, now)

    # The events know the current world size (an elastic run resizes; a running run's
    # result.json is rewritten only now and then); else result.json, else the configuration.
    world_size = digest.world_size if digest is not None else None
    if world_size is None:
        world_size = res.world_size if res.world_size is not None else cfg.num_workers()

    metrics, rounds = dict(res.metrics), res.rounds
    if digest is not None and digest.rounds:
        if not metrics or file_status == "RUNNING":
            metrics = dict(digest.rounds[max(digest.rounds)].metrics)
        if rounds is None or file_status == "RUNNING":
            rounds = max(digest.rounds) + 1

    return RunSummary(
        name=name,
        path=run_dir,
        status=status,
        start_time=start_time,
        duration_s=duration,
        world_size=world_size,
        metrics=metrics,
        num_checkpoints=num_checkpoints,
        rounds=rounds,
        error=_error_text(res.error),
    )


@dataclass
class _Run:
    """What one read of a run directory found."""

    summary: RunSummary
    config: dict[str, Any] | None
    result: dict[str, Any] | None
    digest: EventDigest | None
    checkpoints: list[CheckpointInfo]


def _read_run(
    fs: Any,
    fs_run_dir: str,
    run_dir: str,
    entries: list[dict[str, Any]],
    *,
    need_events: bool,
    now: float,
) -> _Run:
    files = file_names(entries)
    config = read_json(fs, join_fs(fs_run_dir, CONFIG_FILE)) if CONFIG_FILE in files else None
    result = read_json(fs, join_fs(fs_run_dir, RESULT_FILE)) if RESULT_FILE in files else None
    checkpoints = list_checkpoints(fs, fs_run_dir, run_dir, entries)

    if not need_events:
        # ``ls`` reads events only for runs that result.json does not describe completely.
        record = ResultRecord.from_json(result or {}) or ResultRecord()
        need_events = record.status not in TERMINAL_STATUSES or not record.metrics
    digest: EventDigest | None = None
    if need_events and EVENTS_FILE in files:
        events, skipped = read_events(fs, join_fs(fs_run_dir, EVENTS_FILE))
        digest = EventDigest(skipped=skipped)
        for ev in events:
            digest.add(ev)

    summary = summarize(
        basename(fs_run_dir), run_dir, config, result, is_local(fs), len(checkpoints), digest, now
    )
    return _Run(summary, config, result, digest, checkpoints)


def list_runs(storage_path: str) -> list[RunSummary]:
    """Lists the runs under a storage path.

    A run is an immediate subdirectory holding ``config.json`` or ``result.json``; other entries
    are skipped.

    Args:
        storage_path: The storage path runs were written to: a local directory or an fsspec URL
            (e.g. ``"./runs"``, ``"memory://runs"``, ``"s3://bucket/runs"``).

    Returns:
        One summary per run, sorted by start time, newest last (runs with no known start time
        first, then by name).

    Raises:
        FileNotFoundError: The storage path does not exist or is not a directory.
    """
    fs, fs_root = url_to_fs(storage_path)
    invalidate(fs)
    if not fs.exists(fs_root):
        raise FileNotFoundError(f"storage path {storage_path!r} does not exist: no runs there")
    if not fs.isdir(fs_root):
        raise FileNotFoundError(f"storage path {storage_path!r} is a file, not a directory of runs")
    now = time.time()
    runs: list[RunSummary] = []
    for entry in sorted(ls(fs, fs_root), key=lambda e: str(e["name"])):
        if entry.get("type") != "directory":
            continue
        name = basename(str(entry["name"]))
        fs_run_dir = join_fs(fs_root, name)
        entries = ls(fs, fs_run_dir)
        if not file_names(entries) & {CONFIG_FILE, RESULT_FILE}:
            continue
        run = _read_run(
            fs, fs_run_dir, join_user(storage_path, name), entries, need_events=False, now=now
        )
        runs.append(run.summary)
    runs.sort(key=lambda r: (r.start_time is not None, r.start_time or 0.0, r.name))
    return runs


def load_run(run_dir: str) -> RunDetails:
    """Loads everything known about one run.

    Args:
        run_dir: The run directory: a local path or an fsspec URL (e.g. ``RunSummary.path``).

    Returns:
        The run's details. Unparseable lines of ``events.jsonl`` (a run still being written) are
        skipped and counted in ``skipped_event_lines``.

    Raises:
        FileNotFoundError: The directory does not exist or holds no ``config.json``,
            ``result.json`` or ``events.jsonl``.
    """
    fs, fs_run_dir = url_to_fs(run_dir)
    invalidate(fs)
    if not fs.isdir(fs_run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    entries = ls(fs, fs_run_dir)
    if not file_names(entries) & {CONFIG_FILE, RESULT_FILE, EVENTS_FILE}:
        raise FileNotFoundError(
            f"{run_dir!r} is not a ringtrain run directory "
            f"(no {CONFIG_FILE}, {RESULT_FILE} or {EVENTS_FILE})"
        )
    run = _read_run(fs, fs_run_dir, run_dir, entries, need_events=True, now=time.time())
    digest = run.digest or EventDigest()
    failures = list(digest.failures)
    if not failures and run.result is not None:
        failures = _result_failures(ResultRecord.from_json(run.result) or ResultRecord())
    return RunDetails(
        summary=run.summary,
        config=run.config,
        result=run.result,
        rounds=[digest.rounds[r] for r in sorted(digest.rounds)],
        rank_metrics={r: digest.rank_metrics[r] for r in sorted(digest.rank_metrics)},
        checkpoints=run.checkpoints,
        failures=failures,
        resizes=list(digest.resizes),
        world_sizes=list(digest.world_sizes),
        skipped_event_lines=digest.skipped,
    )


def result_failures(result: Mapping[str, Any] | None) -> list[FailureInfo]:
    """The failures listed in a parsed ``result.json`` (for runs whose events have none)."""
    record = ResultRecord.from_json(result) if result is not None else None
    return [] if record is None else _result_failures(record)
