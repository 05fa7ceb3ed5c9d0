"""Worker processes on this machine: the embedded default launcher.

Each worker is ``python -m ringtrain.launch.worker`` in its own session (so a Ctrl-C in the terminal
reaches only the driver, which then stops the workers in order) with the torchrun variables set.
The launcher hosts the rendezvous ``TCPStore`` on an OS-assigned loopback port, as torchrun's
agent does (``TORCHELASTIC_USE_AGENT_STORE``), so there is no race for a "free" port: in a process
forked from the warm pool's zygote (:mod:`ringtrain.launch.store_server`; the driver then never
imports torch), or in the driver when the workers start cold. Worker output is forwarded line by
line with a ``(rank N)`` prefix (a traceback as one block).

With a warm pool (:class:`~ringtrain.launch.pool.WorkerPool`, the default: the launcher starts
one zygote per run, shared by every attempt and elastic newcomer) a worker is forked from a
process that has imported torch already, instead of ``import torch`` anew; the worker does the
same thing either way. If the zygote cannot start or dies, workers start cold (said once).

Every socket a local run listens on is bound to loopback: the driver's channel, the store (bound
by :func:`~ringtrain.launch.base.start_store`, since torch alone would bind the wildcard) and each
worker's gloo listener (:func:`~ringtrain.cluster.env.loopback_environment`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import IO, Any, Protocol

from ringtrain.cluster.env import loopback_environment, worker_environment
from ringtrain.cluster.worker_env import cpu_worker_devices
from ringtrain.launch import shared_pool
from ringtrain.launch.base import STACK_DUMP_SIGNAL, ChannelGroup, WorkerSpec, start_store
from ringtrain.launch.output import forward as _forward
from ringtrain.launch.pool import PooledProcess, PoolUnavailable, WorkerPool
from ringtrain.launch.reaper import Reaper, remove_worker_temp_dir, wait_unreaped
from ringtrain.wire.channel import DriverListener, Event, Exited, new_authkey

logger = logging.getLogger("ringtrain")

LOOPBACK = "127.0.0.1"


class WorkerProcess(Protocol):
    """What the group needs of a worker process: :class:`subprocess.Popen` or a
    :class:`~ringtrain.launch.pool.PooledProcess`."""

    pid: int
    stdout: IO[bytes] | None
    stderr: IO[bytes] | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class LocalLauncher:
    """Starts a :class:`LocalWorkerGroup`.

    Args:
        forward_output: prefix and forward worker stdout/stderr to the driver's (default); when
            False workers inherit the driver's stdout/stderr directly.
        warm_start: fork workers from a warm pool (a zygote that imported torch once); the
            launcher starts it now, so its imports overlap the driver's set-up, and
            :meth:`close` stops it. Inside an :func:`ringtrain.warm_pool` block it uses the
            block's zygote instead (started or replaced as needed: see
            :mod:`ringtrain.launch.shared_pool`), and :meth:`close` gives it back. False: a
            fresh interpreter per worker.
        pool: a pool to use instead (a sweep's, shared by its trials; the caller closes it).
        preload: modules the launcher's own pool imports when it starts
            (``ScalingConfig.preload_modules``), overlapping the driver's
            set-up; every spawn request also names the spec's (``WorkerSpec.preload``), which a
            shared or given pool imports at its first request.

    Raises:
        OSError: never for the pool: if the zygote cannot start, workers start cold.
    """

    def __init__(
        self,
        forward_output: bool = True,
        warm_start: bool = False,
        pool: WorkerPool | None = None,
        preload: Sequence[str] = (),
    ) -> None:
        self.forward_output = forward_output
        self._own_pool = pool is None and warm_start
        self.pool = pool
        self._cold_listener: Callable[[str], None] | None = None
        self._cold_reasons: list[str] = []  # said before a listener was attached
        self._cold_pools: set[int] = set()  # ids of the pools this launcher fell back from
        self._shared = shared_pool.active() if self._own_pool else None
        if self._shared is not None:
            self._own_pool = False
        if self._own_pool or self._shared is not None:
            try:
                self.pool = self._shared.acquire() if self._shared else WorkerPool(modules=preload)
            except OSError as exc:
                self._cold(f"the warm worker pool could not start ({exc})", key=0)

    def start(self, spec: WorkerSpec) -> LocalWorkerGroup:
        return LocalWorkerGroup(
            spec, forward_output=self.forward_output, pool=self.pool, on_cold=self._cold
        )

    def on_cold_start(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` each time workers start cold although a warm pool was
        asked for (:class:`~ringtrain.launch.pool.ColdStartReporter`; once per pool lost)."""
        self._cold_listener = listener
        pending, self._cold_reasons = self._cold_reasons, []
        for reason in pending:
            listener(reason)

    def _cold(self, reason: str, key: int) -> None:
        _say_cold(reason, key=key)
        if key in self._cold_pools:
            return
        self._cold_pools.add(key)
        if self._cold_listener is None:
            self._cold_reasons.append(reason)
        else:
            self._cold_listener(reason)

    def close(self) -> None:
        """Stop the launcher's own pool, or give a :func:`ringtrain.warm_pool` block's back
        (idempotent; a pool given to the constructor is left to its owner)."""
        pool, self.pool = self.pool, None
        if pool is not None and self._shared is not None:
            self._shared.release(pool)
        elif pool is not None and self._own_pool:
            pool.close()


_COLD_SAID: set[int] = set()


def _say_cold(reason: str, key: int = 0) -> None:
    """Say once (per pool) that workers start cold, and why."""
    if key in _COLD_SAID:
        return
    _COLD_SAID.add(key)
    sys.stderr.write(f"ringtrain: {reason}: starting workers cold (python -m ...)\n")


class LocalWorkerGroup(ChannelGroup):
    """N worker processes, their channel connections, and one event queue.

    Threads: one accepts connections, one per connection reads messages, one per process waits for
    its exit, and (with output forwarding) one per pipe copies lines. All of them only put events on
    the queue that :meth:`poll` drains, so the controller handles events on one thread.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        forward_output: bool = True,
        pool: WorkerPool | None = None,
        on_cold: Callable[[str, int], None] = lambda reason, key: _say_cold(reason, key),
    ) -> None:
        self._pool = pool
        self._on_cold = on_cold
        self.world_size = spec.world_size
        # The workers are this process's children (or the zygote's): they get its pid typed.
        spec = dataclasses.replace(
            spec, config=dataclasses.replace(spec.config, driver_pid=os.getpid())
        )
        self.spec = spec
        self._events: queue.Queue[Event] = queue.Queue()
        self._conns: dict[int, Connection] = {}
        self._threads: list[threading.Thread] = []
        self._procs: dict[int, WorkerProcess] = {}
        self._retired: list[WorkerProcess] = []  # lost in an elastic resize
        self._rank_of: dict[int, int] = {}  # pid -> current rank (renumbered by resize)
        self._joining: set[int] = set()  # ranks started by grow, not members yet
        self._spares: set[int] = set()  # hot spares among them (ids >= the world size)
        self._next_spare = spec.world_size  # the next spare's id
        self._quiet: set[int] = set()  # pids stopped as joiners left out: no Exited event
        self._stopped = False
        self._lock = threading.Lock()
        self._forward_output = forward_output
        self._authkey = new_authkey()
        # Every listener of a local run is on loopback: the channel, the rendezvous store
        # (which lives for the attempt's lifetime) and gloo's (GLOO_SOCKET_IFNAME).
        self._listener = DriverListener(
            self._authkey, self._on_connection, LOOPBACK, world_size=spec.world_size
        )
        self._store: Any = None  # the TCPStore, when this process hosts it
        self._store_proc: PooledProcess | None = None  # the store's process, when forked
        try:  # often the driver's first torch import: where a Ctrl-C is raised (interrupts.py)
            self.store_port = self._start_store(spec.world_size)
            # Process hygiene: a reaper kills every worker's process group (DataLoader workers
            # included) and the store's the instant this driver dies, SIGKILL included
            # (launch/reaper.py; until it runs, the pool's reaper covers a forked store).
            self._reaper = Reaper(new_authkey().hex())
        except BaseException:
            self._listener.close()
            if self._store_proc is not None:
                _signal_group(self._store_proc, signal.SIGKILL)
            raise
        if self._store_proc is not None:
            self._reaper.add(self._store_proc.pid)  # it leads its own process group
        base_env = dict(os.environ)
        base_env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p]
            + ([base_env["PYTHONPATH"]] if base_env.get("PYTHONPATH") else [])
        )
        base_env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        base_env.update(loopback_environment())
        base_env.update(cpu_worker_devices(spec.use_gpu, spec.env))
        base_env.update(spec.env)
        base_env.update(self._reaper.environment())
        self._base_env = base_env
        self._args: list[str] = []
        if spec.script is not None:
            self._args = ["--script", spec.script, *spec.script_args]
        self._cmd = [sys.executable, "-m", "ringtrain.launch.worker", *self._args]
        try:
            for rank in range(spec.world_size):
                self._start_worker(rank, spec.world_size, base_env)
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _start_worker(self, rank: int, world_size: int, base_env: dict[str, str]) -> None:
        spec = self.spec
        env = dict(base_env)
        env.update(
            worker_environment(
                rank=rank,
                world_size=world_size,
                local_rank=rank,
                local_world_size=world_size,
                node_rank=0,
                master_addr=LOOPBACK,
                master_port=self.store_port,
                threads=spec.threads,
                driver_addr=self._listener.address,
                authkey_hex=self._authkey.hex(),
            )
        )
        proc = self._launch(env)
        self._reaper.add(proc.pid)  # the worker leads its own process group
        with self._lock:
            self._procs[rank] = proc
            self._rank_of[proc.pid] = rank
        self._spawn(self._wait_exit, rank, proc)
        if self._forward_output:
            assert proc.stdout is not None and proc.stderr is not None
            self._spawn(_forward, rank, proc.stdout, "stdout")
            self._spawn(_forward, rank, proc.stderr, "stderr")

    def _start_store(self, world_size: int) -> int:
        """Host the rendezvous store; its port. With a warm pool it is forked from the zygote
        (:meth:`WorkerPool.host_store`: the driver never imports torch for it), else (or if
        that fails) it lives in this process (:func:`~ringtrain.launch.base.start_store`)."""
        pool = self._pool
        if pool is not None:
            try:  # (a forked child's /proc/PID/environ is the zygote's: the pool's run token)
                proc, port = pool.host_store(LOOPBACK, world_size, dict(os.environ))
            except PoolUnavailable as exc:  # a dead zygote also makes the workers start cold
                logger.info("the rendezvous store is hosted by the driver: %s", exc)
            else:
                self._store_proc = proc
                assert proc.stdout is not None and proc.stderr is not None
                self._spawn(_forward, "store", proc.stdout, "stdout")
                self._spawn(_forward, "store", proc.stderr, "stderr")
                return port
        self._store = start_store(LOOPBACK, world_size)
        return int(self._store.port)

    def _launch(self, env: dict[str, str]) -> WorkerProcess:
        """Fork the worker from the warm pool, or start it cold (the pool is off or gone)."""
        pool = self._pool
        if pool is not None:
            try:
                return pool.spawn(
                    self._args,
                    env,
                    capture_output=self._forward_output,
                    preload=self.spec.preload,
                )
            except PoolUnavailable as exc:
                self._pool = None
                self._on_cold(str(exc), id(pool))
        pipe = subprocess.PIPE if self._forward_output else None
        return subprocess.Popen(
            self._cmd, env=env, stdout=pipe, stderr=pipe, start_new_session=True
        )

    # ------------------------------------------------------------------ threads
    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(
            target=target, args=args, daemon=True, name=f"ringtrain-{target.__name__}"
        )
        t.start()
        self._threads.append(t)

    def _wait_exit(self, rank: int, proc: WorkerProcess) -> None:
        # Process hygiene: once the worker is dead (not yet reaped, so its pid cannot be reused)
        # its DataLoader workers and other children go too, before any next attempt starts.
        # Then its multiprocessing temp dir (a SIGKILLed worker's exit handlers never ran). (A
        # pooled worker's zygote does all three before it reaps the worker.)
        if not isinstance(proc, PooledProcess):
            wait_unreaped(proc.pid)
            _signal_group(proc, signal.SIGKILL)
            remove_worker_temp_dir(proc.pid, self._base_env)
        code = proc.wait()
        self._reaper.discard(proc.pid)
        with self._lock:
            if proc.pid in self._quiet:
                return
            rank = self._rank_of.get(proc.pid, rank)
        self._events.put(Exited(rank=rank, time=time.time(), returncode=code))

    def _on_connection(self, conn: Connection) -> None:
        self._spawn(self._read, conn)

    def resize(self, assignment: dict[int, int], orders: dict[int, Any]) -> None:
        """Elastic resize in place: worker ``old`` becomes rank ``assignment[old]`` and is sent
        ``orders[old]`` (a :class:`~ringtrain.wire.channel.Resize`) on its channel connection.
        Joining workers (started by :meth:`grow`) in ``assignment`` become members; the
        processes not in it (exited members, joiners left out) are retired, and stopped if
        still alive.

        Raises:
            OSError: if a worker's connection is gone (the caller restarts the group instead).
        """
        with self._lock:
            procs, conns, left = self._reassign(assignment, self._procs)
            self._retired += left
            self._procs, self._conns = procs, conns
            self._rank_of = {p.pid: r for r, p in procs.items()}
            self._spares -= set(assignment)  # promoted
            self._joining = set(self._spares)  # a grow's joiners are members or left out
            self.world_size = len(assignment)
            alive = [p for p in left if p.poll() is None]
            self._quiet.update(p.pid for p in alive)
        for proc in alive:
            _signal_group(proc, signal.SIGKILL)
        for old, new in assignment.items():
            conns[new].send(orders[old])

    def grow(self, ranks: list[int]) -> list[int]:
        """Start a joining worker for each of ``ranks`` (consecutive from ``world_size``): the
        attempt's worker (its ``Start`` marks it joining: :meth:`WorkerSpec.start_config`),
        which says Hello with its rank and waits for a Resize (see :meth:`resize`). On this
        machine a process can always be started, so every rank is.

        Returns:
            ``ranks``.

        Raises:
            OSError: if a process cannot be started (those of this call are stopped again).
            ValueError: if ``ranks`` do not follow the current members, or the run is not
                elastic.
        """
        if not self.spec.elastic:
            raise ValueError("grow: the run is not elastic (WorkerSpec.config.elastic is None)")
        with self._lock:
            expected = list(range(self.world_size, self.world_size + len(ranks)))
            if list(ranks) != expected or self._joining - self._spares or self._stopped:
                raise ValueError(
                    f"grow: ranks {list(ranks)} do not follow the {self.world_size} members "
                    f"(expected {expected}; joining now: {sorted(self._joining)})"
                )
            self._joining.update(ranks)
        try:
            for rank in ranks:
                self._start_worker(rank, self.world_size + len(ranks), self._base_env)
        except BaseException:
            self.discard(ranks)
            raise
        return list(ranks)

    def add_spares(self, count: int) -> list[int]:
        """Start ``count`` hot spares (``ScalingConfig.spares``): joining workers with fresh ids
        (at or above the run's world size, never reused) that say Hello and ``JoinReady`` with
        their id and wait, warmed up, until a :meth:`resize` makes them members; the others
        stay spares across resizes.

        Returns:
            the ids started.

        Raises:
            OSError: if a process cannot be started (those of this call are stopped again).
            ValueError: if the run does not resize in place (``WorkerSpec.config.elastic``).
        """
        if not self.spec.elastic:
            raise ValueError("add_spares: the run is not elastic (WorkerSpec.config.elastic)")
        with self._lock:
            ids = list(range(self._next_spare, self._next_spare + count))
            self._next_spare += count
            self._joining.update(ids)
            self._spares.update(ids)
        try:
            for spare in ids:
                self._start_worker(spare, spare + 1, self._base_env)
        except BaseException:
            self.discard(ids)
            raise
        return ids

    def discard(self, ranks: list[int]) -> None:
        """Stop joining workers (a grow's, or spares) that were never made members (SIGKILL)
        and forget them; their Exited events may still arrive. Idempotent; members and unknown
        ranks are ignored."""
        with self._lock:
            self._spares -= set(ranks)
            gone: list[WorkerProcess] = self._pop_joiners(ranks, self._procs)
            self._retired += gone
            self._quiet.update(proc.pid for proc in gone)
        for proc in gone:
            _signal_group(proc, signal.SIGKILL)

    # ------------------------------------------------------------------ contract
    def pids(self) -> dict[int, int]:
        return {rank: p.pid for rank, p in self._procs.items()}

    def dump_stacks(self, ranks: list[int]) -> None:
        """:data:`~ringtrain.launch.base.STACK_DUMP_SIGNAL` to each rank's worker process
        (not its process group: a DataLoader worker would die of it)."""
        for rank in ranks:
            proc = self._procs.get(rank)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(proc.pid, STACK_DUMP_SIGNAL)

    def stop(self, grace_s: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        everyone = [*self._procs.values(), *self._retired]
        alive = [p for p in everyone if p.poll() is None]
        for proc in alive:
            _signal_group(proc, signal.SIGTERM)
            # A frozen (SIGSTOPped) worker acts on its SIGTERM only once continued; without
            # this, stopping a group with a hung rank always waited the whole grace period.
            _signal_group(proc, signal.SIGCONT)
        deadline = time.monotonic() + grace_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        store = [self._store_proc] if self._store_proc is not None else []
        for proc in [*everyone, *store]:
            # SIGKILL the whole process group: the worker and any DataLoader workers it forked
            # (and the store, once no worker needs it).
            _signal_group(proc, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._listener.close()
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.close()
        for t in self._threads:
            t.join(timeout=2)
        self._reaper.close()  # process hygiene: a last sweep of the run token, then it exits
        self._store = None


def _signal_group(proc: WorkerProcess, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
