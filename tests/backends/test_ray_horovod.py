"""``examples/horovod_ray.py`` (Horovod's ``RayExecutor`` API) as a user runs it on a running
Ray cluster: ``python examples/horovod_ray.py --address HOST:PORT`` against the shared two-node
cluster (tests/backends/conftest.py), with tiny settings. Without ``--address`` the example
starts a local Ray instance of its own with ``ray.init(num_cpus=...)``, the one line that
differs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray path needs Ray: pip install 'ringtrain[ray]'")

from ray_cluster import assert_torn_down  # noqa: E402

# One local Ray cluster at a time: the Ray tests share one pytest worker (pyproject addopts).
pytestmark = pytest.mark.xdist_group("ray")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_ray_executor_example_on_a_running_cluster(cluster):
    proc = subprocess.run(
        [
            *(sys.executable, str(ROOT / "examples" / "horovod_ray.py"), "--num-proc", "2"),
            *("--epochs", "1", "--lr", "0.05", "--max-batches", "10"),
            *("--address", cluster.address),
        ],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-4000:]
    assert "Connected to Ray cluster" in text, text[-2000:]  # not a local instance of its own
    assert "RayExecutor.run(my_rank) -> [0, 1]" in text, text[-2000:]
    assert "Train Epoch: 1 [0/2000" in text
    executed = re.search(r"RayExecutor.execute\(fit\) -> \[(.*)\]", text)
    assert executed, text[-2000:]
    per_rank = [float(x) for x in executed.group(1).split(",")]
    assert len(per_rank) == 2 and len(set(per_rank)) == 1 and 0.0 < per_rank[0] <= 1.0
    assert_torn_down()  # the script's actors and placement groups are gone with it
