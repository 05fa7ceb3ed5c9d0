"""Pipeline parallelism on real gloo processes (issue 22): ``rt.prepare_pipeline`` with GPipe and
1F1B at W=2 (pp=2), Interleaved1F1B with DDP over dp_replicate=2 (DP x PP), FSDP over dp_shard=2
and TP x PP at W=4 each match one process on the same global batch (losses and parameters within
1e-4, the output head tied to the token embedding across stages); a worker killed after a
checkpoint resumes bit-exactly. Six launches for the file. (Argument errors:
tests/unit/test_pipeline_args.py.)"""

from __future__ import annotations

import pytest
import torch

import pipeline_workloads as pl
from support import assert_matches_reference, run_parity_job, step_losses

pytestmark = pytest.mark.timeout(900)

STEPS, CKPT_AT = 6, 3
TOL = 1e-4

RUNS = {
    # name: (workers, mesh, config)
    "gpipe": (2, {"pp": 2}, {"schedule": "GPipe", "microbatches": 4}),
    "1f1b": (2, {"pp": 2}, {"schedule": "1F1B", "microbatches": 2}),
    "crash": (2, {"pp": 2}, {"schedule": "1F1B", "microbatches": 2, "crash": True}),
    "dp_interleaved": (
        4,
        {"pp": 2, "dp_replicate": 2, "dp_shard": 1},
        {"schedule": "Interleaved1F1B", "microbatches": 2, "stages_per_rank": 2},
    ),
    "fsdp": (
        4,
        {"pp": 2, "dp_shard": 2},
        {"schedule": "1F1B", "microbatches": 2, "data_parallel": "fsdp"},
    ),
    "tp": (
        4,
        {"pp": 2, "tp": 2, "dp_shard": 1},
        {"schedule": "1F1B", "microbatches": 2, "tp": True},
    ),
}


def _fit(root, name):
    workers, mesh, extra = RUNS[name]
    cfg = {"steps": STEPS, "ckpt_at": CKPT_AT, "tied": True, **extra}
    max_failures = 1 if extra.get("crash") else 0
    return run_parity_job(pl.pipeline_fn, workers, root, name, mesh, cfg, max_failures=max_failures)


def _losses(path) -> dict[int, float]:
    return step_losses(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    out = {"reference": pl.reference(STEPS, tied=True)}
    for name in RUNS:
        out[name] = _fit(root, name)
    return out


def _assert_matches_reference(runs, name):
    assert_matches_reference(runs["reference"], runs[name][1], name, range(1, STEPS + 1), TOL)


def _stages(runs, name):
    per_rank = runs[name][0].metrics_per_rank
    return [per_rank[r]["stages"] for r in range(len(per_rank))]


def test_gpipe_and_1f1b_on_two_stages_match_one_process(runs):
    for name in ("gpipe", "1f1b"):
        _assert_matches_reference(runs, name)
        assert _stages(runs, name) == [[0], [1]]
        per_rank = runs[name][0].metrics_per_rank
        assert per_rank[0]["batches"] == per_rank[1]["batches"]  # pp peers: the same batches


def test_interleaved_1f1b_with_ddp_over_dp_replicate_matches_one_process(runs):
    _assert_matches_reference(runs, "dp_interleaved")
    # ranks (pp, dp_replicate): 0 (0,0), 1 (0,1), 2 (1,0), 3 (1,1); virtual stages r, r + pp
    assert _stages(runs, "dp_interleaved") == [[0, 2], [0, 2], [1, 3], [1, 3]]
    per_rank = runs["dp_interleaved"][0].metrics_per_rank
    assert per_rank[0]["batches"] == per_rank[2]["batches"]
    for a, b in zip(per_rank[0]["batches"], per_rank[1]["batches"], strict=True):
        assert not set(a) & set(b)  # data-parallel ranks: disjoint halves of the global batch


def test_fsdp_over_dp_shard_and_tp_inside_stages_match_one_process(runs):
    for name in ("fsdp", "tp"):
        _assert_matches_reference(runs, name)
        assert _stages(runs, name) == [[0], [0], [1], [1]]
    tp = runs["tp"][0].metrics_per_rank
    assert all(tp[r]["batches"] == tp[0]["batches"] for r in range(4))  # no data parallelism


def test_a_killed_worker_resumes_bit_exactly(runs):
    per_rank = runs["crash"][0].metrics_per_rank
    assert {per_rank[r]["attempt"] for r in range(2)} == {1}
    assert {per_rank[r]["resumed_at"] for r in range(2)} == {CKPT_AT}
    clean = torch.load(runs["1f1b"][1]["out"], weights_only=True)
    resumed = torch.load(runs["crash"][1]["out"], weights_only=True)
    assert clean.keys() == resumed.keys()
    for key, value in clean.items():
        assert torch.equal(resumed[key], value), key
    assert _losses(runs["crash"][1]["loss_file"]) == _losses(runs["1f1b"][1]["loss_file"])
    ckpt = runs["crash"][0].checkpoint
    assert ckpt is not None
