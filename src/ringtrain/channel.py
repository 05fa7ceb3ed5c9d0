"""The authenticated channel between workers and the driver, and the messages it carries.

Built on :mod:`multiprocessing.connection`: the driver listens on loopback (or on the address a
multi-node backend needs) with a per-run secret; a client must answer an HMAC challenge with that
secret before a single message is accepted, so nobody else on the host can inject reports.
Messages are small frozen dataclasses. This module imports neither torch nor the controller, so both
sides can use it.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

# ---------------------------------------------------------------- messages (worker -> driver)


@dataclass(frozen=True)
class Hello:
    rank: int
    pid: int
    hostname: str


@dataclass(frozen=True)
class Report:
    """One ``report()`` call of one rank.

    ``checkpoint_files`` maps each file the rank uploaded for this round's checkpoint (path relative
    to the checkpoint directory) to ``{"size": bytes, "sha256": hex}``; ``None`` when the rank
    attached no checkpoint, or when its files are still being written in the background
    (``checkpoint_pending``: a :class:`CheckpointDone` for this round follows).
    ``checkpoint_error``: why this rank's files could not be written (the round then has no
    checkpoint; training goes on).
    """

    rank: int
    round: int
    time: float
    metrics: dict[str, Any]
    checkpoint_files: dict[str, dict[str, Any]] | None = None
    checkpoint_pending: bool = False
    checkpoint_error: str | None = None


@dataclass(frozen=True)
class CheckpointDone:
    """A background checkpoint write of ``round`` finished: ``files`` as in
    :class:`Report`, or ``error`` when it failed after its retries."""

    rank: int
    round: int
    files: dict[str, dict[str, Any]] | None
    error: str | None = None


@dataclass(frozen=True)
class Heartbeat:
    """Sent every few seconds by a worker thread: the rank last made progress (a batch, a step, a
    report) ``progress_age_s`` seconds ago (``None``: still starting up, no progress yet);
    ``progress_count`` counts those signs. Silence means the process itself is frozen."""

    rank: int
    time: float
    progress_age_s: float | None
    step: int | None = None
    progress_count: int = 0


@dataclass(frozen=True)
class Timing:
    """A window of step timings from one rank (see :meth:`ringtrain.monitor.timing.StepTimer.
    take_window` for the fields), sent every ``MonitorConfig.timing_interval_s`` seconds and once
    more when the worker ends."""

    rank: int
    time: float
    window: dict[str, Any]


@dataclass(frozen=True)
class WorkerError:
    rank: int
    time: float
    exc_type: str
    message: str
    traceback: str


@dataclass(frozen=True)
class Done:
    rank: int
    time: float
    rounds: int


@dataclass(frozen=True)
class Interrupted:
    """Elastic runs: a collective of this rank failed because a peer was lost (or, with ``grow``,
    the group paused at a step boundary for a :class:`GrowRequest`); the rank is alive, has torn
    down its process group and waits for a :class:`Resize`. ``snapshot_step``: the
    ``TrainState.step`` of its newest in-memory snapshot (``None``: it has none).
    ``generation``: the group generation it left; the driver ignores one older than its own."""

    rank: int
    time: float
    exc_type: str
    message: str
    snapshot_step: int | None
    step: int | None = None  # the last TrainState.step this rank reached
    generation: int = -1  # the group generation the rank left (-1: unknown)
    grow: bool = False  # paused for a GrowRequest at a step boundary, not a lost peer


@dataclass(frozen=True)
class Resumed:
    """Elastic runs: the first ``TrainState.step`` completed after a resize in place."""

    rank: int
    time: float
    generation: int
    step: int


@dataclass(frozen=True)
class JoinReady:
    """Elastic runs: a worker started to join a running group has loaded the train function,
    paid its one-time start-up costs and waits for its :class:`Resize`; the driver asks the
    members to pause only once every joining worker is ready."""

    rank: int
    time: float


# ---------------------------------------------------------------- messages (driver -> worker)


@dataclass(frozen=True)
class Start:
    """Sent to each worker after its Hello. ``payload``: cloudpickled ``(train_fn, config)`` in
    function mode, ``None`` in script mode. ``latest_checkpoint``: URI to resume from, or None."""

    payload: bytes | None = None
    latest_checkpoint: str | None = None


@dataclass(frozen=True)
class Resize:
    """Elastic runs: join generation ``generation`` of the worker group as rank ``rank`` of
    ``world_size``, rendezvousing under ``store_prefix`` in the driver's store. ``source_rank``:
    the new rank whose snapshot every rank takes (broadcast over the new process group), or
    ``None`` when every member holds the same snapshot. ``start_round``: the index of this rank's
    next ``report()``."""

    generation: int
    world_size: int
    rank: int
    store_prefix: str
    source_rank: int | None
    start_round: int
    snapshot_step: int


@dataclass(frozen=True)
class GrowRequest:
    """Elastic runs: workers are waiting to join (capacity returned). Every member pauses at the
    same step boundary (the members agree on it with an allreduce at their next snapshot), takes
    its snapshot, says :class:`Interrupted` with ``grow=True`` and waits for a :class:`Resize`
    to the larger group. ``generation``: the members' current generation."""

    generation: int


# --------------------------------------------------------------------------- driver side events


@dataclass(frozen=True)
class Exited:
    """A worker process ended. ``returncode`` < 0 means killed by signal ``-returncode``."""

    rank: int
    time: float
    returncode: int


Event = (
    Hello
    | Report
    | CheckpointDone
    | Heartbeat
    | Timing
    | WorkerError
    | Done
    | Exited
    | Interrupted
    | Resumed
    | JoinReady
)


def new_authkey() -> bytes:
    """A fresh 32-byte secret for one run."""
    return secrets.token_bytes(32)


class DriverListener:
    """Accepts worker connections; each accepted connection is handed to ``on_connection``.

    Args:
        authkey: the run's secret.
        host: interface to listen on; loopback by default.
        on_connection: called from the accept thread with each authenticated connection.
    """

    def __init__(self, authkey: bytes, on_connection: Any, host: str = "127.0.0.1") -> None:
        self._listener = Listener(address=(host, 0), family="AF_INET", authkey=authkey)
        self._on_connection = on_connection
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._accept_loop, name="ringtrain-accept", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._listener.address
        return f"{host}:{port}"

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except OSError:
                if self._closed.is_set():
                    return
                continue  # a failed handshake (wrong secret, port scan): ignore that client
            except Exception:
                # multiprocessing raises AuthenticationError for a wrong secret.
                continue
            self._on_connection(conn)

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass


@dataclass
class WorkerChannel:
    """The worker's end: a connection guarded by a lock (the heartbeat thread shares it)."""

    conn: Connection
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def connect(cls, address: str, authkey: bytes, timeout_s: float = 60.0) -> WorkerChannel:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return cls(Client((host, int(port)), family="AF_INET", authkey=authkey))
            except (ConnectionRefusedError, ConnectionResetError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def send(self, message: Any) -> None:
        with self.lock:
            self.conn.send(message)

    def recv(self) -> Any:
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass
