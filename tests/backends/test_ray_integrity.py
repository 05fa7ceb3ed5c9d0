"""Silent data corruption on the Ray backend: the checks run on Ray actors (over the shared
two-node cluster) as on local processes. A bit flipped in one rank's
parameters is caught, that rank is named with its Ray node's host, and the run rolls back to end
bit-identical to a clean run. (The replay check is the same worker plug-in on the same channel;
it runs on local processes in tests/multiprocess/test_integrity.py.)"""

from __future__ import annotations

import pytest
import torch

import integrity_workloads
from support import assert_bit_identical, read_events, run_job

ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")

# One local Ray cluster at a time: the Ray tests share one pytest worker (pyproject addopts).
pytestmark = [pytest.mark.xdist_group("ray"), pytest.mark.timeout(400)]


def _run(tmp_path, name, inject, backend="ray", **checks):
    out = tmp_path / f"{name}.pt"
    result = run_job(
        integrity_workloads.sdc_fn,
        3,
        storage_path=tmp_path / "runs",
        name=name,
        backend=backend,
        train_loop_config={"inject": inject, "out": str(out)},
        **checks,
    )
    return result, out


def _mismatches(result) -> list[dict]:
    return [e for e in read_events(result.path) if e["type"] == "replica_mismatch"]


def test_the_replica_check_on_ray_actors_catches_names_and_rolls_back_exactly(cluster, tmp_path):
    # The clean reference on local processes (the backends are bit-identical: test_ray.py). A
    # false alarm on Ray would show in the flipped run: its checks at steps 3 and 6 come
    # before the flip, and the first mismatch must be step 9's.
    clean, clean_out = _run(tmp_path, "clean", None, backend="local", replica_check_every=3)
    assert clean.status == "FINISHED" and _mismatches(clean) == []

    flipped, out = _run(
        tmp_path, "param", {"rank": 2, "where": "param", "step": 7}, replica_check_every=3
    )
    assert flipped.status == "FINISHED"
    first = _mismatches(flipped)[0]
    assert (first["check"], first["step"], first["ranks"], first["named"]) == (
        "replica",
        9,
        [2],
        True,
    )
    assert first["hosts"][0] != "?"  # the host the driver knows rank 2 by
    assert_bit_identical(torch.load(out, weights_only=True), torch.load(clean_out))
