"""Fixtures of the backends tier (Ray, Lightning, browser, terminal, notebook): the Ray cluster
and the dashboard's headless Chromium."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pages import CHROMIUM, WAIT_MS, Page, sync_playwright

_HERE = Path(__file__).resolve().parent

# The Ray cluster the Ray modules of this tier share (see ``cluster``); None between them.
_shared: dict[str, Any] = {"cluster": None}


def _shared_cluster() -> Any:
    """The shared two-node cluster: started at its first use, its worker node replaced if the
    module before removed or drained it (``ray_cluster.restore_worker_node``)."""
    from ray_cluster import SHARED_HEAD_ARGS, restore_worker_node, start_cluster

    if _shared["cluster"] is None:
        _shared["cluster"] = start_cluster(SHARED_HEAD_ARGS)
    else:
        restore_worker_node(_shared["cluster"])
    return _shared["cluster"]


def _stop_shared_cluster() -> None:
    c, _shared["cluster"] = _shared["cluster"], None
    if c is not None:
        import ray

        ray.shutdown()  # a module whose set-up failed may have left its connection
        c.shutdown()


def _uses_shared_cluster(item: pytest.Item | None) -> bool:
    """Whether ``item`` is a test of this tier in the "ray" xdist group (the shared cluster's
    users run one after another on one pytest worker: pyproject addopts' ``--dist loadgroup``)."""
    if item is None or _HERE not in item.path.parents:
        return False
    group = item.get_closest_marker("xdist_group")
    return group is not None and (list(group.args) or [group.kwargs.get("name")])[0] == "ray"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Stop the shared Ray cluster after the last of the tier's Ray tests that run in a row: a
    Ray instance left running would be found by another test's ``ray.init()`` (Ray writes the
    cluster's address to /tmp/ray/ray_current_cluster) and would cost the session CPU."""
    yield
    if not _uses_shared_cluster(nextitem):
        _stop_shared_cluster()


def pytest_sessionfinish() -> None:
    _stop_shared_cluster()  # a session that ended early (-x, a Ctrl-C) stops it too


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A head and one worker node on this machine, 2 CPUs each (the head with a dashboard: the
    state API needs it); Ray initialised on it for the test module, which starts with nothing
    of another module's left on it (``assert_torn_down``). The Ray modules share one cluster,
    started once (each start is seconds of CPU) and stopped after the last of them; a worker
    node that a module removed or drained is replaced before the next module. A module may set
    ``RAY_HEAD_ARGS`` (more ``add_node`` arguments of the head, e.g. ``_system_config``): it
    gets a cluster of its own. The cluster starts before the module's first test, so its
    processes predate every test's leak check."""
    ray = pytest.importorskip("ray", reason="the Ray tests need Ray: pip install 'ringtrain[ray]'")
    from ray_cluster import assert_torn_down, start_cluster

    head_args = getattr(request.module, "RAY_HEAD_ARGS", None)
    own = start_cluster(head_args) if head_args is not None else None
    c = own if own is not None else _shared_cluster()
    ray.init(address=c.address, log_to_driver=False)
    try:
        assert_torn_down()
    except BaseException:
        ray.shutdown()
        raise
    yield c
    ray.shutdown()
    if own is not None:
        own.shutdown()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, for the test module (skips without it or playwright)."""
    if sync_playwright is None or not os.path.exists(CHROMIUM):
        pytest.skip("needs playwright and /usr/bin/chromium: sudo apt-get install chromium")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], headless=True)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    """A fresh browser context and page per test; fails the test on a JavaScript error."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    pg.set_default_timeout(WAIT_MS)
    yield pg
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
