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
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsspec.core import url_to_fs

# The records this module fills, and how events are folded; re-exported: import them from here.
from ringtrain.monitor.digest import (
    EventDigest,
    departed_ranks,
    elastic_history,
    failure_info,
    result_failures,
)
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
from ringtrain.rundir.run_records import ConfigRecord, ResultRecord
from ringtrain.rundir.saved_run import pid_alive
from ringtrain.rundir.schema import (
    CONFIG_FILE,
    EVENTS_FILE,
    MANIFEST_FILE,
    RESULT_FILE,
    TERMINAL_STATUSES,
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
        spares=cfg.spares(),
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
        failures = result_failures(run.result)
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
        corruption=list(digest.corruption),
        spares=list(digest.spares),
        skipped_event_lines=digest.skipped,
    )
