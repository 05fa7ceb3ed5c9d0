"""Fixtures of the backends tier (Ray, Lightning, browser, terminal, notebook)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


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
