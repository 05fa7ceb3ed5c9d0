"""The multi-host tier: hosts made of network namespaces on a private bridge
(:mod:`ringtrain.testing.netbed`), with one Ray node each where a test needs Ray
(:mod:`ringtrain.testing.raybed`). It needs root (CI runs as root); elsewhere every test skips
and says why. Each bed is torn down when its test ends, and a bed left by a killed run is swept
by the next one (:func:`ringtrain.testing.netbed.sweep`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ringtrain.testing.netbed import NetBed, unavailable
from ringtrain.testing.raybed import RayBed

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:
    sys.path.insert(0, str(_HERE))

_WHY = unavailable()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _WHY is None:
        return
    skip = pytest.mark.skip(reason=f"the multi-host tier cannot run here: {_WHY}")
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(skip)


@pytest.fixture
def bed() -> Iterator[NetBed]:
    """Two hosts, h1 (10.77.0.1) and h2 (10.77.0.2), no Ray."""
    with NetBed(hosts=2) as made:
        yield made


# The session's Ray bed (see ``ray_bed``); None before its first user and after its last.
_shared: dict[str, Any] = {"stack": None, "ray_bed": None}


def _shared_ray_bed() -> RayBed:
    if _shared["ray_bed"] is None:
        with contextlib.ExitStack() as stack:
            made = stack.enter_context(NetBed(hosts=3))
            _shared["ray_bed"] = stack.enter_context(RayBed(made, cpus=2, token_auth=True))
            _shared["stack"] = stack.pop_all()  # kept up past this block
    return _shared["ray_bed"]


def _stop_ray_bed() -> None:
    stack, _shared["stack"], _shared["ray_bed"] = _shared["stack"], None, None
    if stack is not None:
        stack.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Tear the Ray bed down after the last of the tests that use it in a row (they run one
    after another on one pytest worker: the "ray" xdist group): an idle bed of three Ray nodes
    costs about a third of a core, which the rest of the session would pay."""
    yield
    if nextitem is None or "ray_bed" not in getattr(nextitem, "fixturenames", ()):
        _stop_ray_bed()


def pytest_sessionfinish() -> None:
    _stop_ray_bed()  # a session that ended early (-x, a Ctrl-C) tears it down too


@pytest.fixture
def ray_bed() -> RayBed:
    """Three hosts, h1-h3 (10.77.0.1-3), one Ray node each with 2 CPUs (a 3-worker SPREAD job
    has one worker per host, and a host's worth of spare capacity for a restart without it);
    the Ray head on h1. Ray 2.60's token authentication is on, as on a cluster whose nodes
    have ``~/.ray/auth_token`` (a ``HOME`` of the bed's own: the machine's is not touched);
    Ray's defaults otherwise, as a user's cluster has them. Shared by the tests that use it in
    a row (its start is most of a short test's time), torn down after the last of them: a
    test that loses a host's node starts it again (``faults.revive``)."""
    return _shared_ray_bed()


@pytest.fixture
def lost_hosts(ray_bed: RayBed) -> Iterator[list]:
    """Hosts a test cut off or lost (append them): when it ends, pass or fail, each is healed
    and its Ray node started again, so that the session's next test has three nodes."""
    from faults import revive

    hosts: list = []
    yield hosts
    for host in hosts:
        if ray_bed.bed.is_cut(host):
            ray_bed.bed.heal(host)
        revive(ray_bed, host)
