"""Elastic training (issue 8): shrink in place on real worker processes over gloo.

The workload (``workloads.elastic_fn``) logs, per step and rank, the process id, world size and
the ids of the samples it trained on, so the tests can check that survivors keep their processes,
that every sample of an epoch is trained on exactly once across the resize, and compare the final
parameters with a run that switches world size through a disk checkpoint at the same step.
"""

from __future__ import annotations

import collections
import json

import pytest
import torch

import ringtrain as rt
import workloads
from ringtrain.channel import Interrupted
from ringtrain.elastic.policy import ElasticAction, ElasticPolicy
from ringtrain.result import WorkerFailure

EPOCHS = 2  # 120 samples, global batch 12 (3 x 4 or 2 x 6): 10 steps per epoch, 20 in all
KILL_STEP = 5


def _records(log_dir):
    return [json.loads(line) for f in sorted(log_dir.glob("*.jsonl")) for line in f.open()]


def _events(run_path, kind=None):
    with open(f"{run_path}/events.jsonl") as f:
        events = [json.loads(line) for line in f]
    return [e for e in events if kind is None or e["type"] == kind]


def _fit(tmp_path, name, num_workers, *, max_failures=3, restore_from=None, **config):
    log = tmp_path / f"{name}_log"
    log.mkdir()
    cfg = {"epochs": EPOCHS, "log": str(log), "out": str(tmp_path / f"{name}.pt"), **config}
    scaling = rt.ScalingConfig(num_workers=num_workers)
    if restore_from is not None:
        trainer = rt.Trainer.restore(
            restore_from, workloads.elastic_fn, scaling_config=scaling, train_loop_config=cfg
        )
    else:
        run_config = rt.RunConfig(
            name=name,
            storage_path=str(tmp_path / "runs"),
            failure_config=rt.FailureConfig(max_failures=max_failures),
            progress="off",
        )
        trainer = rt.Trainer(workloads.elastic_fn, scaling, run_config, train_loop_config=cfg)
    result = trainer.fit()
    return result, _records(log), torch.load(cfg["out"], weights_only=True)


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shrink")
    return _fit(tmp, "elastic", (2, 3), kill_ranks=[1], kill_step=KILL_STEP)


def test_losing_a_worker_shrinks_in_place(shrunk):
    result, records, _final = shrunk
    assert [f.kind for f in result.failures] == ["signal"]
    assert result.error is None
    (resize,) = _events(result.path, "resize")
    assert (resize["old_world_size"], resize["new_world_size"]) == (3, 2)
    assert resize["cause"] == "rank 1 was killed by SIGKILL"
    assert resize["snapshot_step"] == KILL_STEP
    assert resize["resume_s"] is not None and resize["resume_s"] >= 0
    # No full restart: one attempt, one group start.
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    # The survivors (old ranks 0 and 2) carry on in their own processes as ranks 0 and 1.
    before = {r["rank"]: r["pid"] for r in records if r["world"] == 3}
    after = {r["rank"]: r["pid"] for r in records if r["world"] == 2}
    assert after == {0: before[0], 1: before[2]}
    steps_after = sorted({r["step"] for r in records if r["world"] == 2})
    assert steps_after == list(range(KILL_STEP + 1, 10 * EPOCHS + 1))


def test_every_sample_of_the_epoch_is_seen_exactly_once(shrunk):
    result, records, _final = shrunk
    (resize,) = _events(result.path, "resize")
    snap = resize["snapshot_step"]
    # The trajectory that counts: the first group up to the snapshot, the resized one after it.
    kept = [
        r
        for r in records
        if (r["world"] == 3 and r["step"] <= snap) or (r["world"] == 2 and r["step"] > snap)
    ]
    for epoch in range(EPOCHS):
        seen = collections.Counter(i for r in kept if r["epoch"] == epoch for i in r["ids"])
        assert sorted(seen) == list(range(120)), f"epoch {epoch}: samples skipped"
        assert max(seen.values()) == 1, f"epoch {epoch}: samples seen twice"
    # Global batch kept: 3 x 4 before, 2 x 6 after.
    assert {len(r["ids"]) for r in kept if r["world"] == 3} == {4}
    assert {len(r["ids"]) for r in kept if r["world"] == 2} == {6}


def test_loss_continues_after_the_resize(shrunk):
    _result, records, _final = shrunk
    loss = {(r["world"], r["step"]): r["loss"] for r in records if r["rank"] == 0}
    first = loss[(3, 1)]
    # The resized group goes on from the snapshot's parameters, not from a fresh model.
    assert loss[(2, KILL_STEP + 1)] < 0.5 * first
    before = [loss[(3, s)] for s in range(1, KILL_STEP + 1)]
    last_epoch = [loss[(2, s)] for s in range(11, 10 * EPOCHS + 1)]
    assert sum(last_epoch) / len(last_epoch) < sum(before) / len(before)


def test_parameters_match_a_run_at_the_new_size_from_the_same_state(shrunk, tmp_path):
    *_, elastic_final = shrunk
    # The same 3 workers to the same step, saved to disk; then 2 workers (global batch kept:
    # 6 each) resume from that checkpoint through the ordinary restart path.
    first, _, _ = _fit(tmp_path, "ref", 3, stop_at=KILL_STEP)
    assert first.checkpoint is not None
    _, _, reference = _fit(tmp_path, "ref2", 2, restore_from=first.path, batch_size=6)
    assert reference["step"] == elastic_final["step"] == 10 * EPOCHS
    for key, value in reference["model"].items():
        assert torch.equal(value, elastic_final["model"][key]), f"{key} differs"


def test_below_min_falls_back_to_a_full_restart_from_disk(tmp_path):
    result, records, final = _fit(tmp_path, "fallback", (2, 3), kill_ranks=[1, 2], kill_step=7)
    assert result.error is None and final["step"] == 10 * EPOCHS
    (fallback,) = _events(result.path, "resize_fallback")
    assert "1 of 3 workers remain, fewer than min=2" in fallback["reason"]
    assert _events(result.path, "resize") == []
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0, 1]
    (resume,) = _events(result.path, "resume")
    assert resume["checkpoint"].endswith("checkpoint_000000")  # the report at step 5
    restarted = sorted({r["step"] for r in records if r["attempt"] == 1})
    assert restarted[0] == 6 and {r["world"] for r in records if r["attempt"] == 1} == {3}


# ------------------------------------------------------------------ config and policy


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ((3, 2), "min must be <= max"),
        ((0, 2), "num_workers[0] (min) must be >= 1"),
        ((1, 2, 3), "an int or a (min, max) pair"),
        ((1, 2.5), "num_workers[1] (max) must be an int"),
    ],
)
def test_scaling_config_rejects_bad_ranges(value, error):
    with pytest.raises((ValueError, TypeError)) as info:
        rt.ScalingConfig(num_workers=value)
    assert error in str(info.value)


def test_scaling_config_range_and_int_forms():
    elastic = rt.ScalingConfig(num_workers=[2, 4])  # as config.json gives it back
    assert elastic.num_workers == (2, 4) and elastic.elastic
    assert (elastic.min_workers, elastic.max_workers) == (2, 4)
    fixed = rt.ScalingConfig(num_workers=3)
    assert not fixed.elastic and fixed.num_workers == 3
    assert (fixed.min_workers, fixed.max_workers) == (3, 3)
    with pytest.raises(ValueError, match="needs backend='local'"):
        rt.ScalingConfig(num_workers=(1, 2), backend="ray")
    with pytest.raises(ValueError, match="snapshot_interval_steps"):
        rt.FailureConfig(snapshot_interval_steps=0)


def _lost(rank):
    return WorkerFailure(rank=rank, kind="signal", message=f"rank {rank} was killed", time=1.0)


def _interrupted(rank, step):
    return Interrupted(rank=rank, time=1.0, exc_type="E", message="m", snapshot_step=step)


def test_policy_decisions():
    policy = ElasticPolicy(2, 4, wait_s=5.0)
    lost = {1: _lost(1)}
    wait = policy.decide(4, lost, {0: _interrupted(0, 3)}, set(), 1.0)
    assert wait.action is ElasticAction.WAIT
    late = policy.decide(4, lost, {0: _interrupted(0, 3)}, set(), 6.0)
    assert late.action is ElasticAction.FALLBACK and "[2, 3] did not" in late.reason
    everyone = {r: _interrupted(r, 3) for r in (0, 2, 3)}
    ok = policy.decide(4, lost, everyone, set(), 1.0)
    assert ok.action is ElasticAction.RESIZE
    assert ok.survivors == (0, 2, 3) and ok.source is None and ok.snapshot_step == 3
    ahead = policy.decide(4, lost, {**everyone, 3: _interrupted(3, 4)}, set(), 1.0)
    assert ahead.source == 2 and ahead.snapshot_step == 4  # new rank of old rank 3
    too_few = policy.decide(4, {1: _lost(1), 2: _lost(2), 3: _lost(3)}, {}, set(), 0.0)
    assert too_few.action is ElasticAction.FALLBACK and "fewer than min=2" in too_few.reason
    bug = WorkerFailure(rank=1, kind="exception", message="rank 1 raised ValueError", time=1.0)
    assert policy.decide(4, {1: bug}, everyone, set(), 1.0).action is ElasticAction.FALLBACK
    none = policy.decide(4, lost, {**everyone, 0: _interrupted(0, None)}, set(), 1.0)
    assert none.action is ElasticAction.FALLBACK and "no in-memory snapshot" in none.reason
