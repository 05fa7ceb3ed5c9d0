"""The authenticated channel between workers and the driver, and the messages it carries.

Built on :mod:`multiprocessing.connection`: the driver listens on loopback (or on the node address a
multi-node backend needs) with a per-run secret; a client must answer an HMAC-SHA256 challenge
with that secret (:mod:`ringtrain.wire.handshake`) before a single byte is unpickled, so nobody else
on the host can inject reports, and idle or garbage connections cannot stall the workers'.
Messages are small frozen dataclasses; what the driver tells a worker travels typed, as the
:class:`~ringtrain.wire.worker_config.WorkerConfig` inside :class:`Start`, never as strings to
parse. This module imports neither torch nor the controller, so both sides can use it.
"""

from __future__ import annotations

import secrets
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ringtrain.wire import handshake
from ringtrain.wire.handshake import (
    HANDSHAKE_TIMEOUT_S,
    HandshakeListener,
    listen_backlog,
    listen_socket,
)
from ringtrain.wire.worker_config import WorkerConfig

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


@dataclass(frozen=True)
class WorkerNotice:
    """A worker received a preemption signal itself (SIGTERM to its process or process group: a
    node going away with the whole process tree). It keeps training; the driver turns this into a
    :class:`~ringtrain.preemption.PreemptionNotice` (source ``"worker-signal"``) and answers every
    worker with a :class:`PreemptRequest`."""

    rank: int
    time: float
    reason: str


@dataclass(frozen=True)
class RunSettings:
    """The run configuration of a script whose ``rt.Trainer(..., run_config=...).fit()`` runs
    inside a worker the driver started (``ringtrain run SCRIPT``): sent once by rank 0 when
    ``fit()`` starts, before its first report. The driver adopts what it can still apply
    (:mod:`ringtrain.controller.script_settings`) and says what it cannot."""

    rank: int
    run_config: Any  # a ringtrain.config.RunConfig; its callbacks and notice sources dropped
    callbacks: tuple[str, ...] = ()  # the repr of each callback it had
    notice_sources: tuple[str, ...] = ()  # the repr of each FailureConfig.notice_sources


@dataclass(frozen=True)
class PreemptSaved:
    """A worker stopped for a preemption after ``TrainState.step`` ``step`` and saved its state
    as round ``round``'s checkpoint (``round`` is ``None`` when it had no ``TrainState`` to
    save: the run's previous checkpoint is what a resume uses). Sent before its ``Done``."""

    rank: int
    time: float
    step: int | None
    round: int | None


@dataclass(frozen=True)
class IntegrityMismatch:
    """A replica check (``check``: ``"replica"``, or ``"replay"``) at ``step`` found replicas
    with different bits (silent data corruption): ``fingerprints`` (rank -> 64-bit value),
    ``suspects`` (``named``: a majority named them; else one of them is the culprit),
    ``last_clean_step`` (the newest step whose check passed; ``None``: none) and
    ``clean_round`` (the newest report round at or before it: its checkpoint, if it has one, is
    clean; ``-1``: none). Sent before every rank raises ``ReplicaMismatchError``."""

    rank: int
    time: float
    step: int
    check: str
    fingerprints: dict[int, int]
    suspects: tuple[int, ...]
    named: bool
    last_clean_step: int | None
    clean_round: int


@dataclass(frozen=True)
class IntegrityVerified:
    """Rank 0 passed the replica check at ``step`` with ``fingerprint`` (sent when the driver
    asked for that step, ``WorkerConfig.recheck_step``: the re-run after a mismatch without a
    majority names the rank whose fingerprint there was not this one)."""

    rank: int
    time: float
    step: int
    fingerprint: int


# ---------------------------------------------------------------- messages (driver -> worker)


@dataclass(frozen=True)
class PreemptRequest:
    """Stop for a preemption: every worker allreduces a "stop requested" flag (MAX) at each
    ``TrainState.step`` boundary, and at the first boundary where it is set on any rank they all
    save their ``TrainState`` (no ``report()`` call needed), say :class:`PreemptSaved` and exit.
    ``deadline``: when the driver kills the group (Unix seconds); ``reason``: for the logs."""

    time: float
    deadline: float
    reason: str = ""


@dataclass(frozen=True)
class Start:
    """Sent to each worker after its Hello. ``payload``: cloudpickled ``(train_fn, config)`` in
    function mode, ``None`` in script mode. ``latest_checkpoint``: URI to resume from, or None.
    ``checkpoint_files``: the file table (``{path: {"size", "sha256"}}``) of that checkpoint's
    manifest, whose signature the driver checked: workers read only these files and hash each
    as they read it (``None``: they check the manifest themselves). ``config``: everything else
    the driver tells the worker (timeouts, checkpoint mode, timing, step limit, elastic
    settings, attempt, first report round), typed."""

    payload: bytes | None = None
    latest_checkpoint: str | None = None
    checkpoint_files: dict[str, dict[str, Any]] | None = None
    config: WorkerConfig = field(default_factory=WorkerConfig)


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


@dataclass(frozen=True)
class HostSilent:
    """The launcher: the host of ``rank`` stopped answering at the network level (``since``,
    Unix time, the first probe left unanswered: a partition or a lost host), or, with
    ``answered``, answers again (a link that flapped)."""

    rank: int
    time: float
    host: str
    since: float
    answered: bool = False


Event = (
    Hello
    | Report
    | CheckpointDone
    | Heartbeat
    | Timing
    | WorkerError
    | Done
    | Exited
    | HostSilent
    | Interrupted
    | Resumed
    | JoinReady
    | WorkerNotice
    | RunSettings
    | PreemptSaved
    | IntegrityMismatch
    | IntegrityVerified
)


def new_authkey() -> bytes:
    """A fresh 32-byte secret for one run."""
    return secrets.token_bytes(32)


class DriverListener:
    """The driver's end of the channel: accepts worker connections on ``host`` and hands each
    one that authenticates (:mod:`ringtrain.wire.handshake`: HMAC-SHA256 both ways, nothing read
    from the socket is unpickled before) to ``on_connection``.

    Handshakes run in one non-blocking loop with a deadline each, so idle or garbage
    connections (a port scan, a local user) neither delay the workers' handshakes nor fail the
    run; the listen backlog covers the world size.

    Args:
        authkey: the run's secret.
        on_connection: called with each authenticated connection, from the listener's thread
            (start a reader thread; do not block).
        host: the address to listen on: loopback for a run on this machine, the node's address
            when workers on other nodes connect (never the wildcard).
        world_size: workers that connect at about the same time (sizes the backlog).
        handshake_timeout_s: seconds a client has to answer the challenge before it is dropped.

    Raises:
        OSError: if ``host`` is not an address of this machine.
    """

    def __init__(
        self,
        authkey: bytes,
        on_connection: Any,
        host: str = "127.0.0.1",
        *,
        world_size: int = 1,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ) -> None:
        sock = listen_socket(host, listen_backlog(world_size))
        self._listener = HandshakeListener(
            sock, authkey, on_connection, handshake_timeout_s=handshake_timeout_s
        )

    @property
    def address(self) -> str:
        """``HOST:PORT`` for :meth:`WorkerChannel.connect`."""
        host, port = self._listener.address
        return f"{host}:{port}"

    @property
    def handshakes(self) -> HandshakeListener:
        """The handshake loop (its ``rejected``/``timed_out`` counters, ``pending()``)."""
        return self._listener

    def close(self) -> None:
        """Stop listening (connections already handed out stay open). Idempotent."""
        self._listener.close()


@dataclass
class WorkerChannel:
    """The worker's end: a connection guarded by a lock (the heartbeat thread shares it)."""

    conn: Connection
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def connect(cls, address: str, authkey: bytes, timeout_s: float = 60.0) -> WorkerChannel:
        """Connect to the driver's :class:`DriverListener` at ``HOST:PORT`` and authenticate
        (both ways) with ``authkey``; retries until ``timeout_s`` while the driver is not
        reachable or drops the handshake.

        Raises:
            multiprocessing.AuthenticationError: the driver rejected ``authkey``, or the peer
                is not the driver.
            OSError: no authenticated connection within ``timeout_s``.
        """
        host, _, port = address.rpartition(":")
        return cls(handshake.connect(host.strip("[]"), int(port), authkey, timeout_s))

    def send(self, message: Any) -> None:
        with self.lock:
            self.conn.send(message)

    def recv(self) -> Any:
        return self.conn.recv()

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the channel once the driver has read everything sent on it (it closes its end
        at end of file), waiting ``timeout_s`` seconds at most
        (:func:`ringtrain.wire.handshake.close_gracefully`). Never raises."""
        with self.lock:  # not in the middle of another thread's send
            handshake.close_gracefully(self.conn, timeout_s)
