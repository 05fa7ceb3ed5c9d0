"""Elastic resizing on the ``dp_replicate`` axis of a device mesh (HSDP), as pure rules (the
config validates with them before any process starts, so they live outside ``ringtrain.elastic``,
which the core never imports).

``ScalingConfig(num_workers=(4, 8), parallel=ParallelConfig(dp_replicate=-1, dp_shard=4))`` lets
the number of *replica groups* vary: a replica group is the ``dp_shard`` ranks that together hold
one full copy of the (sharded) parameters and optimizer state. When a rank is lost, its whole
replica group leaves (its other ranks hold shards that no other group can complete), the other
groups go on in place from their in-memory snapshots, and the group grows back by whole replica
groups. Because ``dp_replicate`` is the outermost mesh dimension used (``pp = 1``), renumbering
the surviving ranks in order keeps every survivor's ``dp_shard`` coordinate (``rank %
dp_shard``), so the shards it holds stay valid on the smaller mesh.

The other axes cannot change size in place: a lost rank of a ``dp_shard`` group takes a slice of
every parameter with it (resharding needs the disk checkpoint), a lost ``tp`` rank a slice of
every layer, a lost ``pp`` rank whole layers. This module says so, before any process starts
(:func:`elastic_mesh_refusal`), and maps lost ranks to the replica groups that leave
(:func:`replica_survivors`). It imports neither torch nor the controller.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class MeshSizes(Protocol):
    """A :class:`ringtrain.ParallelConfig` as these rules read it (-1: the rest)."""

    @property
    def dp_replicate(self) -> int: ...
    @property
    def dp_shard(self) -> int: ...
    @property
    def tp(self) -> int: ...
    @property
    def pp(self) -> int: ...


def elastic_mesh_refusal(parallel: MeshSizes, min_workers: int, max_workers: int) -> str | None:
    """Why ``ScalingConfig(num_workers=(min_workers, max_workers), parallel=parallel)`` cannot
    resize in place (``None``: it can, on the ``dp_replicate`` axis).

    The message names the field and the fix. Rules: ``dp_replicate=-1`` (the replica count is
    what varies); ``tp == pp == 1`` (the elastic batch policy and the data sharding count
    workers, which equal data-parallel ranks only then); ``dp_shard`` a number (the replica group
    size) that divides both ``min_workers`` and ``max_workers``.
    """
    shown = (
        f"ScalingConfig(num_workers=({min_workers}, {max_workers}), parallel=ParallelConfig("
        f"dp_replicate={parallel.dp_replicate}, dp_shard={parallel.dp_shard}, tp={parallel.tp}, "
        f"pp={parallel.pp}))"
    )
    if parallel.dp_replicate != -1:
        return (
            f"{shown}: elastic resizing of a device mesh is not supported except on the "
            "dp_replicate axis (the number of replica groups varies), so "
            "ParallelConfig.dp_replicate must be -1 (the rest of the world size), got "
            f"dp_replicate={parallel.dp_replicate}; a lost rank of a dp_shard, tp or pp group "
            "takes a slice of the parameters with it, which only the disk checkpoint can "
            "reshard: set dp_replicate=-1 and dp_shard to the replica group size, or give a "
            "fixed num_workers (restarts restore the whole mesh from the latest checkpoint)"
        )
    if parallel.tp != 1 or parallel.pp != 1:
        return (
            f"{shown}: elastic resizing of a device mesh is not supported with tp or pp > 1: "
            "it resizes dp_replicate with tp=1 and pp=1 only "
            "(a replica group would span tensor-parallel and pipeline ranks, and the elastic "
            "batch policy splits the global batch over workers, not data-parallel ranks); "
            "use tp=1, pp=1, or a fixed num_workers"
        )
    group = parallel.dp_shard
    for name, count in (("min", min_workers), ("max", max_workers)):
        if count % group:
            low, high = (count // group) * group, (count // group + 1) * group
            fix = f"{low} or {high}" if low else str(high)
            return (
                f"{shown}: num_workers {name}={count} is not a multiple of the replica group "
                f"size dp_shard={group} (the group shrinks and grows by whole replica groups); "
                f"use {name}={fix}"
            )
    return None


def replica_survivors(
    world_size: int, group_size: int, lost: Iterable[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The ranks that stay (in order) and the replica groups that leave when ``lost`` ranks are
    lost from a group of ``world_size`` ranks laid out in replica groups of ``group_size``
    consecutive ranks (``dp_replicate`` outermost).

    Returns:
        ``(survivors, leaving_groups)``: the old ranks of every replica group without a lost
        rank, ascending (their new ranks are their positions, which keeps ``rank % group_size``),
        and the indices of the replica groups that leave, ascending.

    Raises:
        ValueError: ``group_size`` does not divide ``world_size``.
    """
    if group_size < 1 or world_size % group_size:
        raise ValueError(
            f"replica groups of {group_size} ranks do not divide a group of {world_size} ranks"
        )
    leaving = tuple(sorted({rank // group_size for rank in lost}))
    survivors = tuple(r for r in range(world_size) if r // group_size not in leaving)
    return survivors, leaving


def whole_groups(ranks: Iterable[int], group_size: int) -> bool:
    """Whether ``ranks`` is a union of whole replica groups of ``group_size`` consecutive ranks."""
    chosen = set(ranks)
    groups = {rank // group_size for rank in chosen}
    return all(g * group_size + i in chosen for g in groups for i in range(group_size))
