"""The controller's outputs: the :class:`~ringtrain.result.Result` and ``result.json`` (a
:class:`~ringtrain.rundir.run_records.ResultRecord`), built from a :class:`RunBook`: the run's
results so far, which the controller owns and fills as it executes its deciders' effects."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.result import Result, TrainingFailedError, WorkerFailure
from ringtrain.rundir.run_records import ResultRecord


@dataclass
class RunBook:
    """What a run has produced so far (owned by the controller).

    Attributes:
        metrics_per_rank: rank -> the metrics of its latest ``report()``.
        history: round -> the round's metrics (rank 0's), for every completed round.
        failures: the failures that stopped or resized a worker group, in order.
        follow_on_failures: the other ranks' failures those caused (:mod:`ringtrain.result`).
        error: what ``Trainer.fit`` raises once the failure policy gave up.
        start_time: when the run started (Unix seconds).
        caught: rank -> how often a replica check caught it with corrupted state.
        suspected: rank -> how often it was one of two suspects never told apart.
        outer_steps: DiLoCo's outer steps so far, from rank 0's latest timing window
            (``None``: no window carried one).
    """

    metrics_per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    history: dict[int, dict[str, Any]] = field(default_factory=dict)
    failures: list[WorkerFailure] = field(default_factory=list)
    follow_on_failures: list[WorkerFailure] = field(default_factory=list)
    error: TrainingFailedError | None = None
    start_time: float = field(default_factory=time.time)
    caught: Counter[int] = field(default_factory=Counter)
    suspected: Counter[int] = field(default_factory=Counter)
    outer_steps: int | None = None


def build_result(
    book: RunBook, checkpoints: CheckpointManager, *, uri: str, status: str, preemptions: int
) -> Result:
    """What ``Trainer.fit`` returns. ``status``: the run's state kind, or ``"RUNNING"`` while it
    is not terminal; ``preemptions``: the notices the run acted on."""
    best = [(t.checkpoint, t.metrics) for t in checkpoints.ranked()]
    latest = checkpoints.latest
    return Result(
        metrics=dict(book.metrics_per_rank.get(0, {})),
        metrics_per_rank={r: dict(m) for r, m in sorted(book.metrics_per_rank.items())},
        checkpoint=latest.checkpoint if latest else None,
        best_checkpoints=best,
        path=uri,
        error=book.error,
        failures=list(book.failures),
        follow_on_failures=list(book.follow_on_failures),
        metrics_history=[book.history[r] for r in sorted(book.history)],
        status=status,
        preemptions=preemptions,
        outer_steps=book.outer_steps,
    )


def result_record(
    result: Result,
    book: RunBook,
    *,
    name: str,
    world_size: int,
    rounds: int,
    aborted: str | None = None,
) -> ResultRecord:
    """``result.json`` for ``result`` (its ``status`` ``RUNNING`` until the run ends);
    ``aborted``: why an ``ABORTED`` run ended (:func:`aborted_because`)."""
    now = time.time()
    finished = result.status != "RUNNING"
    return ResultRecord(
        status=result.status,
        name=name,
        path=result.path,
        driver_pid=os.getpid(),
        start_time=book.start_time,
        end_time=now if finished else None,
        duration_s=now - book.start_time,
        world_size=world_size,
        rounds=rounds,
        metrics=result.metrics,
        metrics_per_rank={str(r): m for r, m in result.metrics_per_rank.items()},
        checkpoint=result.checkpoint.uri if result.checkpoint else None,
        best_checkpoints=[{"path": c.uri, "metrics": m} for c, m in result.best_checkpoints],
        error=str(book.error) if book.error else aborted,
        failures=[f.to_dict() for f in book.failures],
        follow_on_failures=[f.to_dict() for f in book.follow_on_failures],
        preemptions=result.preemptions,
        outer_steps=result.outer_steps,
    )


_ABORT_REASONS = {
    "KeyboardInterrupt": "interrupted by Ctrl-C",
    "DriverTerminated": "the driver received SIGTERM",
}


def aborted_because(state: Any) -> str | None:
    """Why an ``ABORTED`` run ended, for ``ringtrain ls`` (which otherwise says "driver gone",
    the reason of a run whose driver died without a word)."""
    reason = getattr(state, "reason", None) if state.kind.value == "ABORTED" else None
    if not reason:
        return None
    return _ABORT_REASONS.get(reason, f"the driver raised {reason}")


def call_callbacks(callbacks: Sequence[Any], hook: str, *args: Any) -> None:
    """Call ``hook(*args)`` on every callback that defines it; one that raises is logged and
    the run continues."""
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception:
            logging.getLogger("ringtrain").exception(
                "callback %s.%s raised; the run continues", type(cb).__name__, hook
            )
