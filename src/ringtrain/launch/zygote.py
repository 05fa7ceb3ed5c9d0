"""The warm pool's zygote: ``python -m ringtrain.launch.zygote FD [--no-preload] [--import=M]...``.

Started by :class:`ringtrain.launch.pool.WorkerPool` (the protocol is described there). It
imports what a worker's first DDP step needs, then serves fork requests on the inherited socket
``FD`` in one thread: no torch op, no thread, so a fork is safe. Nothing in ringtrain imports this
module; it runs only as a program.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
from collections.abc import Callable, Mapping

from ringtrain.launch.reaper import remove_worker_temp_dir

_MAX_MSG = 1 << 20


def _preload() -> None:
    """What a worker's first DDP step imports, imported once here (no op run, no thread)."""
    import torch
    import torch.distributed
    import torch.nn.parallel

    with contextlib.suppress(ImportError):
        import torch._dynamo  # noqa: F401
    import cloudpickle  # noqa: F401

    import ringtrain.launch.worker
    import ringtrain.worker.session  # noqa: F401


def _fork_blocker() -> int:
    """0 when a child forked now can be a worker; else why not, the zygote's answer instead of
    a pid: :data:`_THREAD`, a Python thread runs here besides this one (a fork would copy the
    locks it holds), or :data:`_CUDA`, a child could not use CUDA.

    CUDA: a process that initialised the CUDA driver (``cuInit``) cannot fork children that use
    it; torch marks such children "in bad fork" and their first CUDA call raises "Cannot
    re-initialize CUDA in forked subprocess". ``torch.cuda.is_available()`` itself calls
    ``cuInit`` (unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which :func:`_main` sets here), so
    this check never calls it: it asks a forked probe whether torch considers it in bad fork
    (torch's own answer, whatever imported module touched CUDA). A CPU-only torch build has no
    such state and needs no probe."""
    import threading

    if threading.active_count() != 1:
        return _THREAD
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    if torch.cuda.is_initialized():
        return _CUDA
    return 0 if _child_cuda_ok(getattr(torch._C, "_cuda_isInBadFork", None)) else _CUDA


def _child_cuda_ok(in_bad_fork: Callable[[], bool] | None) -> bool:
    """Fork a probe that exits 0 unless ``in_bad_fork()`` is true in it (``None``: no CUDA in
    this torch build, nothing to probe)."""
    if in_bad_fork is None:
        return True
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 1 if in_bad_fork() else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


# The answers instead of a pid once forking stopped (launch/pool.py's _THREAD and _CUDA).
_THREAD = -2  # a Python thread runs in the zygote
_CUDA = -3  # a forked child could not use CUDA


def _import_more(names: list[str], tried: set[str]) -> bool:
    """Import each module of ``names`` not tried before (a run's preloaded modules). One that
    fails is left to the worker, which raises its own error if it imports it. Returns whether
    any was new (then :func:`_fork_blocker` must be asked again: an import may start a thread or
    touch CUDA; the zygote then stops forking and the driver starts its workers cold)."""
    import importlib

    new = [name for name in dict.fromkeys(names) if name not in tried]
    for name in new:
        tried.add(name)
        try:
            importlib.import_module(name)
        except Exception as exc:  # the worker's own import shows the error, with its rank
            print(f"ringtrain zygote: could not preload {name}: {exc!r}", file=sys.stderr)
    return bool(new)


def _child(sock: socket.socket, request: dict[str, object], fds: list[int], ready: int) -> None:
    """In the forked child: become the worker (or, for ``"program": "store"``, a run's
    rendezvous store: :mod:`ringtrain.launch.store_server`) and never return. ``ready``: a pipe
    written once this process leads its own session, so its pid is a process group when the
    driver hears it."""
    code = 1
    try:
        sock.close()
        os.setsid()
        os.write(ready, b"s")
        os.close(ready)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote ignores it; a worker acts on it
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        _fresh_random_state()
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        os.chdir(str(request["cwd"]))
        raw_argv = request["argv"]
        assert isinstance(raw_argv, list)
        argv = [str(a) for a in raw_argv]
        sys.argv = [sys.argv[0], *argv]
        if request.get("program") == "store":
            from ringtrain.launch import store_server

            store_server.main(argv)  # returns never: killed when its group stops
        else:
            from ringtrain.launch import worker
            from ringtrain.worker import preempt as preempt_worker

            # This worker's launchers, its SIGTERM means "stop now": this zygote and the driver.
            preempt_worker.set_launchers(frozenset({os.getppid(), _driver}))
            sys.stdout.flush()
            code = worker.main(argv)
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _fresh_random_state() -> None:
    """Seed the forked child's global random streams from the OS's entropy, as a freshly
    started process's are: a fork copies the zygote's torch generator and NumPy's global
    ``RandomState``, which would give every worker of a run (and of every run) the same
    unseeded draws (data order, augmentation, dropout masks, weight initialisation, DataLoader
    worker seeds). Python reseeds ``random`` at a fork itself; it is reseeded here too, so that
    all three are seen to. CUDA's generators get a fresh seed lazily (CUDA is not initialised
    here). The user's own seeding, and ``TrainState.restore``'s saved streams, come later and
    win."""
    import random

    random.seed()
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # CPU now; CUDA, MPS, XPU queued until their lazy initialisation
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # the legacy global RandomState, from the OS's entropy


def _reap(sock: socket.socket, children: dict[int, Mapping[str, str]]) -> None:
    """Report every ended child (after SIGKILLing its process group: DataLoader workers, and
    removing its multiprocessing temp dir). ``children``: each live child's environment."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(info.si_pid, signal.SIGKILL)
        remove_worker_temp_dir(info.si_pid, children.get(info.si_pid))  # before its pid is free
        _, status = os.waitpid(info.si_pid, 0)
        children.pop(info.si_pid, None)  # reaped: its number may be reused now
        code = os.waitstatus_to_exitcode(status)
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps({"exit": info.si_pid, "code": code}).encode() + b"\n")


def _serve(sock: socket.socket, tried: set[str], blocked: int) -> None:
    """Answer fork requests until the driver closes the channel. ``tried``: the modules
    imported (or tried) so far; ``blocked``: :func:`_fork_blocker`'s answer (0: forking), given
    instead of a pid once not 0."""
    buf = b""
    children: dict[int, Mapping[str, str]] = {}
    pending: list[int] = []  # the descriptors of the request being read
    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        _reap(sock, children)
        if not ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 4)
        if not data:
            break
        buf += data
        pending += fds
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            request = json.loads(line)
            preload = request.get("preload") or []
            names = [str(name) for name in preload] if isinstance(preload, list) else []
            if not blocked and _import_more(names, tried):
                blocked = _fork_blocker()
            pid = blocked or _fork(sock, request, pending[:2], children)
            for fd in pending[:2]:
                os.close(fd)
            pending = pending[2:]
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    for pid, env in children.items():  # the driver closed the channel: the run is over
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        remove_worker_temp_dir(pid, env)  # (not reaped yet: the pid is still the worker's)
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break


def _fork(
    sock: socket.socket,
    request: dict[str, object],
    fds: list[int],
    children: dict[int, Mapping[str, str]],
) -> int:
    """Fork the worker of ``request``; its pid once it leads its own session."""
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _child(sock, request, fds, ready_w)
    os.close(ready_w)
    # Reply once the child has its own session: a killpg(pid) right after spawn (stopping a
    # group that just started) then reaches it (EOF if the child died first).
    os.read(ready_r, 1)
    os.close(ready_r)
    env = request.get("env")
    children[pid] = env if isinstance(env, dict) else {}
    return pid


_driver = 0  # the driver's pid (this zygote's parent), for the children's signal watch


def _main(argv: list[str]) -> int:
    global _driver
    _driver = os.getppid()
    sock = socket.socket(fileno=int(argv[0]))
    _pdeathsig()
    # SIGTERM to every process of a job (a node going away, a container being stopped) is a
    # preemption notice for the driver and the workers; the zygote, whose default action would
    # be to die and so SIGKILL its workers (their PR_SET_PDEATHSIG) before they could save,
    # ignores it. It still ends with the driver: PR_SET_PDEATHSIG, or its channel closing.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # Any torch.cuda.is_available() an import below calls asks NVML, not cuInit, so it does not
    # stop this process from forking GPU workers (each child's environment replaces this one).
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    if "--no-preload" not in argv:
        _preload()
    tried: set[str] = set()
    _import_more([a.split("=", 1)[1] for a in argv[1:] if a.startswith("--import=")], tried)
    _serve(sock, tried, _fork_blocker())
    # Every child is reaped and nothing is buffered: leave without the interpreter's
    # finalisation, which with torch loaded took 3-6 s on a loaded 2-core machine, all of it
    # added to the end of every run (the driver waits for the zygote in WorkerPool.close).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _pdeathsig() -> None:
    """Die with the driver (no watchdog thread: the zygote forks and must stay single-threaded;
    the closed channel ends it too)."""
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
