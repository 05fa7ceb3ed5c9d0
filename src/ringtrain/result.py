"""What a run returns: :class:`Result`, :class:`WorkerFailure`, :class:`TrainingFailedError`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ringtrain.checkpoint.checkpoint import Checkpoint

PEER_ERROR = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"failed to recv|Connection timed out|Socket Timeout|NCCL communicator was aborted|"
    r"DistBackendError|DistNetworkError|ProcessGroupGloo|Gloo|remote process exited",
    re.IGNORECASE,
)
"""Errors a rank raises because a *peer* died: never the root cause when another failure
exists."""


@dataclass(frozen=True)
class WorkerFailure:
    """One worker's failure.

    Attributes:
        rank: the failed worker's rank.
        kind: ``"exception"`` (the train function raised), ``"signal"`` (killed by a signal),
            ``"exit"`` (exited with a non-zero status without raising), ``"hang"`` (no progress
            within ``FailureConfig.worker_timeout_s``).
        message: one line, e.g. ``"rank 1 was killed by SIGKILL"``.
        exc_type: the exception's type name (``kind == "exception"``).
        traceback: the worker's formatted traceback (``kind == "exception"``).
        returncode: the process exit status (negative: the signal number), when known.
        attempt: which attempt of the run failed (0 on the first).
        round: the last report round this rank completed before failing (-1: none).
        step: the rank's last known training step (``TrainState.step``, or a reported ``"step"``
            metric), ``None`` when it never told.
        time: Unix time of the failure, seconds.
        follow_on: True for a failure that another rank's failure of the same attempt caused
            or repeats (a peer's lost connection, the same exception raised by every rank): it
            is in ``Result.follow_on_failures``, not in ``Result.failures``, and counts towards
            no ``max_failures``.
    """

    rank: int
    kind: str
    message: str
    exc_type: str | None = None
    traceback: str | None = None
    returncode: int | None = None
    attempt: int = 0
    round: int = -1
    time: float = 0.0
    step: int | None = None
    follow_on: bool = False

    @property
    def peer_error(self) -> bool:
        """The rank raised because a peer died (its connection was closed or reset)."""
        return self.kind == "exception" and bool(
            PEER_ERROR.search(f"{self.exc_type} {self.message}")
        )

    def follow_on_line(self, root: WorkerFailure) -> str:
        """This follow-on failure in one line, e.g. ``"rank 0: lost its connection to rank 1
        (follow-on)"``."""
        if self.peer_error:
            what = f"lost its connection to rank {root.rank}"
        elif self.kind == "exception" and (self.exc_type, _said(self)) == (
            root.exc_type,
            _said(root),
        ):
            what = f"raised the same {self.exc_type}"
        else:
            what = self.message.removeprefix(f"rank {self.rank} ")
        return f"rank {self.rank}: {what} (follow-on)"

    def describe(self) -> str:
        """``message`` plus where the rank was (attempt, step)."""
        where = f" (last known step {self.step})" if self.step is not None else ""
        return f"attempt {self.attempt}: {self.message}{where}"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def is_follow_on(failure: WorkerFailure, others: list[WorkerFailure]) -> bool:
    """Whether ``failure``, arriving after ``others`` of the same attempt, is a follow-on (the
    ``follow_on`` flag of its ``failure`` event, written as it arrives): a peer error always,
    anything else once a failure that is not a peer error is already in."""
    return failure.peer_error or any(not f.peer_error for f in others)


def follow_ons(failures: list[WorkerFailure], root: WorkerFailure) -> list[WorkerFailure]:
    """An attempt's failures other than its root cause ``root``, marked ``follow_on=True``."""
    return [dataclasses.replace(f, follow_on=True) for f in failures if f is not root]


def _said(failure: WorkerFailure) -> str:
    """What the exception said, without the ``"rank N raised T: "`` prefix."""
    return failure.message.split(": ", 1)[-1]


class TrainingFailedError(RuntimeError):
    """A run stopped because a worker failed (and the FailureConfig allowed no more restarts).

    Its message is the root cause once: the failing rank's message, one line per follow-on
    failure of the last attempt ("rank 0: lost its connection to rank 1 (follow-on)"), the root
    causes of earlier attempts, then the failing rank's own traceback.

    Attributes:
        failures: the root cause of each failed attempt, first first; ``failures[-1]`` stopped
            the run.
        follow_on: the other failures those caused (``WorkerFailure.follow_on``).
        rank: the rank whose failure stopped the run.
        traceback: that worker's traceback, when it raised.
    """

    def __init__(
        self, failures: list[WorkerFailure], follow_on: list[WorkerFailure] | None = None
    ) -> None:
        self.failures = list(failures)
        self.follow_on = list(follow_on or ())
        last = self.failures[-1]
        self.rank = last.rank
        self.traceback = last.traceback
        lines = [last.message]
        lines += [
            f"  {f.follow_on_line(last)}" for f in self.follow_on if f.attempt == last.attempt
        ]
        if len(self.failures) > 1:
            lines.append(f"failures ({len(self.failures)}):")
            lines += [f"  {f.describe()}" for f in self.failures]
        if last.traceback:
            lines += ["", f"Traceback of rank {last.rank}:", last.traceback.rstrip()]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        return (TrainingFailedError, (self.failures, self.follow_on))


@dataclass
class Result:
    """The outcome of ``Trainer.fit()``.

    Attributes:
        metrics: the last metrics reported by rank 0.
        metrics_per_rank: rank -> the last metrics that rank reported.
        checkpoint: the latest complete checkpoint, or ``None``.
        best_checkpoints: ``[(checkpoint, metrics)]`` of the kept checkpoints, best first by
            ``CheckpointConfig.checkpoint_score_attribute`` (newest first without one).
        path: the run directory.
        error: the ``TrainingFailedError`` when the run failed and ``fit(raise_on_error=False)``.
        failures: the root cause of every failed attempt, including those a restart recovered
            from (one per attempt: what ``FailureConfig.max_failures`` counts).
        follow_on_failures: the other ranks' failures those caused (lost connections, the same
            exception on every rank), each with ``follow_on=True``; counted apart.
        metrics_history: rank 0's metrics of every round, in order.
        config: the ``train_loop_config`` the run was given (a sweep trial's hyperparameters;
            ``None`` when it had none).
        status: how the run ended: ``"FINISHED"``, ``"ERRORED"`` (with
            ``fit(raise_on_error=False)``), ``"STOPPED"`` (stopped early on request) or
            ``"PREEMPTED"`` (a preemption notice: every worker saved its state at one agreed
            step; running it again with the same name resumes from there);
            ``"RUNNING"`` while the run goes on (a sweep trial read back from a run directory
            without ``result.json``: ``"UNKNOWN"``).
        preemptions: the preemption notices this run handled (never counted in ``failures``
            nor against ``FailureConfig.max_failures``).
        outer_steps: for a model prepared with ``parallel_strategy="diloco"``, the outer steps
            applied (rank 0's count, the same on every replica), from the start of the run: a
            resumed run counts those before the resume too (the count is in the checkpoint).
            One per fragment exchange (``OuterSync.outer_steps``): ``steps // sync_every``
            without fragments, about ``fragments`` times that with streaming DiLoCo. ``None``
            for a run that is not DiLoCo, or that times nothing
            (``MonitorConfig(timing=False)``: the count travels in the timing windows).
    """

    metrics: dict[str, Any] = field(default_factory=dict)
    metrics_per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    path: str | None = None
    error: TrainingFailedError | None = None
    failures: list[WorkerFailure] = field(default_factory=list)
    follow_on_failures: list[WorkerFailure] = field(default_factory=list)
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    status: str = "FINISHED"
    preemptions: int = 0
    outer_steps: int | None = None
