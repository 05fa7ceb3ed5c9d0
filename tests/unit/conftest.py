"""The unit tier starts no process: pure logic, fakes and files, the whole tier in well under a
minute. The autouse guard below fails a unit test that starts one (a subprocess, a
multiprocessing or DataLoader worker, a fork), naming what it called: such a test belongs in
tests/multiprocess/ (real gloo workers) or tests/e2e/ (the CLI and examples)."""

from __future__ import annotations

import _posixsubprocess
import multiprocessing.process
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

_MOVE = "unit tests start no process; move this test to tests/multiprocess/ or tests/e2e/"


def _refuse(what: str, calls: list[str]) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        calls.append(what)
        # pytest.fail raises a BaseException: an ``except Exception`` in the code under test
        # does not swallow it (and the teardown check below catches one that does).
        pytest.fail(f"{_MOVE} (it called {what})", pytrace=True)

    return refused


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


_CALL_FAILED = pytest.StashKey[bool]()


@pytest.fixture(autouse=True, scope="session")
def _matplotlib_font_cache() -> None:
    """matplotlib builds its font cache on first use by running ``fc-list``: a process, which
    the guard below refuses. On a fresh machine (CI) the first chart test would fail for it, so
    the cache is built once here, before any test runs (a no-op where it exists)."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:
        pass


@pytest.fixture(autouse=True)
def _no_processes(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    calls: list[str] = []
    # subprocess.Popen (and so subprocess.run, os.popen, asyncio) and multiprocessing's spawn
    # and forkserver starts all end in _posixsubprocess.fork_exec; fork in os.fork.
    monkeypatch.setattr(subprocess, "_fork_exec", _refuse("subprocess.Popen", calls))
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refuse("a process spawn", calls))
    monkeypatch.setattr(os, "fork", _refuse("os.fork", calls))
    for name in ("system", "posix_spawn", "posix_spawnp", "spawnv", "spawnve", "execv", "execve"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refuse(f"os.{name}", calls))
    monkeypatch.setattr(
        multiprocessing.process.BaseProcess,
        "start",
        _refuse("multiprocessing Process.start", calls),
    )
    yield
    if request.node.stash.get(_CALL_FAILED, False):
        return  # the test failed already (most likely on the refusal itself)
    # A refusal that the code under test caught and swallowed:
    assert not calls, f"{_MOVE} (it called {', '.join(calls)})"
