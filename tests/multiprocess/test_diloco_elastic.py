"""DiLoCo keeps training when a replica is lost, and takes it back (issue 41): the elastic
machinery on the replica axis (``ScalingConfig(num_workers=(2, 3), parallel=rt.ParallelConfig(
dp_replicate=-1, dp_shard=1))``). Three replicas; one is SIGKILLed after step 5: the two others
resume in place from their own snapshots (no restart from disk) and average over two replicas
from the next sync on; the group then grows back to three, the new replica receiving the global
parameters and the outer optimizer state from a member, its local parameters set to the global
ones, and it contributes from the next sync on. One process launch."""

from __future__ import annotations

import collections
import json

import pytest
import torch

import diloco_workloads as dw
import ringtrain as rt
from support import read_events, run_job

pytestmark = pytest.mark.timeout(600)

KILL_STEP, KILL_RANK, HOLD_STEP = 5, 1, 14  # 14: between two syncs (12, 16)
H = 4


def _records(log_dir) -> list[list]:
    return [json.loads(line) for p in sorted(log_dir.glob("*.jsonl")) for line in p.open()]


def test_a_lost_replica_is_dropped_and_a_returning_one_rejoins_at_the_next_sync(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    config = {
        "epochs": 2,  # global batch 12: 4 x 3 or 6 x 2; 10 steps per epoch
        "batch_size": 4,
        "first_world": 3,
        "kill_rank": KILL_RANK,
        "kill_step": KILL_STEP,
        "diloco": {"sync_every": H},
        "slow_world": 2,
        "slow_s": 0.3,
        "hold_step": HOLD_STEP,
        "log": str(log),
        "out": str(tmp_path / "out"),
    }
    result = run_job(
        dw.elastic_fn,
        (2, 3),
        storage_path=tmp_path / "runs",
        name="elastic",
        max_failures=2,
        parallel=rt.ParallelConfig(dp_replicate=-1, dp_shard=1),
        elastic_grow_after_s=0.0,
        train_loop_config=config,
    )
    assert result.error is None, result.error
    assert [f.kind for f in result.failures] == ["signal"]
    assert [e["attempt"] for e in read_events(result.path, "run_start")] == [0]  # in place
    assert read_events(result.path, "resize_fallback") == []
    shrink, grow = read_events(result.path, "resize")
    assert (shrink["old_world_size"], shrink["new_world_size"]) == (3, 2)
    assert (grow["old_world_size"], grow["new_world_size"]) == (2, 3)
    s, g = shrink["snapshot_step"], grow["snapshot_step"]
    # The survivors finish the step after the kill on their own (no collective joins them to
    # the lost replica between syncs) and resume from it: nothing is rolled back.
    assert KILL_STEP <= s <= KILL_STEP + 1 < g < 20
    assert shrink["steps_rolled_back"] == 0

    records = _records(log)
    by_pid = collections.defaultdict(list)
    for pid, world, rank, step, inner, outer, replicas in records:
        by_pid[pid].append((world, rank, step, inner, outer, replicas))
        assert inner == step  # one inner step per TrainState step, across every resize
        assert replicas == world  # the outer average is over the replicas there are
        assert outer == inner // H
    # The survivors of the first world went on in place; one process joined after the grow.
    first = {pid for pid, rows in by_pid.items() if rows[0][0] == 3 and rows[0][2] == 1}
    joiners = {pid for pid, rows in by_pid.items() if rows[0][0] == 3 and rows[0][2] > 1}
    assert len(first) == 3 and len(joiners) == 1
    (joiner,) = joiners
    assert by_pid[joiner][0][2] == g + 1  # its first step: the one after the grow
    survivors = [pid for pid in first if any(r[0] == 2 for r in by_pid[pid])]
    assert len(survivors) == 2
    # At the grow (between two syncs) the members resumed their own local parameters, apart
    # from the global ones; the joiner started from the global parameters themselves.
    restores = {
        p: [json.loads(line) for line in (log / f"{p}.restores").open()]
        for p in (*survivors, joiner)
    }
    assert [r[3] for r in restores[joiner]] == [0.0]
    # (a grow that lands on a sync step finds local = global on the members too)
    assert all(r[3] > 0 for p in survivors for r in restores[p] if r[0] == 3 and r[2] % H)

    states = [torch.load(f"{tmp_path / 'out'}_{r}.pt", weights_only=True) for r in range(3)]
    for state in states:
        assert state["step"] == 20 and state["counters"] == [20, 5]
        # Step 20 is a sync: every replica, the joiner too, holds the same global parameters,
        # outer momentum and local parameters.
        for a, b in zip(states[0]["global"], state["global"], strict=True):
            assert torch.equal(a, b)
        for i, s_ in states[0]["outer"].items():
            assert torch.equal(s_["momentum_buffer"], state["outer"][i]["momentum_buffer"])
        local = list(state["model"].values())
        assert all(torch.equal(g_, p) for g_, p in zip(state["global"], local, strict=True))


def test_an_elastic_run_without_a_replica_axis_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(rt.TrainingFailedError, match=r"ParallelConfig\(dp_replicate=-1"):
        run_job(
            dw.elastic_fn,
            (1, 2),
            storage_path=tmp_path / "runs",
            name="refused",
            train_loop_config={"diloco": {"sync_every": H}},
        )
