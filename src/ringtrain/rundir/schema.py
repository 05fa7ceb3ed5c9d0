"""The run directory's schema: its file names and one frozen dataclass per ``events.jsonl`` event
kind (docs/run-directory.md); the ``config.json`` and ``result.json`` records are in
:mod:`ringtrain.rundir.run_records`.

Every record turns into the JSON object written today with :meth:`Record.to_json` (same keys, same
order) and back with :meth:`Record.from_json`, which is lenient: a field that is missing or of the
wrong type in an older run's file takes its default (most fields default to None), and only a
record missing a field it cannot do without (a report's ``rank``, say) is refused (None). Event
kinds this version does not know are skipped by :func:`parse_event`, so an older ``ringtrain``
reads a newer run.

No torch here: the driver, ``ringtrain ls``/``show``, the dashboard and sweeps import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from time import time as _now
from typing import Any, ClassVar

from ringtrain.rundir.record import Record

__all__ = [
    "CONFIG_FILE",
    "EVENTS_FILE",
    "EVENT_TYPES",
    "MANIFEST_FILE",
    "METRICS_CSV_FILE",
    "PAYLOAD_FILE",
    "RESULT_FILE",
    "RUN_FILES",
    "TENSORBOARD_DIR",
    "TERMINAL_STATUSES",
    "TIMING_CSV_FILE",
    "CheckpointDeletedEvent",
    "CheckpointEvent",
    "CheckpointFailedEvent",
    "CheckpointInvalidEvent",
    "ColdStartEvent",
    "DecisionEvent",
    "EventRecord",
    "FailureEvent",
    "GrowFailedEvent",
    "GrowStartEvent",
    "PreemptionEvent",
    "PreemptionIncompleteEvent",
    "PreemptionSavedEvent",
    "Record",
    "ReplicaMismatchEvent",
    "ReportEvent",
    "ResizeEvent",
    "ResizeFallbackEvent",
    "ResumeEvent",
    "RunEndEvent",
    "RunStartEvent",
    "SpareEvent",
    "StopRequestedEvent",
    "StragglerClearedEvent",
    "StragglerEvent",
    "TimingEvent",
    "TransitionEvent",
    "parse_event",
]

# ------------------------------------------------------------------------------ file names
CONFIG_FILE = "config.json"
"""The resolved configuration, written before any worker starts
(:class:`~ringtrain.rundir.run_records.ConfigRecord`)."""
PAYLOAD_FILE = "payload.pkl"
"""The pickled train function and its config, for ``Trainer.restore``."""
EVENTS_FILE = "events.jsonl"
"""One JSON object per line (an :class:`EventRecord`), appended as the run goes."""
RESULT_FILE = "result.json"
"""The outcome (:class:`~ringtrain.rundir.run_records.ResultRecord`), rewritten at start (status
RUNNING) and at the end."""
MANIFEST_FILE = "manifest.json"
"""In each ``checkpoint_NNNNNN/``: the checkpoint's files, sizes and checksums."""
METRICS_CSV_FILE = "metrics.csv"
"""One row per completed round, rank 0's metrics (``MonitorConfig.csv``)."""
TIMING_CSV_FILE = "timing.csv"
"""One row per timing window of each rank (``MonitorConfig.csv``)."""
TENSORBOARD_DIR = "tensorboard"
"""TensorBoard event files (``MonitorConfig.tensorboard``)."""
RUN_FILES = frozenset({CONFIG_FILE, EVENTS_FILE, RESULT_FILE})
"""A directory holding any of these is a run directory."""
TERMINAL_STATUSES = frozenset({"FINISHED", "ERRORED", "ABORTED", "STOPPED", "PREEMPTED"})
"""Statuses a run can end with; ``RUNNING`` and ``UNKNOWN`` (no readable result) are the others."""

# ------------------------------------------------------------------------------ events


@dataclass(frozen=True, kw_only=True)
class EventRecord(Record):
    """One line of ``events.jsonl``: ``{"type": KIND, "time": ..., **fields}``.

    Attributes:
        time: When it happened, Unix time in seconds (now, unless given); None when read from a
            line without one.
    """

    KIND: ClassVar[str] = ""
    time: float | None = field(default_factory=_now)

    def to_json(self) -> dict[str, Any]:
        return {"type": self.KIND, **super().to_json()}


@dataclass(frozen=True, kw_only=True)
class RunStartEvent(EventRecord):
    """A worker group was started: ``world_size`` workers, restart ``attempt`` (0: the first)."""

    KIND: ClassVar[str] = "run_start"
    world_size: int | None = None
    attempt: int | None = None


@dataclass(frozen=True, kw_only=True)
class ReportEvent(EventRecord):
    """One ``report()`` of one rank: ``round`` (0-based index of its report calls), its
    ``metrics``, and ``checkpoint`` (bool: this rank attached files)."""

    KIND: ClassVar[str] = "report"
    rank: int
    round: int
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint: bool = False


@dataclass(frozen=True, kw_only=True)
class TimingEvent(EventRecord):
    """A window of step timings of ``rank`` in ``attempt``. The ``window``'s fields (``steps``,
    ``step``, ``step_s``, ..., docs/monitoring.md) are written at the top level of the line;
    a reader also accepts them nested under ``"window"``."""

    KIND: ClassVar[str] = "timing"
    rank: int
    attempt: int | None = None
    window: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        head = {"type": self.KIND, "time": self.time, "rank": self.rank, "attempt": self.attempt}
        return head | {k: v for k, v in self.window.items() if k not in _TIMING_KEYS}

    @classmethod
    def _values(cls, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        values = super()._values(obj)
        if values is not None:
            nested = obj.get("window")
            source = nested if isinstance(nested, dict) else obj
            values["window"] = {k: v for k, v in source.items() if k not in _TIMING_KEYS}
        return values


_TIMING_KEYS = frozenset({"type", "time", "rank", "attempt", "window"})


@dataclass(frozen=True, kw_only=True)
class StragglerEvent(EventRecord):
    """``rank`` was flagged as a straggler: ``busy_s`` against the other ranks' ``median_s``
    (seconds per step), ``ratio``, ``reason`` (``data`` / ``compute`` / ``optimizer`` /
    ``other``), ``message``."""

    KIND: ClassVar[str] = "straggler"
    rank: int
    attempt: int | None = None
    busy_s: float | None = None
    median_s: float | None = None
    ratio: float | None = None
    reason: str | None = None
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class StragglerClearedEvent(EventRecord):
    """``rank`` is no longer a straggler."""

    KIND: ClassVar[str] = "straggler_cleared"
    rank: int
    attempt: int | None = None
    message: str | None = None


@dataclass(frozen=True, kw_only=True)
class FailureEvent(EventRecord):
    """A worker failed: ``kind`` (``exception`` / ``signal`` / ``exit`` / ``hang`` /
    ``unreachable``: unheard and its host silent, a partition or a lost host), ``message``,
    ``traceback`` (or None), ``attempt``, ``follow_on`` (a peer's error caused by another
    rank's failure, counted apart)."""

    KIND: ClassVar[str] = "failure"
    rank: int | None = None
    kind: str | None = None
    message: str | None = None
    traceback: str | None = None
    attempt: int | None = None
    follow_on: bool = False


@dataclass(frozen=True, kw_only=True)
class DecisionEvent(EventRecord):
    """The FailurePolicy's ``decision`` (``restart`` / ``raise``) and its ``reason``."""

    KIND: ClassVar[str] = "decision"
    decision: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class TransitionEvent(EventRecord):
    """The controller's state machine went ``from_`` (JSON key ``from``) ``to`` another state
    (``STARTING``, ``RUNNING``, ``GROWING``, ``LEAVING``, ``RESIZING``, ``RESTARTING``,
    ``PREEMPTING``, ``FINISHED``, ``ERRORED``, ``ABORTED``, ``STOPPED``, ``PREEMPTED``), for
    ``reason``."""

    KIND: ClassVar[str] = "transition"
    from_: str | None = field(default=None, metadata={"key": "from"})
    to: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class StopRequestedEvent(EventRecord):
    """The run was asked to stop early after ``round`` (the last round every rank reported)."""

    KIND: ClassVar[str] = "stop_requested"
    round: int | None = None


@dataclass(frozen=True, kw_only=True)
class ResumeEvent(EventRecord):
    """Restart ``attempt``'s workers restore ``checkpoint`` (its URI)."""

    KIND: ClassVar[str] = "resume"
    attempt: int | None = None
    checkpoint: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunEndEvent(EventRecord):
    """The driver ended the run with ``status`` after ``duration_s`` seconds."""

    KIND: ClassVar[str] = "run_end"
    status: str | None = None
    duration_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointEvent(EventRecord):
    """The checkpoint of ``round`` was published as ``path`` (directory name, e.g.
    ``checkpoint_000002``), with rank 0's ``metrics`` of that round."""

    KIND: ClassVar[str] = "checkpoint"
    round: int | None = None
    path: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class CheckpointDeletedEvent(EventRecord):
    """Retention deleted checkpoint ``path``, for ``reason``."""

    KIND: ClassVar[str] = "checkpoint_deleted"
    path: str | None = None
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class CheckpointFailedEvent(EventRecord):
    """The checkpoint of ``round`` was not saved: ``errors``, one line per rank that failed."""

    KIND: ClassVar[str] = "checkpoint_failed"
    round: int | None = None
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class CheckpointInvalidEvent(EventRecord):
    """A checkpoint failed verification (or could not be loaded on ``rank``) and was set aside:
    ``checkpoint`` (its directory name), ``set_aside_as`` (its new name), ``resumed_from`` (the
    checkpoint the run resumes from instead; None: from step 0, only with
    ``CheckpointConfig.from_scratch_if_invalid``), and ``reason`` (all of it in one sentence).
    ``rank`` only when a worker refused it."""

    KIND: ClassVar[str] = "checkpoint_invalid"
    reason: str | None = None
    rank: int | None = field(default=None, metadata={"omit_none": True})
    checkpoint: str | None = None
    set_aside_as: str | None = None
    resumed_from: str | None = None


@dataclass(frozen=True, kw_only=True)
class ResizeEvent(EventRecord):
    """Elastic runs: the group shrank or grew in place (docs/elastic.md): ``old_world_size`` ->
    ``new_world_size`` because of ``cause``; ``generation``, ``snapshot_step`` resumed from,
    ``steps_rolled_back``, ``failure_time`` (Unix time of the death, or when the grow's
    workers were started), ``resume_s`` (to the first completed step; None if none), and for a
    grow ``paused_s`` (seconds the members were out of the train function); ``spare_ranks``: the
    ranks hot spares took (``ScalingConfig.spares``; absent when none did)."""

    KIND: ClassVar[str] = "resize"
    old_world_size: int | None = None
    new_world_size: int | None = None
    cause: str | None = None
    generation: int | None = None
    snapshot_step: int | None = None
    steps_rolled_back: int | None = None
    failure_time: float | None = None
    resume_s: float | None = None
    paused_s: float | None = field(default=None, metadata={"omit_none": True})
    spare_ranks: list[int] | None = field(default=None, metadata={"omit_none": True})


@dataclass(frozen=True, kw_only=True)
class ResizeFallbackEvent(EventRecord):
    """Elastic runs: the group was restarted from the disk checkpoint instead, for ``reason``."""

    KIND: ClassVar[str] = "resize_fallback"
    reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class GrowStartEvent(EventRecord):
    """Elastic runs: ``ranks`` were started to grow the group of ``old_world_size`` back."""

    KIND: ClassVar[str] = "grow_start"
    old_world_size: int | None = None
    ranks: list[int] = field(default_factory=list)
    generation: int | None = None


@dataclass(frozen=True, kw_only=True)
class GrowFailedEvent(EventRecord):
    """Elastic runs: a grow was given up for ``reason``; ``ranks`` stopped; next try in
    ``retry_s`` seconds."""

    KIND: ClassVar[str] = "grow_failed"
    reason: str | None = None
    ranks: list[int] = field(default_factory=list)
    retry_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class SpareEvent(EventRecord):
    """Hot spares (``ScalingConfig.spares``): spare ``spare`` (its id, >= the world size) was
    ``"started"`` (process ``pid``), became ``"ready"`` (imported, warmed up, connected;
    ``ready_s`` after its start), ``"promoted"`` (took rank ``rank``) or was ``"lost"`` before
    it served (``reason``; the next one starts after ``retry_s`` seconds)."""

    KIND: ClassVar[str] = "spare"
    action: str | None = None
    spare: int | None = None
    rank: int | None = field(default=None, metadata={"omit_none": True})
    pid: int | None = field(default=None, metadata={"omit_none": True})
    ready_s: float | None = field(default=None, metadata={"omit_none": True})
    reason: str | None = field(default=None, metadata={"omit_none": True})
    retry_s: float | None = field(default=None, metadata={"omit_none": True})


@dataclass(frozen=True, kw_only=True)
class PreemptionEvent(EventRecord):
    """A preemption notice was received: from ``source`` (``signal``, ``callable``, ``file``,
    ``worker-signal``...) for ``reason``; the workers get ``grace_s`` seconds; ``ranks`` it
    covers (None: all)."""

    KIND: ClassVar[str] = "preemption"
    source: str | None = None
    reason: str | None = None
    grace_s: float | None = None
    ranks: list[int] | None = None


@dataclass(frozen=True, kw_only=True)
class PreemptionSavedEvent(EventRecord):
    """Every worker stopped after TrainState step ``step`` and saved its state as round
    ``round``'s checkpoint (``round`` None: no TrainState to save; the previous checkpoint
    stays the one to resume from); ``saved_s``: seconds from the notice to the last exit."""

    KIND: ClassVar[str] = "preemption_saved"
    step: int | None = None
    round: int | None = None
    saved_s: float | None = None


@dataclass(frozen=True, kw_only=True)
class PreemptionIncompleteEvent(EventRecord):
    """The preemption deadline passed (or the group could not be asked) before every worker
    saved: ``reason`` says what was not written; the group was killed and the previous
    checkpoint (``checkpoint``, None: none) is what a resume uses."""

    KIND: ClassVar[str] = "preemption_incomplete"
    reason: str | None = None
    checkpoint: str | None = None


@dataclass(frozen=True, kw_only=True)
class ReplicaMismatchEvent(EventRecord):
    """Silent data corruption: a replica check (``check``: ``"replica"``; ``"replay"``: a
    recomputed step) at ``step`` found ``ranks`` (on ``hosts``) holding other bits than their
    replicas; ``named``: they are the culprits (a majority said so, or the re-run did), else
    suspects of whom one is. ``action``: ``"rollback"`` (to the newest checkpoint that passed a
    check), ``"exclude"`` (restarted without a rank caught twice), ``"fail"``, or ``"named"``
    (the re-run named the culprit of an earlier rollback). ``fingerprints``: rank -> 64-bit
    fingerprint (hex) at that check."""

    KIND: ClassVar[str] = "replica_mismatch"
    step: int | None = None
    check: str | None = None
    ranks: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    action: str | None = None
    named: bool | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ColdStartEvent(EventRecord):
    """Workers start cold (``python -m``, a fresh interpreter) although the warm worker pool
    was asked for (``ScalingConfig.warm_start``): ``reason`` says why (the zygote could not
    start, or it died). Written once per pool lost."""

    KIND: ClassVar[str] = "cold_start"
    reason: str | None = None


EVENT_TYPES: dict[str, type[EventRecord]] = {
    cls.KIND: cls
    for cls in (
        RunStartEvent,
        ReportEvent,
        CheckpointEvent,
        CheckpointDeletedEvent,
        CheckpointFailedEvent,
        CheckpointInvalidEvent,
        ResumeEvent,
        FailureEvent,
        DecisionEvent,
        TimingEvent,
        StragglerEvent,
        StragglerClearedEvent,
        ResizeEvent,
        GrowStartEvent,
        GrowFailedEvent,
        ResizeFallbackEvent,
        SpareEvent,
        TransitionEvent,
        StopRequestedEvent,
        PreemptionEvent,
        PreemptionSavedEvent,
        PreemptionIncompleteEvent,
        ReplicaMismatchEvent,
        ColdStartEvent,
        RunEndEvent,
    )
}
"""Every event kind the driver writes, by its ``type``, in the order docs/run-directory.md
lists them."""


def parse_event(obj: Mapping[str, Any]) -> EventRecord | None:
    """The typed record of one parsed ``events.jsonl`` line; None for a kind this version does
    not know (a newer ringtrain's) or a line missing a field its kind cannot do without."""
    cls = EVENT_TYPES.get(obj.get("type"))  # type: ignore[arg-type]
    return None if cls is None else cls.from_json(obj)


# ------------------------------------------------------------------------------ config, result
