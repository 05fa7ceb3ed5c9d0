"""What a run returns: :class:`Result`, :class:`WorkerFailure`, :class:`TrainingFailedError`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringtrain.checkpoint.checkpoint import Checkpoint


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

    def describe(self) -> str:
        """``message`` plus where the rank was (attempt, step)."""
        where = f" (last known step {self.step})" if self.step is not None else ""
        return f"attempt {self.attempt}: {self.message}{where}"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class TrainingFailedError(RuntimeError):
    """A run stopped because a worker failed (and the FailureConfig allowed no more restarts).

    Attributes:
        failures: every failure of the run, first first; ``failures[-1]`` stopped it.
        rank: the rank whose failure stopped the run.
        traceback: that worker's traceback, when it raised.
    """

    def __init__(self, failures: list[WorkerFailure]) -> None:
        self.failures = list(failures)
        last = self.failures[-1]
        self.rank = last.rank
        self.traceback = last.traceback
        lines = [last.message]
        if len(self.failures) > 1:
            lines.append(f"failures ({len(self.failures)}):")
            lines += [f"  {f.describe()}" for f in self.failures]
        if last.traceback:
            lines += ["", f"Traceback of rank {last.rank}:", last.traceback.rstrip()]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        return (TrainingFailedError, (self.failures,))


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
        failures: every worker failure, including those a restart recovered from.
        metrics_history: rank 0's metrics of every round, in order.
        config: the ``train_loop_config`` the run was given (a sweep trial's hyperparameters;
            ``None`` when it had none).
    """

    metrics: dict[str, Any] = field(default_factory=dict)
    metrics_per_rank: dict[int, dict[str, Any]] = field(default_factory=dict)
    checkpoint: Checkpoint | None = None
    best_checkpoints: list[tuple[Checkpoint, dict[str, Any]]] = field(default_factory=list)
    path: str | None = None
    error: TrainingFailedError | None = None
    failures: list[WorkerFailure] = field(default_factory=list)
    metrics_history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] | None = None
