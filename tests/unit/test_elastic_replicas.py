"""Elastic resizing on the dp_replicate axis, as rules (no processes): which configurations are
refused before any process starts and why, and which ranks leave with a lost one."""

from __future__ import annotations

import pytest

import ringtrain as rt
from ringtrain.config.replica_groups import elastic_mesh_refusal, replica_survivors, whole_groups
from ringtrain.elastic.policy import ElasticAction, ElasticPolicy
from ringtrain.result import WorkerFailure
from ringtrain.wire.channel import Interrupted


def _scaling(workers, **mesh):
    return rt.ScalingConfig(num_workers=workers, parallel=rt.ParallelConfig(**mesh))


def test_elastic_on_the_replica_axis_is_accepted():
    scaling = _scaling((2, 4), dp_replicate=-1, dp_shard=2)
    assert scaling.parallel.resolve(4) == rt.ParallelConfig(dp_replicate=2, dp_shard=2).resolve(4)
    _scaling((4, 8), dp_replicate=-1, dp_shard=4)
    _scaling((1, 3), dp_replicate=-1, dp_shard=1)  # replicas of one rank each


@pytest.mark.parametrize(
    ("workers", "mesh", "says"),
    [
        # dp_replicate fixed: the replica count could not vary.
        ((2, 4), {"dp_replicate": 2, "dp_shard": -1}, "dp_replicate must be -1"),
        # Only dp_shard varies (plain FSDP): a lost rank takes a slice of every parameter.
        ((2, 4), {"dp_shard": -1}, "dp_replicate must be -1"),
        # tp-only / pp: the other axes cannot change in place.
        ((2, 4), {"dp_replicate": 1, "dp_shard": 1, "tp": -1}, "dp_replicate must be -1"),
        ((2, 4), {"dp_replicate": -1, "dp_shard": 1, "tp": 2}, "tp=1 and pp=1 only"),
        ((2, 4), {"dp_replicate": -1, "dp_shard": 1, "pp": 2}, "tp=1 and pp=1 only"),
        # Whole replica groups only.
        ((3, 4), {"dp_replicate": -1, "dp_shard": 2}, "min=3 is not a multiple"),
        ((2, 6), {"dp_replicate": -1, "dp_shard": 4}, "min=2 is not a multiple"),
        ((4, 6), {"dp_replicate": -1, "dp_shard": 4}, "max=6 is not a multiple"),
    ],
)
def test_refusals_name_the_field_and_the_fix(workers, mesh, says):
    with pytest.raises(ValueError, match="ScalingConfig") as info:
        _scaling(workers, **mesh)
    message = str(info.value)
    assert says in message
    assert "use " in message or "set " in message  # the fix


def test_a_refusal_suggests_the_nearest_multiples():
    refusal = elastic_mesh_refusal(rt.ParallelConfig(dp_replicate=-1, dp_shard=4), 6, 8)
    assert refusal is not None and "use min=4 or 8" in refusal
    refusal = elastic_mesh_refusal(rt.ParallelConfig(dp_replicate=-1, dp_shard=4), 2, 8)
    assert refusal is not None and "use min=4" in refusal


def test_a_fixed_mesh_with_a_fixed_num_workers_is_unchanged():
    _scaling(4, dp_replicate=2, dp_shard=2)
    _scaling(4, dp_shard=2, tp=2)


def test_replica_survivors_keep_their_inner_coordinates():
    assert replica_survivors(4, 2, [1]) == ((2, 3), (0,))
    assert replica_survivors(6, 2, [3, 2]) == ((0, 1, 4, 5), (1,))
    assert replica_survivors(8, 4, [0, 7]) == ((), (0, 1))
    assert replica_survivors(3, 1, [1]) == ((0, 2), (1,))
    survivors, _ = replica_survivors(8, 2, [5])
    # New rank = position: the dp_shard coordinate (rank % 2) is the old one.
    assert [new % 2 for new, _old in enumerate(survivors)] == [old % 2 for old in survivors]
    with pytest.raises(ValueError, match="do not divide"):
        replica_survivors(5, 2, [0])


def test_whole_groups():
    assert whole_groups([2, 3], 2) and whole_groups([0, 1, 4, 5], 2) and whole_groups([], 2)
    assert not whole_groups([1], 2) and not whole_groups([0, 1, 2], 2)


def _lost(rank):
    return WorkerFailure(rank=rank, kind="signal", message=f"rank {rank} was killed", attempt=0)


def _interrupted(rank, step):
    return Interrupted(rank=rank, time=0.0, exc_type="RuntimeError", message="", snapshot_step=step)


def test_the_policy_drops_the_lost_ranks_replica_group_and_resumes_from_the_oldest_step():
    policy = ElasticPolicy(2, 4, replica_group_size=2)
    # Rank 1 lost: rank 0 (its replica group) leaves too; ranks 2 and 3 go on.
    waiting = policy.decide(4, {1: _lost(1)}, {2: _interrupted(2, 5)}, set(), 0.0)
    assert waiting.action is ElasticAction.WAIT  # rank 3 has not said Interrupted yet
    # Rank 0 need not say anything (it leaves); 2 and 3 differ by a step: the older is taken,
    # with no broadcast (each keeps its own shards).
    interrupted = {2: _interrupted(2, 6), 3: _interrupted(3, 5)}
    decision = policy.decide(4, {1: _lost(1)}, interrupted, set(), 0.0)
    assert decision.action is ElasticAction.RESIZE
    assert decision.survivors == (2, 3) and decision.snapshot_step == 5
    assert decision.source is None
    assert "replica groups [0] of 2 ranks leave" in decision.reason
    # Both replica groups lose a rank: fewer than min remain.
    both = policy.decide(4, {0: _lost(0), 3: _lost(3)}, {}, set(), 0.0)
    assert both.action is ElasticAction.FALLBACK and "0 of 4 workers remain" in both.reason
    # Growing back by whole replica groups.
    assert policy.grow_ranks(2, 0.0, 0) == [] and ElasticPolicy(
        2, 4, grow_after_s=0.0, replica_group_size=2
    ).grow_ranks(2, 0.0, 0) == [2, 3]


def test_the_coordinator_tells_the_policy_the_mesh():
    policy = ElasticPolicy(2, 4)
    assert (policy.replica_group_size, policy.replicas) == (1, False)
    policy.use_mesh(2)  # ElasticCoordinator.reset, from the started group's WorkerConfig.mesh
    assert (policy.replica_group_size, policy.replicas) == (2, True)


def test_without_replica_groups_the_policy_is_unchanged():
    policy = ElasticPolicy(2, 3)
    interrupted = {0: _interrupted(0, 6), 2: _interrupted(2, 5)}
    decision = policy.decide(3, {1: _lost(1)}, interrupted, set(), 0.0)
    assert decision.survivors == (0, 2) and decision.snapshot_step == 6 and decision.source == 0
