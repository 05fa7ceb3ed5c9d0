"""Network faults at W=3 on three namespace hosts, one Ray node each (tests/multihost/faults.py):
a lost host, a link that flaps for less than the heartbeat timeout, and a brown-out (the link at
1 Mbit/s, then back). Each run must end bit-identical to an uninterrupted run, with no process
left behind and no stray write; a lost host is detected within the timeout and the run restarts
on the hosts left; a flap and a brown-out (one after the other, in one run) cost no restart. (A
partition has its own test: test_partition.py.)"""

from __future__ import annotations

import pytest

from faults import TIMEOUT_S, run_with_fault
from test_ray_hosts import reference

pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")

pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    return reference(tmp_path_factory)  # the same job on local processes (computed once)


def _clean(outcome) -> None:
    assert outcome.victim is not None, outcome.output
    assert outcome.status == "FINISHED", outcome.output
    assert outcome.exact, outcome.summary()
    assert outcome.orphans == [], outcome.orphans
    assert outcome.split_brain == [], outcome.split_brain


def test_a_lost_host_is_detected_and_the_run_restarts_on_the_hosts_left(ray_bed, tmp_path, ref):
    outcome = run_with_fault(ray_bed, tmp_path, "host_loss", ref, save_on_error=0)
    _clean(outcome)
    assert outcome.restarts >= 1, outcome.summary()
    assert outcome.detect_s is not None and outcome.detect_s <= TIMEOUT_S + 1, outcome.summary()
    assert not any(kind == "hang" for kind, _ in outcome.failures), outcome.failures


def test_a_flap_shorter_than_the_timeout_then_a_brownout_cost_no_restart(ray_bed, tmp_path, ref):
    outcome = run_with_fault(ray_bed, tmp_path, "flap+brownout", ref, save_on_error=0)
    _clean(outcome)
    assert outcome.restarts == 0 and outcome.failures == [], outcome.summary()
