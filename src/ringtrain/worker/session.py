"""The worker side: ``get_context()``, ``report()``, ``get_checkpoint()``.

A worker process has exactly one :class:`Session`, installed by the worker bootstrap
(``ringtrain.launch.worker``) before the train function or script runs. It is the one place this
process keeps distributed state, and it holds the worker's plug-ins (elastic training, step timing,
precision: :mod:`ringtrain.worker.hooks`); the slot below is the only module-level state of the
worker side (the public functions of this module read it: they have no session argument to be
given), and tests reset it with :func:`_reset_session`. A process that ringtrain did not start (a
plain ``python`` run, torchrun, SLURM) gets a session built lazily from its environment: reports are
then kept in memory, and the process group is initialised on first need.
"""

from __future__ import annotations

import inspect
import logging
import numbers
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from ringtrain.checkpoint import storage
from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.cluster.env import DistributedContext, context_from_env
from ringtrain.wire.channel import CheckpointDone, Heartbeat, Report, WorkerChannel
from ringtrain.wire.worker_config import WorkerConfig
from ringtrain.worker.hooks import HookRegistry, StepState

logger = logging.getLogger("ringtrain")

M = TypeVar("M")


@dataclass
class Session:
    """One worker's view of the run.

    Attributes:
        context: rank, world size, device and the rest.
        channel: the connection to the driver, or ``None`` outside a ringtrain-launched worker.
        next_round: index of the next ``report()`` call.
        latest_checkpoint: the checkpoint to resume from (``None`` on a fresh run).
        reports: the reports of this rank, kept in memory when there is no driver.
        async_checkpoint: write TrainState checkpoints on a background thread after staging
            them to host memory (``CheckpointConfig.async_save``).
        last_progress: ``time.monotonic()`` of the last sign of progress (a batch from a
            prepared loader, a step, a report); what the heartbeat tells the driver.
        beat_interval_s: the longest interval between two heartbeats a plug-in asked for
            (:meth:`beat_at_least_every`; seconds, ``None``: no plug-in asked).
        hooks: this worker's plug-ins (:mod:`ringtrain.worker.hooks`): elastic, timing, precision...
    """

    context: DistributedContext
    channel: WorkerChannel | None = None
    next_round: int = 0
    latest_checkpoint: Checkpoint | None = None
    reports: list[Report] = field(default_factory=list)
    last_metrics: dict[str, Any] = field(default_factory=dict)
    async_checkpoint: bool = False
    last_progress: float = field(default_factory=time.monotonic)
    last_step: int | None = None
    progressed: bool = False
    progress_count: int = 0
    warned_no_storage: bool = False
    beat_interval_s: float | None = None
    hooks: HookRegistry = field(default_factory=HookRegistry)
    # Driver messages read from the channel and not yet taken (poll_driver/take_messages).
    inbox: list[Any] = field(default_factory=list)
    _writer: Any = None
    _run_fs: Any = None
    _run_path: str | None = None

    @property
    def worker_config(self) -> WorkerConfig:
        """What the driver told this worker (``Start``'s :class:`WorkerConfig`; the defaults
        outside a ringtrain-launched worker)."""
        return self.context.config

    def poll_driver(self) -> None:
        """Move the driver messages waiting on the channel into :attr:`inbox`, without blocking.
        The one reader of driver messages on a worker (the training thread only): plug-ins take
        their kinds with :meth:`take_messages` (preemption requests, elastic grow requests)."""
        channel = self.channel
        if channel is None:
            return
        while channel.conn.poll(0):
            self.inbox.append(channel.recv())

    def take_messages(self, kind: type[M]) -> list[M]:
        """Remove and return the :attr:`inbox` messages of type ``kind``, oldest first."""
        if not self.inbox:
            return []
        taken = [m for m in self.inbox if isinstance(m, kind)]
        if taken:
            self.inbox = [m for m in self.inbox if not isinstance(m, kind)]
        return taken

    def beat_at_least_every(self, interval_s: float) -> None:
        """Ask the heartbeat thread to beat at least every ``interval_s`` seconds (a plug-in
        that sends from ``on_heartbeat``, e.g. the timing windows); call it before
        :meth:`start_heartbeat`."""
        if self.beat_interval_s is None or interval_s < self.beat_interval_s:
            self.beat_interval_s = interval_s

    def start_heartbeat(self, interval_s: float) -> None:
        """Every ``interval_s`` seconds (or the shorter interval a plug-in asked for), tell the
        driver how long ago this rank last made progress, after the plug-ins' ``on_heartbeat``
        hooks. The driver, not the worker, decides when that is too long: a worker stuck in a
        collective or in C code still answers from this thread, and a frozen one goes silent."""
        channel = self.channel
        if channel is None:
            return
        if self.beat_interval_s is not None:
            interval_s = min(interval_s, self.beat_interval_s)

        def beat() -> None:
            while True:
                time.sleep(interval_s)
                # None until the first progress: start-up (imports, data loading, restoring a
                # checkpoint) is not a hang, however long it takes.
                age = time.monotonic() - self.last_progress if self.progressed else None
                try:
                    self.hooks.on_heartbeat()
                    channel.send(
                        Heartbeat(
                            rank=self.context.world_rank,  # changes on an elastic resize
                            time=time.time(),
                            progress_age_s=age,
                            step=self.last_step,
                            progress_count=self.progress_count,
                        )
                    )
                except (OSError, ValueError):
                    return

        threading.Thread(target=beat, name="ringtrain-heartbeat", daemon=True).start()

    def wait_for_checkpoint(self, timeout_s: float | None = None) -> None:
        """Block until the checkpoint being written in the background (if any) is on storage,
        or ``timeout_s`` seconds have passed."""
        if self._writer is not None:
            self._writer.wait(timeout_s)

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


def install_session(session: Session) -> None:
    """Make ``session`` this process's session (the worker bootstrap does, before the train
    function runs; an integration that builds its own context may too)."""
    global _session
    with _session_lock:
        _session = session


_install_session = install_session  # the name tests used


def _reset_session() -> None:
    global _session
    with _session_lock:
        _session = None


def note_epoch(epoch: int, num_epochs: int, loader: Any = None) -> None:
    """Training enters ``epoch`` (0-based) of ``num_epochs`` (``TrainState.epochs`` calls it):
    the plug-ins' ``on_epoch`` hooks run, with the loader's length as the epoch's steps (the
    timing plug-in sends it with its next window, from which the driver draws its progress bar
    and ETA)."""
    try:
        steps: int | None = len(loader)
    except TypeError:
        steps = None
    current_hooks().on_epoch(int(epoch), int(num_epochs), steps)


def current_session() -> Session:
    """This process's session, built from the environment on first use."""
    global _session
    with _session_lock:
        if _session is None:
            ctx = context_from_env()
            start = ctx.config.start_round
            _session = Session(context=ctx, next_round=start)
        return _session


def installed_session() -> Session | None:
    """This process's session if one is installed or was built, else None (never builds one:
    cheap enough for every batch and step, and what plug-ins use to find theirs)."""
    return _session


def current_hooks() -> HookRegistry:
    """This process's hook registry (:mod:`ringtrain.worker.hooks`), building the session on
    first use."""
    return current_session().hooks


def step_taken(state: StepState) -> None:
    """``TrainState.step`` was set: record the progress and run the step hooks
    (:meth:`ringtrain.worker.hooks.WorkerPlugin.on_step`). Nothing outside a session's process."""
    session = _session
    if session is None:
        return
    mark_progress(state.step)
    session.hooks.on_step(state)


def takes_config(train_fn: Callable[..., object]) -> bool:
    """Whether ``train_fn`` is called as ``train_fn(config)`` (it has a positional parameter)
    rather than ``train_fn()``; a callable without a signature is given the config."""
    try:
        params = inspect.signature(train_fn).parameters.values()
    except (TypeError, ValueError):
        return True
    positional = [
        p
        for p in params
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return bool(positional)


def call_train_fn(train_fn: Callable[..., object], config: Mapping[str, Any] | None) -> None:
    """Call the user's train function once, the one way every runner does (the worker
    bootstrap, the elastic runner, an in-process ``fit()``, chaos runs): ``train_fn(config)``
    (``{}`` when ``config`` is None) if it takes a positional parameter, else ``train_fn()``.
    Its return value is ignored; what it raises propagates."""
    if takes_config(train_fn):
        train_fn(config if config is not None else {})
    else:
        train_fn()


def mark_progress(step: int | None = None) -> None:
    """Record that this worker is making progress (called per batch and per step; cheap)."""
    session = _session
    if session is not None:
        session.last_progress = time.monotonic()
        session.progressed = True
        session.progress_count += 1
        if step is not None:
            session.last_step = step


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


@runtime_checkable
class SavesCheckpoint(Protocol):
    """What ``report(checkpoint=...)`` saves besides a :class:`Checkpoint`: a
    :class:`~ringtrain.worker.state.TrainState` (a Protocol, not the class: ``state`` imports this
    module). ``checkpoint_writers(staged)`` maps each file name to a function that writes it."""

    def checkpoint_writers(self, staged: bool) -> dict[str, Callable[[Any], None]]: ...


def report(metrics: dict[str, Any], checkpoint: Any = None) -> None:
    """Send this rank's metrics (and optionally a checkpoint) to the driver.

    Call it the same number of times on every rank: the driver matches the n-th call of every
    rank into round n. The metrics of every rank reach the driver (``Result.metrics_per_rank``);
    rank 0's are the run's metrics (``Result.metrics``). When every rank's part of a round's
    checkpoint is on storage, the driver publishes it atomically (manifest with sizes and SHA-256,
    then rename); a round whose write failed is reported and skipped, and training goes on.

    Args:
        metrics: metric name -> value; 0-d tensors and NumPy scalars become Python numbers.
            Values should be JSON-serialisable (others are logged as their ``repr``).
        checkpoint: a :class:`ringtrain.TrainState` (rank 0 writes the shared state once, every
            rank its RNG and data position; with ``CheckpointConfig(async_save=True)``, the
            default, the state is staged to host memory and written on a background thread, so
            ``report`` returns before the files are on storage), or a :class:`Checkpoint` of a
            directory of files (copied before ``report`` returns: the directory may be deleted
            right after; all ranks' files land in one ``checkpoint_NNNNNN``, so ranks must use
            distinct file names). Pass it on every rank.

    Raises:
        TypeError: if ``metrics`` is not a dict with str keys, or ``checkpoint`` is neither a
            ``TrainState`` nor a ``Checkpoint``.
    """
    session = current_session()
    clean = _clean_metrics(metrics)
    round_ = session.next_round
    files = None
    error = None
    pending = False
    if checkpoint is not None:
        _check_fence(session)
        if isinstance(checkpoint, Checkpoint):
            files, error = _write_checkpoint(session, round_, directory=checkpoint)
        elif isinstance(checkpoint, SavesCheckpoint):
            files, error, pending = _save_state(session, round_, checkpoint)
        else:
            raise TypeError(
                "report(checkpoint=...) must be a ringtrain.TrainState or a ringtrain.Checkpoint "
                "(Checkpoint.from_directory(path)), got " + type(checkpoint).__name__
            )
    message = Report(
        rank=session.context.world_rank,
        round=round_,
        time=time.time(),
        metrics=clean,
        checkpoint_files=files,
        checkpoint_pending=pending,
        checkpoint_error=error,
    )
    session.next_round += 1
    session.hooks.on_report(clean, round_)  # before the report: what it sends arrives first
    session.last_metrics = clean
    session.last_progress = time.monotonic()
    session.progressed = True
    if session.channel is not None:
        session.channel.send(message)
    else:
        session.reports.append(message)


def _check_fence(session: Session) -> None:
    """Raise :class:`~ringtrain.checkpoint.fence.WorkerFenced` if the driver declared this worker
    lost (a partition cut it off) or its attempt has ended: its checkpoint must not land among
    the files of the group that replaced it (checkpoint/fence.py). Asked before every checkpoint
    this rank writes, not before plain reports (those travel over the channel, which the driver
    closed)."""
    target = session.run_storage()
    if target is None or session.channel is None:
        return
    from ringtrain.checkpoint import fence

    fence.check(target[0], target[1], session.context.attempt)


def _staging_dir(session: Session, round_: int) -> tuple[Any, str] | None:
    target = session.run_storage()
    if target is None:
        return None
    fs, run_path = target
    return fs, storage.join(fs, run_path, storage.staging_dirname(round_))


def _write_checkpoint(
    session: Session,
    round_: int,
    *,
    directory: Checkpoint | None = None,
    writers: dict[str, Any] | None = None,
) -> tuple[dict[str, dict[str, Any]] | None, str | None]:
    """Write this rank's files of round ``round_``; returns ``(files, None)`` or ``(None, why)``:
    a storage failure that outlasted the retries costs this checkpoint, never the training."""
    from ringtrain.checkpoint.writer import retry, write_files

    target = _staging_dir(session, round_)
    if target is None:
        # No run directory (a plain process): nothing to publish to.
        return {}, None
    fs, dest = target
    try:
        _check_fence(session)  # again: a background write starts later than its report
        if directory is not None:
            with directory.as_directory() as local_dir:
                files = retry(
                    lambda: storage.upload_directory(local_dir, fs, dest),
                    what=f"copying checkpoint files to {dest}",
                )
        else:
            assert writers is not None
            files = write_files(fs, dest, writers)
        return files, None
    except Exception as exc:
        rank = session.context.world_rank
        why = f"{type(exc).__name__}: {exc}"
        return None, f"rank {rank} could not write its checkpoint files: {why}"


def _save_state(
    session: Session, round_: int, state: SavesCheckpoint
) -> tuple[Any, str | None, bool]:
    if session.run_storage() is None:
        if not session.warned_no_storage:
            session.warned_no_storage = True
            logger.warning(
                "report(checkpoint=TrainState): this process was not started by ringtrain, so "
                "there is no run directory and the state is not saved (run it with "
                "rt.Trainer(...).fit() or `ringtrain run`)"
            )
        return {}, None, False
    if not session.async_checkpoint or session.channel is None:
        files, error = _write_checkpoint(session, round_, writers=state.checkpoint_writers(False))
        return files, error, False
    from ringtrain.checkpoint.writer import AsyncCheckpointWriter

    if session._writer is None:
        session._writer = AsyncCheckpointWriter()
    writer = session._writer
    writer.wait()  # at most one staged copy in memory
    writers = state.checkpoint_writers(True)
    channel = session.channel
    rank = session.context.world_rank

    def job() -> None:
        from ringtrain.checkpoint.fence import WorkerFenced

        try:
            files, error = _write_checkpoint(session, round_, writers=writers)
        except WorkerFenced as fenced:  # declared lost: it stops as a killed worker would
            sys.stderr.write(f"ringtrain: rank {rank}: {fenced}; exiting\n")
            sys.stderr.flush()
            os._exit(1)
        try:
            channel.send(CheckpointDone(rank=rank, round=round_, files=files, error=error))
        except (OSError, ValueError):
            pass

    writer.submit(job)
    return None, None, True
