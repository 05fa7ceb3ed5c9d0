"""A warm pool of worker processes: one zygote (fork server) per run or sweep.

The zygote (:mod:`ringtrain.launch.zygote`) is ``python -m ringtrain.launch.zygote FD`` started
with a clean interpreter. It imports torch, ``torch.distributed``, ``torch.nn.parallel`` and
ringtrain's worker modules once (and the run's preloaded modules: ``ScalingConfig.preload_modules``,
``lightning.pytorch`` when the driver imported it), runs no torch op and starts no thread, then
forks a worker for each request. The child does what
``python -m ringtrain.launch.worker`` does (same environment, cwd, argv; stdout/stderr are the
pipe ends the driver passed with ``SCM_RIGHTS``; its own session; ``PR_SET_PDEATHSIG`` by the
worker bootstrap), so a worker skips ~1.7 CPU-s of ``import torch``.

Control channel: one ``socketpair`` inherited by the zygote (no listener: no other process can
reach it). Messages are JSON lines, never pickles. Driver -> zygote: ``{"argv", "env", "cwd",
"preload", "program"}`` with two file descriptors (stdout, stderr); ``program`` is ``"worker"``, or
``"store"`` for a local run's rendezvous store (:meth:`WorkerPool.host_store`: so the driver of a
warm run never imports torch). Zygote -> driver: ``{"pid": N}`` (the
reply; ``N`` < 0: it did not fork) and ``{"exit": N, "code": C}`` (a child ended; its process
group was SIGKILLed before the child was reaped, so the group number cannot have been reused).

Python's ``multiprocessing`` forkserver is not used: it re-imports the user's ``__main__`` and is a
process-wide singleton that outlives the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import IO, Protocol, TypeVar, runtime_checkable

from ringtrain.launch.reaper import Reaper

_MAX_MSG = 1 << 20
_START_TIMEOUT_S = 120.0
# Imported by the zygote for a train function that uses them (a global of its module names
# one of the packages listed): the Lightning bridge's train functions import Lightning in every
# worker, ~3 CPU-seconds per worker start on 2 cores.
AUTO_PRELOAD: dict[str, tuple[str, ...]] = {
    "lightning.pytorch": ("lightning", "ringtrain.integrations.lightning"),
}
# The zygote's answers instead of a pid once it stopped forking (launch/zygote.py's):
_THREAD = -2  # a Python thread runs in it (a fork would copy the locks the thread holds)
_CUDA = -3  # a child forked from it could not use CUDA (an import there initialised it)

STORE_PORT_WORD = "ringtrain-store-port"
"""The first line a store forked by :meth:`WorkerPool.host_store` prints: this word, a space, its
port (:mod:`ringtrain.launch.store_server`)."""

_Config = TypeVar("_Config")


def with_auto_preload(scaling: _Config, train_fn: object) -> _Config:
    """``scaling`` (a :class:`~ringtrain.config.ScalingConfig`) with each module of
    :data:`AUTO_PRELOAD` that ``train_fn`` uses added to its ``preload_modules`` (after the
    user's), when this driver has imported it: a train function uses a package when a global
    of its module is that package, one of its modules, or an object defined in one. The run's
    ``config.json`` then names them, and ``--resume`` keeps them."""
    requested = tuple(getattr(scaling, "preload_modules", ()))
    used = _packages_used(train_fn)
    auto = [
        module
        for module, packages in AUTO_PRELOAD.items()
        if module in sys.modules and module not in requested and used & set(packages)
    ]
    if not auto:
        return scaling
    return dataclasses.replace(scaling, preload_modules=(*requested, *auto))  # type: ignore[type-var]


def _packages_used(train_fn: object) -> set[str]:
    """Every dotted prefix of the modules ``train_fn``'s globals are, or were defined in."""
    names: set[str] = set()
    for value in getattr(train_fn, "__globals__", {}).values():
        try:  # a global's __getattr__ may raise anything
            module = isinstance(value, ModuleType)
            name = value.__name__ if module else getattr(value, "__module__", None)
        except Exception:
            continue
        if isinstance(name, str):
            parts = name.split(".")
            names.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return names


class PoolUnavailable(OSError):
    """The zygote is not running (it never started, or it died): launch cold instead."""


@runtime_checkable
class ColdStartReporter(Protocol):
    """A launcher that says when its workers start cold although a warm pool was asked for
    (the zygote could not start, or died): the driver writes each reason to the run directory
    as a ``cold_start`` event (:class:`ringtrain.rundir.schema.ColdStartEvent`)."""

    def on_cold_start(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(reason)`` (on the thread that starts workers) each time this
        launcher falls back to cold starts; a fallback before this call is reported at once."""
        ...


def _kill_group(proc: PooledProcess) -> None:
    """SIGKILL ``proc``'s process group and wait for the zygote to report its exit."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class PooledProcess:
    """A worker forked by the zygote, with :class:`subprocess.Popen`'s interface (``pid``,
    ``poll``, ``wait``, ``returncode``, ``send_signal``, ``kill``, ``terminate``, ``stdout``,
    ``stderr``). Its exit status comes from the zygote (it is not the driver's child)."""

    def __init__(self, pid: int, stdout: IO[bytes] | None, stderr: IO[bytes] | None) -> None:
        self.pid = pid
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        self._done = threading.Event()

    def _set_exit(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the worker exits.

        Raises:
            subprocess.TimeoutExpired: after ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pooled worker {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class WorkerPool:
    """The driver's handle on one zygote; a context manager (``with WorkerPool() as pool``).

    Args:
        preload: import torch etc. in the zygote (False: ringtrain modules only; for tests).
        modules: more modules it imports when it starts (``ScalingConfig.preload_modules``);
            a request may name more (:meth:`spawn`'s ``preload``).

    Raises:
        OSError: if the zygote process cannot be started.
    """

    def __init__(self, preload: bool = True, modules: Sequence[str] = ()) -> None:
        self._lock = threading.Lock()  # one spawn request at a time
        self._procs: dict[int, PooledProcess] = {}
        self._replies: list[int] = []
        self._early_exits: dict[int, int] = {}  # exits seen before spawn() recorded the pid
        self._unclaimed = 0  # replies still due to requests given up on (Ctrl-C, no answer)
        self._reply_ready = threading.Condition()
        self._alive = True
        self.reaper = Reaper(os.urandom(16).hex())
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [p for p in sys.path if p] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        # Every forked child's /proc/PID/environ is the zygote's initial one: the run token
        # must be there for the reaper's sweep to find the children.
        env.update(self.reaper.environment())
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        cmd = [sys.executable, "-m", "ringtrain.launch.zygote", str(theirs.fileno())]
        if not preload:
            cmd.append("--no-preload")
        cmd += [f"--import={name}" for name in modules]
        try:
            self._proc = subprocess.Popen(
                cmd,
                env=env,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            self.reaper.close()
            raise
        finally:
            theirs.close()
        self.reaper.add(self._proc.pid)
        self._reader = threading.Thread(target=self._read, daemon=True, name="ringtrain-pool")
        self._reader.start()

    @property
    def zygote_pid(self) -> int:
        return self._proc.pid

    @property
    def alive(self) -> bool:
        return self._alive and self._proc.poll() is None

    @property
    def reader_thread(self) -> threading.Thread:
        """The driver thread that reads the zygote's replies and exits (``ringtrain-pool``)."""
        return self._reader

    def helper_pids(self) -> set[int]:
        """The driver's children this pool holds: the zygote and the pool's reaper (while
        alive; the workers are the zygote's children)."""
        pids = {self._proc.pid} if self._proc.poll() is None else set()
        return pids | ({self.reaper.pid} if self.reaper.pid is not None else set())

    def spawn(
        self,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None = None,
        capture_output: bool = True,
        preload: Sequence[str] = (),
        program: str = "worker",
    ) -> PooledProcess:
        """Fork a worker running ``python -m ringtrain.launch.worker ARGV`` in ``env``.

        Args:
            argv: the worker bootstrap's arguments (``[]`` or ``["--script", path, ...]``), or
                the store's with ``program="store"``.
            env: the worker's whole environment.
            cwd: its working directory (default: the driver's).
            capture_output: give it stdout/stderr pipes (else it writes to the driver's).
            preload: modules the zygote imports first, unless it tried them already (it
                answers at once for those: a shared pool serves fits with different lists).
            program: ``"worker"`` (the worker bootstrap) or ``"store"`` (a run's rendezvous
                store, :mod:`ringtrain.launch.store_server`; see :meth:`host_store`).

        Raises:
            PoolUnavailable: if the zygote is gone or does not answer, or cannot fork (a
                module it imported started a thread: every later request is refused too).
        """
        if capture_output:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
        else:
            out_r = err_r = -1
            out_w, err_w = sys.stdout.fileno(), sys.stderr.fileno()
        request: dict[str, object] = {
            "argv": list(argv),
            "env": dict(env),
            "cwd": cwd or os.getcwd(),
            "preload": list(preload),
            "program": program,
        }
        try:
            pid = self._request(request, [out_w, err_w])
        except BaseException:
            if capture_output:
                for fd in (out_r, out_w, err_r, err_w):
                    os.close(fd)
            raise
        if capture_output:
            os.close(out_w)
            os.close(err_w)
        proc = PooledProcess(
            pid,
            os.fdopen(out_r, "rb") if capture_output else None,
            os.fdopen(err_r, "rb") if capture_output else None,
        )
        with self._reply_ready:
            code = self._early_exits.pop(pid, None)
            self._procs[pid] = proc
        if code is not None:
            proc._set_exit(code)
        return proc

    def host_store(
        self, host: str, world_size: int, env: Mapping[str, str], timeout_s: float = 60.0
    ) -> tuple[PooledProcess, int]:
        """Fork a process that hosts a run's rendezvous ``TCPStore`` on ``host`` (the zygote
        has torch imported already, so the driver need not import it for the store).

        Args:
            host: the address the store listens on (loopback for a local run).
            world_size: the number of workers (sizes the listen backlog).
            env: the process's whole environment (torch reads its ``TORCH_*`` variables).
            timeout_s: how long the store may take to listen (seconds).

        Returns:
            ``(process, port)``: the store's process (it leads its own process group; its
            stdout/stderr pipes carry whatever torch logs later: the caller drains them) and
            the port it listens on.

        Raises:
            PoolUnavailable: if the zygote cannot fork it, or it did not say its port within
                ``timeout_s`` (it is killed; its error output is in the message).
        """
        proc = self.spawn([host, str(world_size)], env, program="store")
        assert proc.stdout is not None and proc.stderr is not None
        try:
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            line = proc.stdout.readline().decode(errors="replace") if ready else ""
            word, _, port = line.partition(" ")
            if word == STORE_PORT_WORD and port.strip().isdigit():
                return proc, int(port)
        except BaseException:
            _kill_group(proc)
            raise
        _kill_group(proc)
        errors = proc.stderr.read().decode(errors="replace").strip()
        proc.stdout.close()
        proc.stderr.close()
        raise PoolUnavailable(
            "the rendezvous store forked from the worker pool's zygote did not start"
            + (f": {errors.splitlines()[-1]}" if errors else f" within {timeout_s:.0f} s")
        )

    def _request(self, request: dict[str, object], fds: list[int]) -> int:
        data = json.dumps(request).encode() + b"\n"
        with self._lock:
            if not self.alive:
                raise PoolUnavailable("the worker pool's zygote is not running")
            try:
                socket.send_fds(self._sock, [data], fds)
            except OSError as exc:
                raise PoolUnavailable(f"the worker pool's zygote is gone: {exc}") from exc
            deadline = time.monotonic() + _START_TIMEOUT_S
            with self._reply_ready:
                try:
                    while not self._replies:
                        if not self._alive or time.monotonic() > deadline:
                            raise PoolUnavailable("the worker pool's zygote did not answer")
                        self._reply_ready.wait(0.1)
                except BaseException:  # its reply must not answer the next request
                    if self._replies:
                        self._replies.pop(0)
                    else:
                        self._unclaimed += 1
                    raise
                pid = self._replies.pop(0)
        if pid <= 0:
            why = {_THREAD: "a thread was running in it", _CUDA: "CUDA was initialised in it"}
            raise PoolUnavailable(
                "the worker pool's zygote could not fork"
                + (
                    f" ({why[pid]} after its imports: if a module of "
                    "ScalingConfig.preload_modules does it, drop it)"
                    if pid in why
                    else ""
                )
            )
        return pid

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._dispatch(json.loads(line))
        with self._reply_ready:
            self._alive = False
            self._reply_ready.notify_all()
            orphans = list(self._procs.values())
        for proc in orphans:  # the zygote died: its children were killed with it
            if proc.returncode is None:
                proc._set_exit(-signal.SIGKILL)

    def _dispatch(self, msg: dict[str, int]) -> None:
        with self._reply_ready:
            if "pid" in msg and self._unclaimed:
                self._unclaimed -= 1  # nobody waits for that worker: it finds no driver, exits
                return
            if "pid" in msg:
                self._replies.append(int(msg["pid"]))
                self._reply_ready.notify_all()
                return
            pid, code = int(msg["exit"]), int(msg["code"])
            proc = self._procs.pop(pid, None)
            if proc is None:  # the exit overtook our bookkeeping of the reply
                self._early_exits[pid] = code
                return
        proc._set_exit(code)

    def close(self) -> None:
        """Stop the zygote (it SIGKILLs its children's groups) and the pool's reaper."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._sock.close()
        self._reader.join(timeout=5)
        self.reaper.discard(self._proc.pid)
        self.reaper.close()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
