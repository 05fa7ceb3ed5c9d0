"""A tiny process that kills a local run's processes the moment the driver dies.

Why: each worker dies with the driver (``PR_SET_PDEATHSIG``), but that covers the worker only,
not the processes it started: DataLoader workers, a compile pool, a user's subprocess. Those
poll their parent every few seconds (DataLoader: 5 s) and so outlived a SIGKILLed driver by up to
12 s. The reaper closes that gap.

How: :class:`Reaper` starts ``python -I reaper.py TOKEN`` (this file as a script: standard library
only, no torch, about 30 ms to start) in its own session, with a pipe from the driver as its
stdin. The driver writes ``+PGID`` when it starts a worker (each worker leads its own process
group, which its DataLoader workers inherit) and ``-PGID`` once that group is dead. When the pipe
reaches end of file, which the kernel guarantees the instant the driver exits or is killed (or,
should a process the driver forked without exec still hold the pipe open, when the kernel sends
the reaper ``SIGUSR1`` as its parent dies: ``PR_SET_PDEATHSIG``), the reaper SIGKILLs every
process group still registered, then every process whose environment
carries ``RINGTRAIN_RUN_TOKEN=TOKEN`` (the launcher sets it in each worker's environment, and
children inherit it: this catches a process that left the group), repeating until none is left,
and exits. It holds nothing else and does nothing else.

Guarantee (tested in ``tests/test_process_hygiene.py``): after the driver dies by any means,
SIGKILL included, no process of the run is alive 1 s later. The run token is per worker group
(per attempt), so a reaper never touches another run's, or the next attempt's, processes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

TOKEN_ENV = "RINGTRAIN_RUN_TOKEN"
"""The environment variable that marks every process of one local worker group."""

_SWEEP_ROUNDS = 20  # a dying process may fork once more: sweep until nothing is found
_PR_SET_PDEATHSIG = 1


class Reaper:
    """The driver's handle on its reaper process.

    Args:
        token: the run token (hex); the launcher puts ``RINGTRAIN_RUN_TOKEN=token`` into each
            worker's environment (:meth:`environment`).

    Raises:
        OSError: if the reaper process cannot be started.
    """

    def __init__(self, token: str) -> None:
        self.token = token
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), token, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the driver's terminal does not reach it
            close_fds=True,
        )
        self._pipe: IO[bytes] | None = self._proc.stdin

    @property
    def pid(self) -> int | None:
        """The reaper process's pid, or ``None`` after :meth:`close`."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def environment(self) -> dict[str, str]:
        """The variables that mark a worker (and its children) as this run's."""
        return {TOKEN_ENV: self.token}

    def add(self, pgid: int) -> None:
        """Kill process group ``pgid`` if the driver dies (a worker's: ``pgid == pid``)."""
        self._send(f"+{pgid}\n")

    def discard(self, pgid: int) -> None:
        """Forget ``pgid``: the group is dead (its number may be reused)."""
        self._send(f"-{pgid}\n")

    def close(self, timeout_s: float = 5.0) -> None:
        """End the reaper as the driver's death would (it sweeps the run token once more, so a
        process that escaped its group does not survive a normal end either) and reap it."""
        with self._lock:
            pipe, proc, self._pipe, self._proc = self._pipe, self._proc, None, None
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()
        if proc is not None:
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._pipe is None:
                return
            try:
                self._pipe.write(line.encode())
                self._pipe.flush()
            except OSError:  # the reaper is gone: the workers' PDEATHSIG still covers them
                self._pipe = None


MP_TEMP_PREFIX = "pymp-ringtrain-"
"""How the name of a worker's :mod:`multiprocessing` temporary directory starts (then its pid)."""


def worker_temp_prefix(pid: int) -> str:
    """The name prefix of worker ``pid``'s multiprocessing temporary directory (a random
    suffix follows, as :func:`tempfile.mkdtemp` makes it)."""
    return f"{MP_TEMP_PREFIX}{pid}-"


def use_worker_temp_dir() -> str | None:
    """In a worker, before its train function: give this process a :mod:`multiprocessing`
    temporary directory that whoever reaps the worker can find and remove.

    Why: a process that passes tensors to another through torch's ``file_descriptor`` sharing
    (a DataLoader worker sending its batches) opens a listener socket in
    ``multiprocessing.util.get_temp_dir()``, a ``pymp-XXXXXXXX`` directory that an exit handler
    removes. A SIGKILLed worker (failure injection, a restart, the reaper) runs no exit handler,
    and neither do its DataLoader workers, killed with its process group: each left a
    ``/tmp/pymp-*`` directory behind (27 in one run of the test suite). Here the directory is
    made now, named :func:`worker_temp_prefix` of this pid (a worker leads its own process
    group: pid == pgid), and installed as this process's multiprocessing temp dir, which the
    processes it forks inherit (DataLoader workers; ``spawn``-started children make their own).
    :func:`remove_worker_temp_dir` removes it once the worker is dead.

    Returns:
        str | None: the directory's path (mode 0700, in :func:`tempfile.gettempdir`), or
        ``None`` if it cannot be made (no writable temp dir: multiprocessing then makes its own
        when, and if, it needs one, as without this).
    """
    import multiprocessing.process
    import tempfile

    try:
        path = tempfile.mkdtemp(prefix=worker_temp_prefix(os.getpid()))
    except OSError:
        return None
    # multiprocessing.util.get_temp_dir() caches its directory under this key (CPython 3.4+).
    multiprocessing.process.current_process()._config["tempdir"] = path  # type: ignore[attr-defined]
    return path


def remove_worker_temp_dir(pid: int, env: Mapping[str, str] | None = None) -> None:
    """Remove the directory :func:`use_worker_temp_dir` made in worker ``pid``, once that
    worker and its process group are dead. Looks in this process's temp dir and, given the
    worker's environment ``env``, in the one its ``TMPDIR``/``TEMP``/``TMP`` named. Only
    directories (never a symbolic link) owned by this user are removed; never raises."""
    import glob
    import shutil
    import stat
    import tempfile

    bases = {tempfile.gettempdir()}
    for name in ("TMPDIR", "TEMP", "TMP"):
        if env and env.get(name):
            bases.add(env[name])
            break
    pattern = glob.escape(worker_temp_prefix(pid)) + "*"
    for base in bases:
        for path in glob.glob(os.path.join(glob.escape(base), pattern)):
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                shutil.rmtree(path, ignore_errors=True)


def wait_unreaped(pid: int) -> None:
    """Block until child ``pid`` has exited, without reaping it: until it is reaped its pid
    (the number of its process group) cannot be given to another process, so killing the group
    then is safe. Returns at once if it was already reaped; a no-op where ``os.waitid`` is
    missing (macOS)."""
    waitid = getattr(os, "waitid", None)
    if waitid is None:
        return
    with contextlib.suppress(ChildProcessError):
        waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


# ---------------------------------------------------------------------- the reaper process


def _marked(token: str) -> list[int]:
    """Pids (not this one) whose environment holds ``RINGTRAIN_RUN_TOKEN=token``."""
    needle = f"{TOKEN_ENV}={token}".encode()
    found = []
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []  # no /proc (not Linux): the process groups are all there is
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone, or another user's
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry))
    return found


def _reap(groups: set[int], token: str) -> None:
    for pgid in groups:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    for _ in range(_SWEEP_ROUNDS):
        alive = [pid for pid in _marked(token) if _running(pid)]
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
    for pgid in groups:  # each group led by a worker: its multiprocessing temp dir
        remove_worker_temp_dir(pgid)


def _running(pid: int) -> bool:
    """Not yet dead (a zombie is dead; it waits only for its parent to reap it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class _DriverDied(Exception):
    """Raised by the parent-death signal: the driver is gone though the pipe is still open (a
    process the driver forked without exec holds a copy of its end)."""


_reaping = [False]  # once True, the parent-death signal is ignored (the reap is under way)


def _on_parent_death(signum: int, frame: object) -> None:
    # Both triggers fire when the driver is SIGKILLed: EOF on the pipe and this signal. Raising
    # after EOF was seen would abort the reap half-way (the process groups killed, the token
    # sweep not done: a child that left its worker's group survived, 2 runs in 5).
    if not _reaping[0]:
        raise _DriverDied


def _apply(buf: bytes, groups: set[int]) -> bytes:
    """Apply the complete ``+PGID``/``-PGID`` lines of ``buf``; return the incomplete rest.
    Applying the same lines twice gives the same set (the last line on a pgid wins)."""
    *lines, rest = buf.split(b"\n")
    for line in lines:
        if not line[1:].isdigit():
            continue
        pgid = int(line[1:])
        if line[:1] == b"+" and pgid > 1:
            groups.add(pgid)
        elif line[:1] == b"-":
            groups.discard(pgid)
    return rest


def _die_with_driver(driver: int) -> None:
    """Second trigger besides end of file: SIGUSR1 when the driver dies (Linux)."""
    signal.signal(signal.SIGUSR1, _on_parent_death)
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() != driver:  # it died before prctl took effect
        raise _DriverDied


def _main(argv: list[str]) -> int:
    token, driver = argv[1], int(argv[2])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # only the driver's end ends it
    groups: set[int] = set()
    buf = b""
    try:
        _die_with_driver(driver)
        while chunk := os.read(0, 65536):  # blocks until the driver writes, or exits
            buf = _apply(buf + chunk, groups)
        _reaping[0] = True
    except _DriverDied:  # read what the driver wrote before it died, without waiting
        _reaping[0] = True
        os.set_blocking(0, False)
        with contextlib.suppress(OSError):
            while chunk := os.read(0, 65536):
                buf = _apply(buf + chunk, groups)
    _reap(groups, token)  # (an incomplete last line is not trusted: a pgid cut short)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
