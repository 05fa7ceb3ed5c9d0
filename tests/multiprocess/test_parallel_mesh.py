"""The device mesh on real gloo processes (issue 22): FSDP x TP and HSDP at W=4 match one process
on the same global batch; TP peers see the same batch, data-parallel ranks disjoint slices; a
worker killed after a checkpoint resumes bit-exactly at the same mesh; a checkpoint saved at
dp_shard=2 x tp=2 resumes at dp_shard=4; export consolidates the DTensor shards. Four launches
for the whole file, several checks each. (Invalid meshes: tests/unit/test_parallel_config.py.)"""

from __future__ import annotations

import pytest
import torch

import parallel_workloads as pw
import ringtrain as rt
from support import assert_matches_reference, run_parity_job, step_losses

pytestmark = pytest.mark.timeout(900)

STEPS, CKPT_AT = 6, 3
TOL = 1e-4


def _fit(root, name, mesh, **config):
    cfg = {"steps": STEPS, "ckpt_at": CKPT_AT, "crash": config.pop("crash", False)}
    return run_parity_job(pw.mesh_fn, 4, root, name, mesh, cfg, **config)


def _losses(path) -> dict[int, float]:
    return step_losses(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh")
    out = {"root": root, "reference": pw.reference(STEPS)}
    out["tp"] = _fit(root, "tp", {"dp_shard": 2, "tp": 2})
    out["hsdp"] = _fit(root, "hsdp", {"dp_replicate": 2, "dp_shard": 2})
    out["crash"] = _fit(root, "crash", {"dp_shard": 2, "tp": 2}, crash=True, max_failures=1)
    # The FSDP x TP run continued from its checkpoint (step 3) on another mesh shape.
    out["reshard"] = _fit(root, "reshard", {"dp_shard": 4}, restore_from=str(root / "runs" / "tp"))
    return out


def _assert_matches_reference(runs, name, steps=range(1, STEPS + 1)):
    assert_matches_reference(runs["reference"], runs[name][1], name, steps, TOL)


def _check_batches(per_rank, groups):
    """Ranks in one group (TP peers) saw the same batches; the groups' batches are disjoint and
    together the global batch of each step."""
    for group in groups:
        assert all(per_rank[r]["batches"] == per_rank[group[0]]["batches"] for r in group)
    for step in range(STEPS):
        seen = [i for g in groups for i in per_rank[g[0]]["batches"][step]]
        assert len(seen) == len(set(seen)) == pw.GLOBAL_BATCH, step


def test_fsdp_x_tp_matches_one_process_and_tp_peers_share_the_batch(runs):
    _assert_matches_reference(runs, "tp")
    per_rank = runs["tp"][0].metrics_per_rank
    assert list(per_rank[0]["coords"]) == ["pp", "dp_replicate", "dp_shard", "tp"]  # ctx.mesh
    assert [per_rank[r]["coords"]["tp"] for r in range(4)] == [0, 1, 0, 1]  # TP: adjacent ranks
    assert [per_rank[r]["coords"]["dp_shard"] for r in range(4)] == [0, 0, 1, 1]
    _check_batches(per_rank, [(0, 1), (2, 3)])
    full = sum(p.numel() for p in runs["reference"][1].values())
    assert all(per_rank[r]["local_numel"] < full / 2 for r in range(4))  # sharded 4 ways, mostly


def test_hsdp_matches_one_process_with_four_data_parallel_ranks(runs):
    _assert_matches_reference(runs, "hsdp")
    per_rank = runs["hsdp"][0].metrics_per_rank
    assert [per_rank[r]["coords"]["dp_replicate"] for r in range(4)] == [0, 0, 1, 1]
    _check_batches(per_rank, [(0,), (1,), (2,), (3,)])
    full = sum(p.numel() for p in runs["reference"][1].values())
    assert all(per_rank[r]["local_numel"] == full // 2 for r in range(4))  # shard 2, replicate 2


def test_a_killed_worker_resumes_bit_exactly_at_the_same_mesh(runs):
    per_rank = runs["crash"][0].metrics_per_rank
    assert {per_rank[r]["attempt"] for r in range(4)} == {1}
    assert {per_rank[r]["resumed_at"] for r in range(4)} == {CKPT_AT}
    clean = torch.load(runs["tp"][1]["out"], weights_only=True)
    resumed = torch.load(runs["crash"][1]["out"], weights_only=True)
    for key, value in clean.items():
        assert torch.equal(resumed[key], value), key
    assert _losses(runs["crash"][1]["loss_file"]) == _losses(runs["tp"][1]["loss_file"])


def test_a_checkpoint_resumes_on_another_mesh_shape(runs):
    per_rank = runs["reshard"][0].metrics_per_rank
    assert {per_rank[r]["resumed_at"] for r in range(4)} == {CKPT_AT}
    assert [per_rank[r]["coords"]["dp_shard"] for r in range(4)] == [0, 1, 2, 3]
    _assert_matches_reference(runs, "reshard", steps=range(CKPT_AT + 1, STEPS + 1))
    # Steps after the checkpoint saw the same global batches as the run it was saved by.
    before = runs["tp"][0].metrics_per_rank
    for k, step in enumerate(range(CKPT_AT, STEPS)):
        got = sorted(i for r in range(4) for i in per_rank[r]["batches"][k])
        want = sorted(i for r in (0, 2) for i in before[r]["batches"][step])
        assert got == want, step


def test_export_consolidates_the_tp_shards(runs, tmp_path):
    ckpt = runs["tp"][0].checkpoint
    out = rt.export_model(ckpt, tmp_path / "model.safetensors")
    from safetensors.torch import load_file

    exported = load_file(out)
    _, at_ckpt = pw.reference(CKPT_AT)
    assert exported.keys() == at_ckpt.keys()
    for key, want in at_ckpt.items():
        torch.testing.assert_close(exported[key], want, rtol=0, atol=TOL, msg=key)
