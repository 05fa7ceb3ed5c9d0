"""Folding a run's ``events.jsonl`` records into what ``ringtrain show`` and the dashboard need:
rounds, each rank's last report, failures, an elastic run's resizes and world size over time.
Dispatches on the record types of :mod:`ringtrain.rundir.schema`. Re-exported from
:mod:`ringtrain.monitor.runs`."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringtrain.monitor.records import FailureInfo, ResizeInfo, RoundMetrics, WorldSizeChange
from ringtrain.rundir.run_records import ResultRecord
from ringtrain.rundir.schema import (
    EventRecord,
    FailureEvent,
    ReplicaMismatchEvent,
    ReportEvent,
    ResizeEvent,
    ResizeFallbackEvent,
    RunEndEvent,
    RunStartEvent,
    SpareEvent,
    parse_event,
)

__all__ = ["EventDigest", "departed_ranks", "elastic_history", "failure_info", "result_failures"]


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


def _failures_of(result: ResultRecord) -> list[FailureInfo]:
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
    corruption: list[str] = field(default_factory=list)
    spares: list[str] = field(default_factory=list)
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
            case ReplicaMismatchEvent():
                self.corruption.append(corruption_line(ev))
            case SpareEvent():
                line = spare_line(ev)
                if line is not None:
                    self.spares.append(line)
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
                spare_ranks=list(ev.spare_ranks) if ev.spare_ranks else None,
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


def spare_line(ev: SpareEvent) -> str | None:
    """One line for a hot spare's ``spare`` event that changed something (``promoted``:
    ``spare 3 took rank 1``; ``lost``: ``spare 4 lost: ...``); ``None`` for ``started`` and
    ``ready``."""
    if ev.action == "promoted":
        return f"spare {ev.spare} took rank {ev.rank}"
    if ev.action == "lost":
        return f"spare {ev.spare} lost: {ev.reason or 'unknown reason'}"
    return None


def corruption_line(ev: ReplicaMismatchEvent) -> str:
    """One line for a ``replica_mismatch`` event: ``step 9 (replica check): rank 2 on h -
    rollback``; suspects not told apart are said so."""
    where = ", ".join(
        f"rank {r} on {ev.hosts[i] if i < len(ev.hosts) else '?'}" for i, r in enumerate(ev.ranks)
    )
    who = where if ev.named else f"one of {where}"
    return f"step {ev.step} ({ev.check or 'replica'} check): {who} - {ev.action}"


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


def result_failures(result: Mapping[str, Any] | None) -> list[FailureInfo]:
    """The failures listed in a parsed ``result.json`` (for runs whose events have none)."""
    record = ResultRecord.from_json(result) if result is not None else None
    return [] if record is None else _failures_of(record)
