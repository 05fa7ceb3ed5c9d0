"""A Ray node drain is a preemption notice (issue 19), on a real two-node Ray cluster started on
this machine (``ray.cluster_utils.Cluster``, as in test_ray.py).

The test drains the worker node through the GCS, as the autoscaler does for a spot reclaim
(``DrainNode`` with reason ``DRAIN_NODE_REASON_PREEMPTION`` and a deadline). The workload is
``workloads.elastic_fn`` (2 workers spread over the two nodes): after step ``NOTICE_STEP`` rank 0
creates a file, the test then drains the node, and every rank waits for the driver's answer, so
the stop step is the next one however loaded the machine. The run ends ``PREEMPTED`` with the
checkpoint of the stop step; no step is lost. The draining node is gone after the test (Ray
stops a drained node once it is idle): the shared cluster (tests/backends/conftest.py) replaces
it before the next module.
"""

from __future__ import annotations

import threading
import time

import pytest

import workloads

ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")

from ringtrain.launch.ray_drain import RayDrainNotice  # noqa: E402
from support import read_events as _events  # noqa: E402
from support import read_jsonl_dir as _records  # noqa: E402
from support import run_job  # noqa: E402

# One local Ray cluster at a time: the Ray tests share one pytest worker (pyproject addopts).
pytestmark = pytest.mark.xdist_group("ray")

NOTICE_STEP = 4
STOP_STEP = NOTICE_STEP + 1


def _drain(address: str, node_id: str, deadline_s: int) -> None:
    """Ask the GCS to drain ``node_id`` for a preemption (what ``ray drain-node`` does)."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address)
    deadline_ms = int(time.time() * 1000) + deadline_s * 1000
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, why = gcs.drain_node(node_id, reason, "spot reclaim (test)", deadline_ms)
    assert accepted, why


@pytest.mark.timeout(300)
def test_draining_a_node_preempts_the_run_at_one_step(cluster, tmp_path):
    head = ray.get_runtime_context().get_node_id()
    (other,) = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    flag = tmp_path / "notice"
    drained = threading.Event()

    def drain_when_asked() -> None:
        deadline = time.monotonic() + 240
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if flag.exists():
            _drain(cluster.address, other, deadline_s=120)
            drained.set()

    drainer = threading.Thread(target=drain_when_asked, daemon=True)
    drainer.start()
    log = tmp_path / "log"
    log.mkdir()
    result = run_job(
        workloads.elastic_fn,
        2,
        storage_path=tmp_path / "runs",
        name="drained",
        backend="ray",
        placement_strategy="SPREAD",
        train_loop_config={
            "epochs": 2,
            "log": str(log),
            "out": str(tmp_path / "out.pt"),
            "batch_size": 6,
            "first_world": 2,
            "notice_step": NOTICE_STEP,
            "notice_file": str(flag),
        },
    )
    drainer.join(timeout=10)
    assert drained.is_set()
    assert result.status == "PREEMPTED" and result.error is None, result
    assert result.failures == [] and result.preemptions == 1
    (notice,) = _events(result.path, "preemption")
    assert notice["source"] == "ray-drain" and len(notice["ranks"]) == 1
    assert "Ray is draining node" in notice["reason"]
    assert 0 < notice["grace_s"] <= 120
    # The first boundaries after the notice (the flag's agreement may take one more step).
    (saved,) = _events(result.path, "preemption_saved")
    assert saved["step"] in (STOP_STEP, STOP_STEP + 1)
    # The checkpoint is the stop step's: a resume loses no step.
    assert result.checkpoint is not None
    records = _records(log)
    assert max(r["step"] for r in records) == saved["step"]
    assert result.metrics["preempted_step"] == saved["step"]


def test_the_drain_source_covers_the_ranks_of_the_draining_node_once():
    placement = {"a" * 56: [0, 1], "b" * 56: [2]}
    draining: dict[str, int] = {}
    source = RayDrainNotice(lambda: placement, draining=lambda: draining)
    assert source.check() is None
    draining["b" * 56] = int((time.time() + 60) * 1000)
    draining["c" * 56] = 0  # not one of the group's nodes
    notice = source.check()
    assert notice is not None and notice.ranks == (2,) and notice.source == "ray-drain"
    assert notice.deadline_s is not None and 50 < notice.deadline_s <= 60
    assert source.check() is None  # said once
    draining["a" * 56] = 0  # no deadline: FailureConfig.preemption_grace_s applies
    notice = source.check()
    assert notice is not None and notice.ranks == (0, 1) and notice.deadline_s is None
    with pytest.raises(ValueError, match="interval_s"):
        RayDrainNotice(lambda: placement, interval_s=0)
