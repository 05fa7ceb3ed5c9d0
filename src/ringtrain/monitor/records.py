"""What ``ringtrain ls``, ``ringtrain show`` and the dashboard know about a run: plain records,
filled by :mod:`ringtrain.monitor.runs` from a run directory (docs/run-directory.md) and drawn by
:mod:`ringtrain.monitor.render`. Import them from :mod:`ringtrain.monitor.runs`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CheckpointInfo",
    "FailureInfo",
    "ResizeInfo",
    "RoundMetrics",
    "RunDetails",
    "RunSummary",
    "WorldSizeChange",
]


@dataclass
class RunSummary:
    """One line of ``ringtrain ls``.

    Attributes:
        name: The run's name: its directory's name under the storage path.
        path: The run directory, in the same form as the storage path that was listed (a local
            path or an fsspec URL); it can be passed to :func:`load_run`.
        status: ``RUNNING``, ``FINISHED``, ``ERRORED`` or ``ABORTED``; ``ABORTED`` also for a
            ``RUNNING`` run whose driver process is gone from this host; ``UNKNOWN`` when there
            is no readable ``result.json``.
        start_time: When the run started, Unix time in seconds, or None if unknown.
        duration_s: Run time in seconds (for a running run: until now), or None if unknown.
        world_size: Number of workers now (an elastic run's size after its latest resize), or
            None if unknown.
        metrics: The last metrics reported by rank 0 (empty if none).
        num_checkpoints: Number of complete checkpoints (directories with a valid manifest).
        rounds: Number of report rounds completed, or None if unknown.
        error: The run's error message, if it failed.
        spares: Hot spares the run keeps beside its workers (``ScalingConfig.spares``).
    """

    name: str
    path: str
    status: str
    start_time: float | None = None
    duration_s: float | None = None
    world_size: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    num_checkpoints: int = 0
    rounds: int | None = None
    error: str | None = None
    spares: int = 0


@dataclass
class RoundMetrics:
    """The metrics of one report round.

    Attributes:
        round: The 0-based report round.
        time: When the report was written, Unix time in seconds, or None if unknown.
        metrics: The reported metrics.
    """

    round: int
    time: float | None
    metrics: dict[str, Any]


@dataclass
class CheckpointInfo:
    """A complete checkpoint of a run (a ``checkpoint_NNNNNN`` directory with a valid manifest).

    Attributes:
        name: The directory name, e.g. ``checkpoint_000002``.
        path: The checkpoint directory, in the form of the run directory it was loaded from.
        round: The report round the checkpoint was attached to.
        metrics: Rank 0's metrics of that round, as recorded in the manifest.
        size_bytes: Total size of the checkpoint's files in bytes.
        created: When the checkpoint was completed, Unix time in seconds, or None if unknown.
        files: The manifest's ``files`` table (file name -> size, sha256, rank).
    """

    name: str
    path: str
    round: int
    metrics: dict[str, Any]
    size_bytes: int
    created: float | None = None
    files: dict[str, Any] = field(default_factory=dict)


@dataclass
class FailureInfo:
    """A worker failure recorded by the run.

    Attributes:
        rank: The failed worker's rank, or None if not known.
        kind: ``exception``, ``signal`` or ``exit``.
        message: One-line description of the failure.
        traceback: The worker's formatted traceback, if there was one.
        time: When the failure was recorded, Unix time in seconds, or None if unknown.
        follow_on: True for a peer's error caused by another rank's failure (e.g. the gloo
            "Connection closed by peer" of the rank whose partner died): the record's
            ``"follow_on"`` flag; absent means False (a root cause).
    """

    rank: int | None
    kind: str
    message: str
    traceback: str | None = None
    time: float | None = None
    follow_on: bool = False


@dataclass
class ResizeInfo:
    """A change of an elastic run's worker group (``resize`` and ``resize_fallback`` events,
    docs/elastic.md).

    Attributes:
        kind: ``"resize"``: the group changed size in place (shrank after a lost worker, or grew
            back); ``"fallback"``: it was restarted from the disk checkpoint instead.
        time: When the event was written, Unix time in seconds (a resize is written once the
            first step after it completed), or None if unknown.
        old_world_size: Workers before the resize; None for a fallback.
        new_world_size: Workers after the resize; None for a fallback.
        cause: Why: the lost worker's failure message (or what the resize reports, e.g.
            ``capacity returned``); for a fallback, the reason it was not resized in place.
        generation: The group's generation after the resize (counts resizes), or None.
        snapshot_step: The step of the in-memory snapshot training resumed from, or None.
        steps_rolled_back: Steps computed after that snapshot and lost, or None.
        failure_time: When the worker died (Unix time in seconds), or None.
        resume_s: Seconds from the failure to the first completed step after the resize; None
            when none completed (or unknown).
        spare_ranks: The ranks hot spares took in this resize (``ScalingConfig.spares``), or
            None when none did.
    """

    kind: str
    time: float | None
    old_world_size: int | None = None
    new_world_size: int | None = None
    cause: str = ""
    generation: int | None = None
    snapshot_step: int | None = None
    steps_rolled_back: int | None = None
    failure_time: float | None = None
    resume_s: float | None = None
    spare_ranks: list[int] | None = None


@dataclass
class WorldSizeChange:
    """The world size from a moment on (a step of the world-size-over-time chart).

    Attributes:
        time: From when, Unix time in seconds: a ``run_start``'s time, or for a resize the time
            of the failure that caused it (the event's own time when it has none); None if
            unknown.
        world_size: Number of workers from then on.
        event: ``"run_start"`` or ``"resize"``.
    """

    time: float | None
    world_size: int
    event: str


@dataclass
class RunDetails:
    """Everything ``ringtrain show`` displays about one run.

    Attributes:
        summary: The same summary :func:`list_runs` gives for the run.
        config: The parsed ``config.json``, or None if missing or unreadable.
        result: The parsed ``result.json``, or None if missing or unreadable.
        rounds: Rank 0's metrics per report round, sorted by round. When a round was reported
            more than once (a restarted run), the latest report wins.
        rank_metrics: Each rank's last report, keyed by rank.
        checkpoints: The run's complete checkpoints, sorted by round.
        failures: Worker failures, in the order they happened.
        resizes: Elastic runs: resizes in place and fallbacks to a restart from disk, in file
            order (empty for other runs).
        world_sizes: The world size over time: one entry per group start and per resize.
        corruption: Silent data corruption: one line per ``replica_mismatch`` event, in file
            order (docs/fault-tolerance.md, "Silent data corruption").
        spares: Hot spares (``ScalingConfig.spares``): one line per spare that took a rank or
            was lost before it served, in file order.
        skipped_event_lines: Lines of ``events.jsonl`` that could not be parsed (usually a last
            line still being written) and were ignored.
    """

    summary: RunSummary
    config: dict[str, Any] | None
    result: dict[str, Any] | None
    rounds: list[RoundMetrics] = field(default_factory=list)
    rank_metrics: dict[int, RoundMetrics] = field(default_factory=dict)
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    failures: list[FailureInfo] = field(default_factory=list)
    resizes: list[ResizeInfo] = field(default_factory=list)
    world_sizes: list[WorldSizeChange] = field(default_factory=list)
    corruption: list[str] = field(default_factory=list)
    spares: list[str] = field(default_factory=list)
    skipped_event_lines: int = 0
