"""The processes of one campaign run: its driver, and everything tagged with its marker.

Every process of a run (the driver, its workers, their data loader workers) carries the
environment variable ``RINGTRAIN_CHAOS_TAG=<tag>``, inherited from the driver the campaign starts.
Workers start in sessions of their own, so a process group does not reach them; the tag in
``/proc/PID/environ`` does. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ringtrain.launch.reaper import remove_worker_temp_dir

TAG_ENV = "RINGTRAIN_CHAOS_TAG"


@dataclass(frozen=True)
class Orphan:
    """A process of a run found alive after its driver ended."""

    pid: int
    cmdline: str

    def to_dict(self) -> dict[str, object]:
        return {"pid": self.pid, "cmdline": self.cmdline}


def tagged(tag: str) -> list[Orphan]:
    """The live (non-zombie) processes whose environment holds ``RINGTRAIN_CHAOS_TAG=tag``."""
    marker = f"{TAG_ENV}={tag}".encode()
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            if marker not in env:
                continue
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            if state in ("Z", "X"):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append(Orphan(int(entry), cmdline[:200]))
    return found


def kill_tagged(tag: str, rounds: int = 3) -> None:
    """SIGKILL every process of the run (a SIGSTOPped one too), until none is left; then remove
    the multiprocessing temp dirs of the workers among them (their reaper was killed too)."""
    killed: set[int] = set()
    for _ in range(rounds):
        procs = tagged(tag)
        if not procs:
            break
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.add(p.pid)
            except OSError:
                pass
        time.sleep(0.2)
    for pid in killed:
        remove_worker_temp_dir(pid)


def start_driver(spec_path: str, tag: str, log_path: str) -> subprocess.Popen[bytes]:
    """Start ``python -m ringtrain.chaos.driver SPEC`` with the run's tag, its output appended
    to ``log_path``, in a session of its own (a terminal's Ctrl-C goes to the campaign, which
    then stops the run)."""
    env = dict(os.environ)
    env[TAG_ENV] = tag
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in sys.path if p] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "ringtrain.chaos.driver", spec_path],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def wait_driver(
    proc: subprocess.Popen[bytes], deadline: Callable[[], float], tick: object = None
) -> int | None:
    """Wait for the driver until ``deadline()`` (``time.monotonic()``; asked again about twice
    a second, so it may move); its exit code, or None when the deadline passed. ``tick`` (a
    callable) is called about twice a second."""
    while True:
        left = deadline() - time.monotonic()
        if left <= 0:
            return None
        try:
            return proc.wait(timeout=min(0.5, left))
        except subprocess.TimeoutExpired:
            if callable(tick):
                tick()
