"""DiLoCo on the Ray backend (issue 41: the API block "runs as written, locally and on Ray").

``diloco_workloads.diloco_fn`` is the issue's block: ``prepare_model(parallel_strategy="diloco",
diloco_config=rt.DiLoCoConfig(...))``, the inner AdamW through ``rt.prepare_optimizer``, the
prepared loader, ``TrainState`` with ``restore()``, ``state.epochs`` and reports with checkpoints.
On the tier's local Ray cluster (a head and a worker node, tests/backends/conftest.py) with
``ScalingConfig(num_workers=4, backend="ray")`` as two islands of two
(``ParallelConfig(dp_replicate=2, dp_shard=2)``), every rank must end with the very state (local
and global parameters, inner and outer optimizer, counters) of the same job on local processes.
"""

from __future__ import annotations

import pytest

import diloco_workloads as dw
import ringtrain as rt

pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")

pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(900)]

CONFIG = {"diloco": {"sync_every": 5, "outer_lr": 0.7, "outer_momentum": 0.9}, "inner": "adamw"}


def test_the_api_block_runs_on_ray_as_on_local_processes(cluster, tmp_path):
    # Two islands of two workers: DDP inside an island and DiLoCo across islands, on Ray actors
    # (the four-replica layout is the same code without the island group; it runs locally in
    # tests/multiprocess/test_diloco*.py).
    job = {"parallel": rt.ParallelConfig(dp_replicate=2, dp_shard=2)}
    _, local = dw.run_diloco(tmp_path, "local", 4, epochs=2, job=job, **CONFIG)
    result, on_ray = dw.run_diloco(
        tmp_path, "ray", 4, epochs=2, job={**job, "backend": "ray"}, **CONFIG
    )
    assert result.failures == []
    assert on_ray[0]["counters"] == [20, 4]  # 20 inner steps, an outer step every 5
    dw.assert_states_equal(local, on_ray, "on Ray against local processes")
