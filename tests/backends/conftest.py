"""Fixtures of the backends tier (Ray, Lightning, browser, terminal, notebook): the Ray cluster
and the dashboard's headless Chromium."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from pages import CHROMIUM, WAIT_MS, Page, sync_playwright


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A head node and one worker node on this machine, 2 CPUs each; Ray initialised on it for
    the test module (a module may set ``RAY_HEAD_ARGS``, more ``add_node`` arguments of the
    head). It starts before the module's first test, so its processes predate every test's
    leak check."""
    ray = pytest.importorskip("ray", reason="the Ray tests need Ray: pip install 'ringtrain[ray]'")
    from ray_cluster import start_cluster

    c = start_cluster(getattr(request.module, "RAY_HEAD_ARGS", None))
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


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
