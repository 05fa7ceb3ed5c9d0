"""The launcher contract: ``Launcher.start(spec) -> WorkerGroup``.

The controller sees only this contract, so local processes and (later) Ray actors are
interchangeable. A worker group delivers :mod:`ringtrain.wire.channel` events (Hello, Report,
WorkerError, Done, Exited) through ``poll`` and can be stopped from any state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar, runtime_checkable

from ringtrain.preemption import NoticeSource
from ringtrain.wire.channel import Event, Hello, Start
from ringtrain.wire.handshake import listen_backlog, listen_socket
from ringtrain.wire.worker_config import WorkerConfig

_W = TypeVar("_W")  # a group's worker: a process (local) or a GroupWorker (Ray)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker of one attempt runs.

    Attributes:
        world_size: number of workers.
        payload: cloudpickled ``(train_fn, train_loop_config)`` (function mode), or ``None``.
        script: path of a per-worker script (script mode), run as ``__main__``.
        script_args: the script's ``sys.argv[1:]``.
        use_gpu: one CUDA device per worker, NCCL.
        threads: torch intra-op threads per worker.
        run_dir: the run directory (path or fsspec URL).
        attempt: 0 on the first attempt.
        start_round: the report round the first ``report()`` of this attempt gets.
        latest_checkpoint: URI of the checkpoint to resume from, or ``None``.
        checkpoint_files: the verified manifest's file table of ``latest_checkpoint``.
        env: extra environment variables for the workers (e.g. a sweep trial's
            ``CUDA_VISIBLE_DEVICES``); configuration goes into ``config``.
        config: the run's :class:`~ringtrain.wire.worker_config.WorkerConfig`; each worker's
            ``Start`` carries :meth:`start_config`.
        preload: modules a warm pool's zygote imports before forking these workers
            (``ScalingConfig.preload_modules``; local launcher only).
    """

    world_size: int
    run_dir: str
    payload: bytes | None = None
    script: str | None = None
    script_args: tuple[str, ...] = ()
    use_gpu: bool = False
    threads: int = 1
    attempt: int = 0
    start_round: int = 0
    latest_checkpoint: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    checkpoint_files: dict[str, dict[str, Any]] | None = None
    config: WorkerConfig = field(default_factory=WorkerConfig)
    preload: tuple[str, ...] = ()

    @property
    def elastic(self) -> bool:
        """Whether the run resizes in place (``config.elastic`` is set)."""
        return self.config.elastic is not None

    def start_config(self, *, joining: bool = False) -> WorkerConfig:
        """The config a worker of this attempt receives in ``Start``: ``config`` with this
        spec's run directory, attempt, first report round and device; ``joining``: a worker an
        elastic grow started (:meth:`WorkerConfig.for_joiner`)."""
        config = dataclasses.replace(
            self.config,
            run_dir=self.run_dir,
            attempt=self.attempt,
            start_round=self.start_round,
            use_gpu=self.use_gpu,
        )
        return config.for_joiner() if joining else config


def start_store(host: str, world_size: int) -> Any:
    """Host the rendezvous ``torch.distributed.TCPStore`` (server) on ``host`` only.

    ``TCPStore(host, 0, is_master=True)`` listens on every interface whatever ``host`` says
    (torch binds the wildcard, IPv4 and IPv6), so the listening socket is bound here, to
    ``host`` with a port chosen by the OS, and handed to the store by file descriptor
    (``master_listen_fd``). Workers connect to ``host:store.port``.

    Args:
        host: loopback for a run on this machine; the node's address on a cluster.
        world_size: the number of workers (sizes the listen backlog).

    Raises:
        OSError: if ``host`` is not an address of this machine.
    """
    from ringtrain.monitor.interrupts import held_ctrl_c

    with held_ctrl_c():  # often the driver's first import of torch, which swallows a Ctrl-C
        import torch.distributed as dist

    sock = listen_socket(host, listen_backlog(world_size))
    port = int(sock.getsockname()[1])
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=True,
        wait_for_workers=False,
        master_listen_fd=sock.detach(),  # the store owns the descriptor from now on
    )


STACK_DUMP_SIGNAL = signal.SIGUSR2
"""The signal on which a worker started by ``python -m ringtrain.launch.worker`` prints every
thread's Python stack to its stderr and goes on (:mod:`faulthandler`: a C handler, so it answers
even while the main thread is stuck in C++). The driver has it sent to a rank it fails as hung
(:meth:`WorkerGroup.dump_stacks`; on Ray by the rank's actor); ``kill -USR2 <pid>`` does it by
hand."""


class WorkerGroup(Protocol):
    world_size: int

    def poll(self, timeout_s: float) -> list[Event]:
        """Events that arrived, waiting up to ``timeout_s`` seconds for the first one."""
        ...

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every worker: SIGTERM, then SIGKILL after ``grace_s`` seconds. Idempotent."""
        ...

    def pids(self) -> dict[int, int]:
        """rank -> process id of the workers started (for diagnostics and tests)."""
        ...

    def dump_stacks(self, ranks: list[int]) -> None:
        """Ask the workers of ``ranks`` to print every thread's Python stack to their stderr
        (which reaches the driver's, prefixed with the rank), without stopping them: what a
        stuck rank was doing when the driver gave up on it. Best effort, never raises; nothing
        where the backend cannot (scripted groups)."""
        ...


@runtime_checkable
class ChannelReading(Protocol):
    """A group whose workers' messages come on channels read by threads
    (:class:`ChannelGroup`): a worker's exit can be reported before the last messages it
    wrote. A scripted group without channels lacks it."""

    def reading(self, rank: int) -> bool:
        """Whether ``rank``'s channel may still hold events not yet queued."""
        ...


@runtime_checkable
class GrowableGroup(WorkerGroup, Protocol):
    """A worker group an elastic run can resize in place and grow back (the controller checks
    ``isinstance(group, GrowableGroup)``: every method below; docs/elastic.md). ``send`` comes
    with :class:`ChannelGroup`."""

    def resize(self, assignment: dict[int, int], orders: dict[int, Any]) -> None:
        """Worker ``old`` becomes rank ``assignment[old]`` and is sent ``orders[old]`` (a
        :class:`~ringtrain.wire.channel.Resize`); joining workers may be included (``r -> r``) and
        become members; processes in neither are stopped. ``world_size`` becomes
        ``len(assignment)``. Raises ``OSError`` if a connection is gone."""
        ...

    def grow(self, ranks: list[int]) -> list[int]:
        """Start one joining worker per rank in ``ranks`` (consecutive from ``world_size``),
        with the attempt's spec; the channel group marks it joining in its ``Start``
        (:meth:`WorkerSpec.start_config`). Each says Hello with its rank and waits for a
        Resize; its events come through ``poll``; ``world_size`` is unchanged. Returns the
        ranks started (a prefix of ``ranks``; ``[]``: no capacity now). Raises
        ``OSError``/``RuntimeError`` if starting failed (nothing of the call left running)."""
        ...

    def discard(self, ranks: list[int]) -> None:
        """Stop joining workers that were never made members, and forget them. Idempotent."""
        ...

    def send(self, rank: int, message: Any) -> None:
        """Send a driver -> worker message on ``rank``'s connection (``OSError``: gone)."""
        ...


@runtime_checkable
class SpareGroup(GrowableGroup, Protocol):
    """A growable group that keeps hot spares (``ScalingConfig.spares``): joining workers
    with ids at or above the world size that wait, warmed up, until a ``resize`` makes them
    members (``assignment[spare_id] = rank``); spares left out of a resize stay spares.
    ``discard`` stops them."""

    def add_spares(self, count: int) -> list[int]:
        """Start ``count`` spares; returns their ids (``OSError``: could not start)."""
        ...


class Launcher(Protocol):
    def start(self, spec: WorkerSpec) -> WorkerGroup: ...


@runtime_checkable
class NoticeProvider(Protocol):
    """A launcher whose cluster announces preemptions (the Ray backend: a node drain); the
    driver adds its sources to the run's (:mod:`ringtrain.preemption`)."""

    def notice_sources(self) -> list[NoticeSource]: ...


class ChannelGroup:
    """The driver's side of the worker channel, shared by the local and the Ray worker groups:
    one reader thread per worker connection (``_read``) feeds one event queue (``poll``).

    A subclass sets ``spec``, ``world_size``, ``_lock``, ``_stopped``, ``_conns`` and ``_events``.
    """

    spec: WorkerSpec
    world_size: int
    _lock: threading.Lock
    _stopped: bool
    _conns: dict[int, Connection]
    _events: queue.Queue[Event]

    def _read(self, conn: Connection) -> None:
        """Serve one worker's connection: its Hello, then our Start, then its events until it
        closes."""
        try:
            hello = conn.recv()
            # A worker started by an elastic grow says Hello with its future rank (>= world_size).
            joining = getattr(self, "_joining", ())
            if not isinstance(hello, Hello) or not (
                0 <= hello.rank < self.world_size or hello.rank in joining
            ):
                conn.close()
                return
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                self._conns[hello.rank] = conn
            conn.send(
                Start(
                    payload=self.spec.payload,
                    latest_checkpoint=self.spec.latest_checkpoint,
                    checkpoint_files=self.spec.checkpoint_files,
                    config=self.spec.start_config(joining=hello.rank in joining),
                )
            )
            self._events.put(hello)
            while True:
                self._events.put(conn.recv())
        except (EOFError, OSError):
            pass  # the worker exited or was killed; its Exited event says how
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def reading(self, rank: int) -> bool:
        """Whether ``rank``'s channel may still hold events not yet queued (its reader has not
        met end of file): a worker's ``Exited``, which the process's waiter sends, can overtake
        the last messages it wrote (``PreemptSaved``, ``Done``) on a loaded driver."""
        with self._lock:
            conn = self._conns.get(rank)
        return conn is not None and not conn.closed

    def _reassign(
        self, assignment: dict[int, int], members: dict[int, _W]
    ) -> tuple[dict[int, _W], dict[int, Connection], list[_W]]:
        """An elastic resize's new numbering (``assignment``: old rank -> new rank) applied to
        ``members`` (the subclass's rank -> worker map) and the channel connections: returns
        ``(members, connections)`` by new rank and the workers left out. Nothing is changed;
        call with ``_lock`` held.

        Raises:
            OSError: if a rank of ``assignment`` has no channel connection (the caller
                restarts the group instead).
        """
        missing = [old for old in assignment if old not in self._conns]
        if missing:
            raise OSError(f"ranks {missing} have no channel connection")
        # Hot spares not promoted stay spares, under their ids (above every rank).
        waiting = set(getattr(self, "_spares", ())) - set(assignment)
        kept = {new: members[old] for old, new in assignment.items()}
        kept.update({s: members[s] for s in waiting if s in members})
        conns = {new: self._conns[old] for old, new in assignment.items()}
        conns.update({s: self._conns[s] for s in waiting if s in self._conns})
        left = [w for r, w in members.items() if r not in assignment and r not in waiting]
        return kept, conns, left

    def _pop_joiners(self, ranks: list[int], members: dict[int, Any]) -> list[Any]:
        """Forget the joining workers among ``ranks`` (an elastic grow's, never made members):
        drop them from ``_joining``, pop their entries from ``members`` (the subclass's rank ->
        worker map) and close their channel connections. Members and unknown ranks are
        ignored. Call with ``_lock`` held.

        Returns:
            the popped workers, for the subclass to stop.
        """
        joining: set[int] = getattr(self, "_joining", set())
        gone = []
        for rank in ranks:
            if rank not in joining:
                continue
            joining.discard(rank)
            worker = members.pop(rank, None)
            conn = self._conns.pop(rank, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
            if worker is not None:
                gone.append(worker)
        return gone

    def send(self, rank: int, message: Any) -> None:
        """Send a driver -> worker message (e.g. :class:`~ringtrain.wire.channel.GrowRequest`) on
        ``rank``'s channel connection.

        Raises:
            OSError: if the rank has no open connection.
        """
        with self._lock:
            conn = self._conns.get(rank)
        if conn is None:
            raise OSError(f"rank {rank} has no channel connection")
        conn.send(message)

    def poll(self, timeout_s: float) -> list[Event]:
        """Events that arrived, waiting up to ``timeout_s`` seconds for the first one."""
        events: list[Event] = []
        try:
            events.append(self._events.get(timeout=timeout_s))
            while True:
                events.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return events
