"""Reading run directories for ``ringtrain ls`` and ``ringtrain show``.

A run directory follows ``docs/run-directory.md``: ``config.json``, ``events.jsonl``,
``checkpoint_NNNNNN/manifest.json`` and ``result.json`` under ``{storage_path}/{name}/``. The
storage path may be a local path or any fsspec URL (``memory://``, ``s3://``, ...).

Everything here only reads, and tolerates runs that are still being written: a truncated last
line in ``events.jsonl``, a ``result.json`` caught half-rewritten, a checkpoint directory whose
``manifest.json`` is not there yet (such a checkpoint does not exist and is not listed).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem

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

__all__ = [
    "CheckpointInfo",
    "FailureInfo",
    "ResizeInfo",
    "RoundMetrics",
    "RunDetails",
    "RunSummary",
    "WorldSizeChange",
    "departed_ranks",
    "elastic_history",
    "list_runs",
    "load_run",
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


CONFIG_FILE = "config.json"
EVENTS_FILE = "events.jsonl"
RESULT_FILE = "result.json"
MANIFEST_FILE = "manifest.json"

#: Statuses a run can end with; ``RUNNING`` and ``UNKNOWN`` are the others.
TERMINAL_STATUSES = frozenset({"FINISHED", "ERRORED", "ABORTED", "STOPPED"})

_CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")

# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def _as_dict(value: Any) -> dict[str, Any]:
    return dict(value) if isinstance(value, dict) else {}


def _join_user(base: str, name: str) -> str:
    """Joins a name onto a user-facing path or URL."""
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def _join_fs(base: str, name: str) -> str:
    """Joins a name onto a filesystem-internal (protocol-less, '/'-separated) path."""
    return base.rstrip("/") + "/" + name


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def _is_local(fs: Any) -> bool:
    return isinstance(fs, LocalFileSystem)


def _read_bytes(fs: Any, path: str) -> bytes | None:
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
    except (OSError, ValueError):
        return None
    return bytes(data)


def _read_json(fs: Any, path: str) -> dict[str, Any] | None:
    """Reads a JSON object; None if the file is missing, unreadable, invalid or not an object."""
    data = _read_bytes(fs, path)
    if data is None:
        return None
    try:
        obj = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None


def _read_events(fs: Any, path: str) -> tuple[list[dict[str, Any]], int]:
    """Reads ``events.jsonl``: the parsed events and the number of lines skipped as unreadable."""
    data = _read_bytes(fs, path)
    if data is None:
        return [], 0
    events: list[dict[str, Any]] = []
    skipped = 0
    # Split on b"\n" only: JSON strings may hold U+2028 and friends, which str.splitlines splits.
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            skipped += 1
            continue
        if isinstance(obj, dict) and isinstance(obj.get("type"), str):
            events.append(obj)
        else:
            skipped += 1
    return events, skipped


def _ls(fs: Any, path: str) -> list[dict[str, Any]]:
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [e for e in entries if isinstance(e, dict) and "name" in e]


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


def _driver_gone(result: Mapping[str, Any]) -> bool:
    """Whether a RUNNING result's driver process is known to be dead (local storage only)."""
    pid = _as_int(result.get("driver_pid"))
    if pid is None:
        return False
    # The contract does not require a host name; honour one if the driver records it, so that a
    # run on shared storage started on another machine is not declared dead from here.
    host = result.get("hostname", result.get("host"))
    if isinstance(host, str) and host and host != socket.gethostname():
        return False
    return not pid_alive(pid)


def _error_text(error: Any) -> str | None:
    if error is None or error == "":
        return None
    if isinstance(error, dict):
        for key in ("message", "error", "type"):
            if isinstance(error.get(key), str):
                return str(error[key])
        return json.dumps(error)
    return str(error)


@dataclass
class _EventDigest:
    """What the summary and details need out of ``events.jsonl``."""

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

    def add(self, ev: Mapping[str, Any]) -> None:
        """Folds one event into the digest (events are added in file order; the dashboard adds
        them as ``events.jsonl`` grows)."""
        t = _as_float(ev.get("time"))
        if t is not None:
            if self.first_time is None:
                self.first_time = t
            self.last_time = t if self.last_time is None else max(self.last_time, t)
        kind = ev.get("type")
        if kind == "report":
            rank = _as_int(ev.get("rank"))
            rnd = _as_int(ev.get("round"))
            if rank is None or rnd is None:
                return
            entry = RoundMetrics(round=rnd, time=t, metrics=_as_dict(ev.get("metrics")))
            self.rank_metrics[rank] = entry
            if rank == 0:
                self.rounds[rnd] = entry
        elif kind == "run_start":
            ws = _as_int(ev.get("world_size"))
            if ws is not None:
                self.world_size = ws
                self.world_sizes.append(WorldSizeChange(t, ws, "run_start"))
            # A new attempt: an earlier run_end does not describe the run any more.
            self.end_status = None
            self.end_duration_s = None
        elif kind == "failure":
            self.failures.append(_failure_from(ev, t))
        elif kind == "resize":
            info = _resize_from(ev, t)
            self.resizes.append(info)
            if info.new_world_size is not None:
                self.world_size = info.new_world_size
                since = info.failure_time if info.failure_time is not None else t
                if self.world_sizes and since is not None:
                    # A change never draws before the previous one (clocks, unknown times).
                    last = self.world_sizes[-1].time
                    since = since if last is None else max(since, last)
                self.world_sizes.append(WorldSizeChange(since, info.new_world_size, "resize"))
        elif kind == "resize_fallback":
            reason = ev.get("reason")
            self.resizes.append(
                ResizeInfo(kind="fallback", time=t, cause=reason if isinstance(reason, str) else "")
            )
        elif kind == "run_end":
            status = ev.get("status")
            self.end_status = status.upper() if isinstance(status, str) else None
            self.end_duration_s = _as_float(ev.get("duration_s"))


def _resize_from(ev: Mapping[str, Any], t: float | None) -> ResizeInfo:
    cause = ev.get("cause")
    return ResizeInfo(
        kind="resize",
        time=t,
        old_world_size=_as_int(ev.get("old_world_size")),
        new_world_size=_as_int(ev.get("new_world_size")),
        cause=cause if isinstance(cause, str) else "",
        generation=_as_int(ev.get("generation")),
        snapshot_step=_as_int(ev.get("snapshot_step")),
        steps_rolled_back=_as_int(ev.get("steps_rolled_back")),
        failure_time=_as_float(ev.get("failure_time")),
        resume_s=_as_float(ev.get("resume_s")),
    )


def elastic_history(
    events: Iterable[Mapping[str, Any]],
) -> tuple[list[ResizeInfo], list[WorldSizeChange]]:
    """An elastic run's resizes and its world size over time, from its events.

    Args:
        events: Parsed ``events.jsonl`` lines, in file order (other types are ignored).

    Returns:
        ``(resizes, world_sizes)``: every ``resize`` and ``resize_fallback`` event in file order,
        and one :class:`WorldSizeChange` per ``run_start`` and per ``resize`` (its last entry
        is the current world size). Both are empty for events with neither.
    """
    digest = _EventDigest()
    for ev in events:
        digest.add(ev)
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
    n = _as_dict((config or {}).get("scaling_config")).get("num_workers")
    if isinstance(n, (list, tuple)) and len(n) == 2:
        lo, hi = _as_int(n[0]), _as_int(n[1])
        if lo is not None and hi is not None:
            return lo, hi
    return None


def _digest_events(events: list[dict[str, Any]], skipped: int) -> _EventDigest:
    digest = _EventDigest(skipped=skipped)
    for ev in events:
        digest.add(ev)
    return digest


def _failure_from(obj: Mapping[str, Any], t: float | None) -> FailureInfo:
    tb = obj.get("traceback")
    return FailureInfo(
        rank=_as_int(obj.get("rank")),
        kind=str(obj.get("kind") or "unknown"),
        message=str(obj.get("message") or ""),
        traceback=tb if isinstance(tb, str) and tb else None,
        time=t,
        follow_on=obj.get("follow_on") is True,
    )


def _checkpoint_size(fs: Any, path: str, files: Mapping[str, Any]) -> int:
    sizes = [_as_int(v.get("size")) if isinstance(v, dict) else None for v in files.values()]
    if files and all(s is not None for s in sizes):
        return sum(s for s in sizes if s is not None)
    try:
        total = fs.du(path, total=True)
    except (OSError, ValueError):
        return 0
    return int(total) if isinstance(total, (int, float)) else 0


def _list_checkpoints(
    fs: Any, fs_run_dir: str, run_dir: str, entries: list[dict[str, Any]]
) -> list[CheckpointInfo]:
    checkpoints: list[CheckpointInfo] = []
    for entry in entries:
        if entry.get("type") != "directory":
            continue
        name = _basename(str(entry["name"]))
        match = _CHECKPOINT_RE.match(name)
        if match is None:
            continue
        fs_path = _join_fs(fs_run_dir, name)
        manifest = _read_json(fs, _join_fs(fs_path, MANIFEST_FILE))
        if manifest is None:
            continue  # no valid manifest: the checkpoint does not exist
        rnd = _as_int(manifest.get("round"))
        files = _as_dict(manifest.get("files"))
        checkpoints.append(
            CheckpointInfo(
                name=name,
                path=_join_user(run_dir, name),
                round=rnd if rnd is not None else int(match.group(1)),
                metrics=_as_dict(manifest.get("metrics")),
                size_bytes=_checkpoint_size(fs, fs_path, files),
                created=_as_float(manifest.get("created")),
                files=files,
            )
        )
    checkpoints.sort(key=lambda c: (c.round, c.name))
    return checkpoints


def _summarize(
    name: str,
    run_dir: str,
    config: dict[str, Any] | None,
    result: dict[str, Any] | None,
    local: bool,
    num_checkpoints: int,
    digest: _EventDigest | None,
    now: float,
) -> RunSummary:
    cfg = config or {}
    res = result or {}
    file_status = res.get("status")
    file_status = file_status.upper() if isinstance(file_status, str) and file_status else None

    if result is None or file_status is None:
        status = "UNKNOWN"
    elif file_status == "RUNNING" and digest is not None and digest.end_status:
        # The driver logged the end but died before rewriting result.json.
        status = digest.end_status
    elif file_status == "RUNNING" and local and _driver_gone(res):
        status = "ABORTED"
    else:
        status = file_status

    start_time = _as_float(res.get("start_time"))
    if start_time is None:
        start_time = _as_float(cfg.get("created"))
    if start_time is None and digest is not None:
        start_time = digest.first_time

    duration: float | None = None
    if status == "RUNNING":
        duration = None if start_time is None else max(0.0, now - start_time)
    elif file_status != "RUNNING":
        duration = _as_float(res.get("duration_s"))
        end_time = _as_float(res.get("end_time"))
        if duration is None and end_time is not None and start_time is not None:
            duration = max(0.0, end_time - start_time)
    if duration is None and status != "RUNNING" and digest is not None:
        if digest.end_duration_s is not None:
            duration = digest.end_duration_s
        elif digest.last_time is not None and start_time is not None:
            duration = max(0.0, digest.last_time - start_time)
    if duration is None and status != "RUNNING":
        # A dead run's last result.json: its duration is how long it had run when written.
        duration = _as_float(res.get("duration_s"))

    # The events know the current world size (an elastic run resizes; a running run's
    # result.json is rewritten only now and then); else result.json, else the configuration.
    world_size = digest.world_size if digest is not None else None
    if world_size is None:
        world_size = _as_int(res.get("world_size"))
    if world_size is None:
        world_size = _as_int(_as_dict(cfg.get("scaling_config")).get("num_workers"))

    metrics = _as_dict(res.get("metrics"))
    if digest is not None and digest.rounds and (not metrics or file_status == "RUNNING"):
        metrics = dict(digest.rounds[max(digest.rounds)].metrics)

    rounds = _as_int(res.get("rounds"))
    if digest is not None and digest.rounds and (rounds is None or file_status == "RUNNING"):
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
        error=_error_text(res.get("error")),
    )


def _read_run(
    fs: Any,
    fs_run_dir: str,
    run_dir: str,
    entries: list[dict[str, Any]],
    *,
    need_events: bool,
    now: float,
) -> tuple[
    RunSummary,
    dict[str, Any] | None,
    dict[str, Any] | None,
    _EventDigest | None,
    list[CheckpointInfo],
]:
    files = {_basename(str(e["name"])) for e in entries if e.get("type") == "file"}
    config = _read_json(fs, _join_fs(fs_run_dir, CONFIG_FILE)) if CONFIG_FILE in files else None
    result = _read_json(fs, _join_fs(fs_run_dir, RESULT_FILE)) if RESULT_FILE in files else None
    checkpoints = _list_checkpoints(fs, fs_run_dir, run_dir, entries)

    status = result.get("status") if result else None
    if not need_events:
        # ``ls`` reads events only for runs that result.json does not describe completely.
        need_events = status not in TERMINAL_STATUSES or not _as_dict((result or {}).get("metrics"))
    digest: _EventDigest | None = None
    if need_events and EVENTS_FILE in files:
        events, skipped = _read_events(fs, _join_fs(fs_run_dir, EVENTS_FILE))
        digest = _digest_events(events, skipped)

    summary = _summarize(
        _basename(fs_run_dir),
        run_dir,
        config,
        result,
        _is_local(fs),
        len(checkpoints),
        digest,
        now,
    )
    return summary, config, result, digest, checkpoints


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
    _invalidate(fs)
    if not fs.exists(fs_root):
        raise FileNotFoundError(f"storage path {storage_path!r} does not exist: no runs there")
    if not fs.isdir(fs_root):
        raise FileNotFoundError(f"storage path {storage_path!r} is a file, not a directory of runs")
    now = time.time()
    runs: list[RunSummary] = []
    for entry in sorted(_ls(fs, fs_root), key=lambda e: str(e["name"])):
        if entry.get("type") != "directory":
            continue
        name = _basename(str(entry["name"]))
        fs_run_dir = _join_fs(fs_root, name)
        entries = _ls(fs, fs_run_dir)
        names = {_basename(str(e["name"])) for e in entries if e.get("type") == "file"}
        if CONFIG_FILE not in names and RESULT_FILE not in names:
            continue
        summary, *_ = _read_run(
            fs, fs_run_dir, _join_user(storage_path, name), entries, need_events=False, now=now
        )
        runs.append(summary)
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
    _invalidate(fs)
    if not fs.isdir(fs_run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    entries = _ls(fs, fs_run_dir)
    names = {_basename(str(e["name"])) for e in entries if e.get("type") == "file"}
    if not names & {CONFIG_FILE, RESULT_FILE, EVENTS_FILE}:
        raise FileNotFoundError(
            f"{run_dir!r} is not a ringtrain run directory "
            f"(no {CONFIG_FILE}, {RESULT_FILE} or {EVENTS_FILE})"
        )
    summary, config, result, digest, checkpoints = _read_run(
        fs, fs_run_dir, run_dir, entries, need_events=True, now=time.time()
    )
    digest = digest or _EventDigest()
    failures = list(digest.failures)
    if not failures and result is not None and isinstance(result.get("failures"), list):
        failures = [
            _failure_from(f, _as_float(f.get("time")))
            for f in result["failures"]
            if isinstance(f, dict)
        ]
    return RunDetails(
        summary=summary,
        config=config,
        result=result,
        rounds=[digest.rounds[r] for r in sorted(digest.rounds)],
        rank_metrics={r: digest.rank_metrics[r] for r in sorted(digest.rank_metrics)},
        checkpoints=checkpoints,
        failures=failures,
        resizes=list(digest.resizes),
        world_sizes=list(digest.world_sizes),
        skipped_event_lines=digest.skipped,
    )


def _invalidate(fs: Any) -> None:
    """Drops cached listings, so a run that is still being written is read as it is now."""
    with contextlib.suppress(Exception):  # best effort
        fs.invalidate_cache()
