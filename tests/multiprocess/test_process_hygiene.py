"""No process of a local run outlives its driver by more than 1 s, on any exit path.

A driver process runs ``rt.Trainer`` with 2 workers, each iterating a ``DataLoader`` with 2
worker processes, and rank 0 starts a ``sleep`` in a session of its own, out of its process group
(so 9 processes: driver, reaper, 2 workers, 4 loader workers, 1 escaped). The test marks
the driver's environment with a fresh token, so every process of the run carries it (found by
reading ``/proc/*/environ``; the test's mark, not ringtrain's). The driver ends by SIGKILL,
Ctrl-C (SIGINT), a normal end, or an error; 1.0 s after the test has seen it exit, no marked
process may be alive (zombies are dead). Before this, a SIGKILLed driver left the loader workers
alive for up to 12 s: ``PR_SET_PDEATHSIG`` covered the workers, not their children.

And a single worker SIGKILLed mid-run (as a chaos test does): its loader workers are dead within
1 s of it, and the next attempt starts without them.

Files too: each worker's multiprocessing temp dir (where its loader workers open their listener
sockets) is removed once the worker is dead, on every path above: by the zygote that forked it,
by the driver for a cold worker (the error exit runs cold workers), by the reaper when the driver
was SIGKILLed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

import hygiene_workloads
import ringtrain as rt
from ctrl_c import AS_AT_A_TERMINAL, ctrl_c_driver, sigint_ignored
from support import pid_alive, pids_with_environ, wait_until

# Process hygiene of a run as a user runs it: each fit starts (and ends) its own warm pool.
pytestmark = pytest.mark.own_pool

MARK = "RT_HYGIENE_TEST"
GRACE_S = 1.0  # the requirement: nothing of the run alive 1 s after the driver is gone

_DRIVER = AS_AT_A_TERMINAL + textwrap.dedent(
    """
    import sys, hygiene_workloads, ringtrain as rt
    rt.Trainer(hygiene_workloads.loader_fn,
               rt.ScalingConfig(num_workers=2, warm_start=sys.argv[4] == "warm"),
               rt.RunConfig(name="hygiene", storage_path=sys.argv[1], progress="off"),
               train_loop_config={"pid_dir": sys.argv[2], "mode": sys.argv[3]}).fit()
    """
)


def _marked(token: str) -> list[int]:
    """Live (non-zombie) processes whose environment holds ``MARK=token``."""
    return pids_with_environ(f"{MARK}={token}".encode(), whole_entry=True)


def _describe(pids: list[int]) -> str:
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:100]
        except OSError:
            cmd = "?"
        out.append(f"{pid}: {cmd}")
    return "; ".join(out)


def _records(pid_dir, attempt: int = 0) -> dict[int, dict]:
    found = {}
    for rank in (0, 1):
        path = pid_dir / f"rank{rank}.attempt{attempt}.json"
        if path.exists():
            found[rank] = json.loads(path.read_text())
    return found


def _start_driver(tmp_path, mode: str, start: str = "warm"):
    """The driver process, once both workers iterate their loaders (each with 2 workers);
    ``start``: ``"warm"`` (workers forked by the warm pool's zygote) or ``"cold"``."""
    token = uuid.uuid4().hex
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, *sys.path]), **{MARK: token})
    driver = subprocess.Popen(  # with SIGINT ignored, as a backgrounded session's child
        ctrl_c_driver(_DRIVER, str(tmp_path / "runs"), str(pid_dir), mode, start),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if not wait_until(lambda: len(_records(pid_dir)) == 2, timeout_s=120):
        driver.kill()
        driver.wait()
        raise AssertionError(
            f"the driver's workers did not start their loaders within 120 s ({mode})"
        )
    return driver, pid_dir, token


def _assert_nothing_left(token: str, exited_at: float, how: str) -> None:
    """At ``GRACE_S`` after ``exited_at`` no marked process is alive."""
    time.sleep(max(0.0, exited_at + GRACE_S - time.monotonic()))
    left = _marked(token)
    if left:
        later = wait_until(lambda: not _marked(token), timeout_s=20)
        pytest.fail(
            f"{how}: processes of the run alive {GRACE_S} s after the driver exited: "
            f"{_describe(left)} ({'gone' if later else 'still alive'} 20 s later)"
        )


def _assert_temp_dirs_removed(records: list[dict]) -> None:
    """Each worker's multiprocessing temp dir, where its loader workers had a listener socket,
    is gone (``launch/reaper.py``: a SIGKILLed process's exit handlers never remove theirs; each
    such run left one ``/tmp/pymp-*`` directory per worker before)."""
    temps = [r["mp_temp"] for r in records]
    assert wait_until(lambda: not any(map(os.path.exists, temps)), timeout_s=10), [
        t for t in temps if os.path.exists(t)
    ]


def _check_temp_dirs(records: dict[int, dict]) -> None:
    """The setup holds: each worker's temp dir is its own, named by its pid, and its loader
    workers opened their listener sockets there."""
    for r in records.values():
        assert os.path.basename(r["mp_temp"]).startswith(f"pymp-ringtrain-{r['pid']}-"), r
        assert any(f.startswith("listener-") for f in r["mp_temp_files"]), r


@pytest.mark.parametrize(
    ("mode", "how", "start"),
    [
        ("hang", signal.SIGKILL, "warm"),
        ("hang", signal.SIGINT, "warm"),
        ("finish", None, "warm"),
        ("error", None, "cold"),
    ],
    ids=["driver-sigkill", "driver-ctrl-c", "normal-end", "error-exit-cold-workers"],
)
def test_nothing_outlives_the_driver(tmp_path, mode, how, start):
    driver, pid_dir, token = _start_driver(tmp_path, mode, start)
    try:
        records = _records(pid_dir)
        assert all(len(r["loaders"]) == 2 for r in records.values()), records  # the setup holds
        _check_temp_dirs(records)
        if mode == "hang":  # driver, reaper, 2 workers, 4 loader workers, 1 escaped
            assert len(_marked(token)) >= 9, _describe(_marked(token))
        if how is not None:
            assert not sigint_ignored(driver.pid)  # as a foreground job (tests/ctrl_c.py)
            driver.send_signal(how)
        driver.wait(timeout=120)
        exited_at = time.monotonic()
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    label = f"driver {how.name}" if how is not None else mode
    _assert_nothing_left(token, exited_at, label)
    _assert_temp_dirs_removed(list(records.values()))
    if mode == "finish":
        assert driver.returncode == 0
    if mode == "error":
        assert driver.returncode != 0


def test_a_killed_workers_loaders_die_with_it(tmp_path):
    """Rank 1 SIGKILLs itself in the first attempt: its loader workers are dead within 1 s of it
    (watched from here, while the driver is still handling the failure), and the run restarts
    and finishes."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    seen: dict[str, object] = {}

    def watch() -> None:
        if not wait_until(lambda: 1 in _records(pid_dir), timeout_s=120, interval_s=0.01):
            return
        record = _records(pid_dir)[1]
        seen["loaders"] = record["loaders"]
        if not wait_until(lambda: not pid_alive(record["pid"]), timeout_s=60, interval_s=0.005):
            return
        died = time.monotonic()
        wait_until(lambda: not any(map(pid_alive, record["loaders"])), GRACE_S * 3, 0.005)
        seen["after_s"] = time.monotonic() - died
        seen["left"] = [p for p in record["loaders"] if pid_alive(p)]

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    result = rt.Trainer(
        hygiene_workloads.loader_fn,
        rt.ScalingConfig(num_workers=2),
        rt.RunConfig(
            name="killed",
            storage_path=str(tmp_path / "runs"),
            progress="off",
            failure_config=rt.FailureConfig(max_failures=1),
        ),
        train_loop_config={"pid_dir": str(pid_dir), "mode": "kill_worker"},
    ).fit()
    watcher.join(timeout=30)
    assert result.error is None, result.error
    assert [f.kind for f in result.failures] == ["signal"] and result.failures[0].rank == 1
    assert len(seen.get("loaders", [])) == 2, seen
    assert "left" in seen, f"the watcher did not see rank 1 die: {seen}"
    assert not seen["left"], f"loader workers {seen['left']} outlived their SIGKILLed worker"
    assert seen["after_s"] <= GRACE_S, seen
    assert set(_records(pid_dir, attempt=1)) == {0, 1}  # the next attempt ran
    _check_temp_dirs(_records(pid_dir))
    # rank 1's SIGKILLed first attempt included: its zygote removed each worker's temp dir
    _assert_temp_dirs_removed([*_records(pid_dir).values(), *_records(pid_dir, 1).values()])


_FORKING_DRIVER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from ringtrain.launch.reaper import Reaper
    group = subprocess.Popen(["sleep", "600"], start_new_session=True)  # as a worker's group
    reaper = Reaper(sys.argv[1])
    reaper.add(group.pid)
    if os.fork() == 0:  # forked without exec: holds a copy of the reaper's pipe
        time.sleep(600)
        os._exit(0)
    time.sleep(0.5)  # the reaper's Python is up
    print(group.pid, flush=True)
    time.sleep(600)
    """
)


def test_the_reaper_fires_even_if_a_fork_of_the_driver_holds_its_pipe(tmp_path):
    """End of file never comes while a process the driver forked (without exec) holds the pipe:
    the parent-death signal fires the reaper instead."""
    token = uuid.uuid4().hex
    env = dict(os.environ, **{MARK: token})
    driver = subprocess.Popen(
        [sys.executable, "-c", _FORKING_DRIVER, token], env=env, stdout=subprocess.PIPE
    )
    try:
        assert driver.stdout is not None
        group = int(driver.stdout.readline())
        assert pid_alive(group)
        driver.kill()
        driver.wait(timeout=30)
        time.sleep(GRACE_S)
        assert not pid_alive(group), "the registered process group outlived the driver by 1 s"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for pid in _marked(token):  # the forked holder (not the run's: the test's to clean)
            os.kill(pid, signal.SIGKILL)


def test_stopping_a_group_ends_a_frozen_worker_with_its_sigterm(tmp_path):
    """A SIGSTOPped worker (a hang, or ``ringtrain chaos``) acts on nothing until continued:
    ``stop()`` continues it after SIGTERM, so it ends by that SIGTERM, not by the SIGKILL that
    follows the grace period (which every restart after a frozen rank used to wait for)."""
    from ringtrain.launch.base import WorkerSpec
    from ringtrain.launch.local import LocalWorkerGroup

    script = tmp_path / "freeze.py"
    script.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)\n")
    group = LocalWorkerGroup(
        WorkerSpec(world_size=1, run_dir=str(tmp_path), script=str(script)),
        forward_output=False,
    )
    proc = group._procs[0]

    def frozen() -> bool:
        with open(f"/proc/{proc.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"

    try:
        assert wait_until(frozen, timeout_s=120)
    finally:
        group.stop(grace_s=300)
    assert proc.returncode is not None and proc.returncode != -signal.SIGKILL
