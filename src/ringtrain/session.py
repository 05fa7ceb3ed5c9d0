"""The worker side: ``get_context()``, ``report()``, ``get_checkpoint()``.

A worker process has exactly one :class:`Session`, installed by the worker bootstrap
(``ringtrain.launch.worker``) before the train function or script runs. It is the one place this
process keeps distributed state; the slot below is the only module-level state of the worker side,
and tests reset it with :func:`_reset_session`. A process that ringtrain did not start (a plain
``python`` run, torchrun, SLURM) gets a session built lazily from its environment: reports are then
kept in memory, and the process group is initialised on first need.
"""

from __future__ import annotations

import numbers
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ringtrain.channel import Report, WorkerChannel
from ringtrain.checkpoint import storage
from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.env import ENV_START_ROUND, DistributedContext, context_from_env


@dataclass
class Session:
    """One worker's view of the run.

    Attributes:
        context: rank, world size, device and the rest.
        channel: the connection to the driver, or ``None`` outside a ringtrain-launched worker.
        next_round: index of the next ``report()`` call.
        latest_checkpoint: the checkpoint to resume from (``None`` on a fresh run).
        reports: the reports of this rank, kept in memory when there is no driver.
    """

    context: DistributedContext
    channel: WorkerChannel | None = None
    next_round: int = 0
    latest_checkpoint: Checkpoint | None = None
    reports: list[Report] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)
    _run_fs: Any = None
    _run_path: str | None = None

    def run_storage(self) -> tuple[Any, str] | None:
        if self.context.run_dir is None:
            return None
        if self._run_fs is None:
            import fsspec

            self._run_fs, self._run_path = fsspec.core.url_to_fs(self.context.run_dir)
        assert self._run_path is not None
        return self._run_fs, self._run_path


_session: Session | None = None
_session_lock = threading.Lock()


def _install_session(session: Session) -> None:
    global _session
    with _session_lock:
        _session = session


def _reset_session() -> None:
    global _session
    with _session_lock:
        _session = None


def current_session() -> Session:
    """This process's session, built from the environment on first use."""
    global _session
    with _session_lock:
        if _session is None:
            ctx = context_from_env()
            start = int(ctx.extra.get(ENV_START_ROUND, "0") or 0)
            _session = Session(context=ctx, next_round=start)
        return _session


def get_context() -> DistributedContext:
    """Where this worker stands: ``world_rank``, ``world_size``, ``local_rank``,
    ``local_world_size``, ``node_rank``, ``device``, ``attempt``.

    Works in a worker started by ringtrain, under torchrun or SLURM, and in a plain single process
    (rank 0 of 1).
    """
    return current_session().context


def get_checkpoint() -> Checkpoint | None:
    """The latest complete checkpoint of this run (``None`` on a fresh run): what a restarted
    attempt, or a run started again with the same name, resumes from."""
    return current_session().latest_checkpoint


def _clean_metrics(metrics: Any) -> dict[str, Any]:
    if not isinstance(metrics, dict):
        raise TypeError(f"report(metrics=...) must be a dict, got {type(metrics).__name__}")
    clean: dict[str, Any] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"report(): metric names must be str, got {key!r}")
        if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
            value = value.item()  # 0-d tensor or NumPy scalar
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            value = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
        clean[key] = value
    return clean


def report(metrics: dict[str, Any], checkpoint: Checkpoint | None = None) -> None:
    """Send this rank's metrics (and optionally checkpoint files) to the driver.

    Call it the same number of times on every rank: the driver matches the n-th call of every
    rank into round n. The metrics of every rank reach the driver (``Result.metrics_per_rank``);
    rank 0's are the run's metrics (``Result.metrics``).

    Args:
        metrics: metric name -> value; 0-d tensors and NumPy scalars become Python numbers.
            Values should be JSON-serialisable (others are logged as their ``repr``).
        checkpoint: files to persist for this round. Any rank may pass one; all files of the round
            land in one checkpoint directory ``checkpoint_NNNNNN`` (so ranks must use distinct
            file names). The files are copied before ``report`` returns: the source directory may
            be deleted right after.

    Raises:
        TypeError: if ``metrics`` is not a dict with str keys, or ``checkpoint`` is not a
            ``Checkpoint``.
    """
    session = current_session()
    clean = _clean_metrics(metrics)
    round_ = session.next_round
    files = None
    if checkpoint is not None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                "report(checkpoint=...) must be a ringtrain.Checkpoint "
                "(use Checkpoint.from_directory(path)), got " + type(checkpoint).__name__
            )
        files = _upload(session, checkpoint, round_)
    message = Report(
        rank=session.context.world_rank,
        round=round_,
        time=time.time(),
        metrics=clean,
        checkpoint_files=files,
    )
    session.next_round += 1
    session.last_metrics = clean
    if session.channel is not None:
        session.channel.send(message)
    else:
        session.reports.append(message)


def _upload(session: Session, checkpoint: Checkpoint, round_: int) -> dict[str, dict[str, Any]]:
    target = session.run_storage()
    if target is None:
        # No run directory (a plain process): keep the checkpoint where it is.
        return {}
    fs, run_path = target
    dest = storage.join(fs, run_path, storage.staging_dirname(round_))
    with checkpoint.as_directory() as local_dir:
        return storage.upload_directory(local_dir, fs, dest)
