"""The device mesh a run is laid out on: :class:`ParallelConfig` (what the user states) and
:class:`MeshShape` (the resolved sizes that travel to the workers in
:class:`~ringtrain.wire.worker_config.WorkerConfig`).

The mesh has four named dimensions, in torchtitan's order (``ParallelDims``), outermost first::

    pp x dp_replicate x dp_shard x tp

so that a rank's coordinates are its row-major position in that grid: tensor-parallel peers are
adjacent ranks (on one node when ``tp`` divides the GPUs per node), pipeline stages the farthest
apart. ``dp_replicate x dp_shard`` are the data-parallel ranks: each sees its own slice of the data;
``tp`` and ``pp`` peers see the same batch.

This module imports neither torch nor the controller (the driver validates with it before any
process starts; the workers build their mesh from :class:`MeshShape`,
:func:`ringtrain.cluster.mesh.build_mesh`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ringtrain.config.validation import short_errors

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimension names, outermost first (``ctx.mesh.mesh_dim_names``)."""


@dataclass(frozen=True)
class MeshShape:
    """The resolved size of each mesh dimension (every one >= 1; their product is the world size).

    Attributes:
        pp: pipeline stages.
        dp_replicate: replica groups (HSDP's replicate dimension; plain DDP-style replication).
        dp_shard: ranks each parameter is sharded over by FSDP2 inside a replica group.
        tp: tensor-parallel ranks (adjacent ranks).

    Raises:
        ValueError: a size below 1 (the message names the field).
    """

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshShape.{name} must be an int >= 1, got {value!r}")

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """``(pp, dp_replicate, dp_shard, tp)``: the mesh's shape in :data:`MESH_DIMS` order."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def world_size(self) -> int:
        """The product of the four sizes."""
        return math.prod(self.sizes)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: ``dp_replicate * dp_shard`` (the data loader's shard count)."""
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s position on each dimension (row-major over :data:`MESH_DIMS`).

        Raises:
            ValueError: ``rank`` is not in ``[0, world_size)``.
        """
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world_size} ranks")
        coords: dict[str, int] = {}
        rest = rank
        for name, size in reversed(list(zip(MESH_DIMS, self.sizes, strict=True))):
            coords[name] = rest % size
            rest //= size
        return {name: coords[name] for name in MESH_DIMS}

    def dp_rank(self, rank: int) -> int:
        """``rank``'s data-parallel index in ``[0, dp_size)``: ``dp_replicate`` coordinate x
        ``dp_shard`` + ``dp_shard`` coordinate (the same for all its TP and PP peers)."""
        c = self.coordinates(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]


@short_errors
@dataclass(frozen=True)
class ParallelConfig:
    """How the workers are laid out on a device mesh
    (``ScalingConfig(num_workers=8, parallel=ParallelConfig(dp_replicate=2, dp_shard=2, tp=2))``;
    docs/parallelism.md).

    Attributes:
        dp_replicate: replica groups: parameters are replicated across them and their gradients
            all-reduced (HSDP's outer dimension when ``dp_shard > 1``); >= 1 or -1.
        dp_shard: ranks that FSDP2 shards parameters, gradients and optimizer state over inside
            each replica group; >= 1 or -1. The default -1 is "the rest of the world size": with
            no other field set, the run is today's FSDP2 over every rank.
        tp: tensor-parallel ranks (``prepare_model(tp_plan=...)``): adjacent ranks, which must
            be on one node with GPUs; >= 1 or -1.
        pp: pipeline stages (``ringtrain.prepare_pipeline``); >= 1 or -1.

    At most one field may be -1; it becomes ``num_workers`` divided by the product of the others.
    The product of the resolved sizes must equal ``ScalingConfig.num_workers`` (checked by
    ``ScalingConfig``, before any process starts).

    Raises:
        TypeError: a field is not an int.
        ValueError: a field is 0 or below -1, or more than one field is -1.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in MESH_DIMS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(
                    f"ParallelConfig.{name} must be an int, got {type(value).__name__} "
                    f"{value!r} (a size >= 1, or -1 for the rest of the world size)"
                )
            if value == 0 or value < -1:
                raise ValueError(
                    f"ParallelConfig.{name} must be >= 1, or -1 for the rest of the world size, "
                    f"got {value} (e.g. ParallelConfig({name}=2))"
                )
        rest = [name for name in MESH_DIMS if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ValueError(
                f"ParallelConfig: at most one field may be -1 (the rest of the world size), got "
                f"{' and '.join(f'{n}=-1' for n in rest)}; give the others as numbers, e.g. "
                f"ParallelConfig({rest[0]}=-1, {rest[1]}=2)"
            )

    def resolve(self, world_size: int) -> MeshShape:
        """The mesh's sizes for ``world_size`` workers (a -1 field becomes the rest).

        Raises:
            ValueError: the sizes do not multiply to ``world_size``; the message gives the
                product, the world size and a fix.
        """
        fixed = math.prod(getattr(self, n) for n in MESH_DIMS if getattr(self, n) != -1)
        rest = [n for n in MESH_DIMS if getattr(self, n) == -1]
        shown = ", ".join(f"{n}={getattr(self, n)}" for n in MESH_DIMS)
        if rest:
            if world_size % fixed:
                raise ValueError(
                    f"ParallelConfig({shown}): the fixed sizes multiply to {fixed}, which does "
                    f"not divide num_workers={world_size}, so {rest[0]}=-1 cannot take the rest "
                    f"(use num_workers={fixed * max(1, world_size // fixed)} or sizes whose "
                    f"product divides {world_size})"
                )
            sizes = {n: getattr(self, n) for n in MESH_DIMS} | {rest[0]: world_size // fixed}
        else:
            if fixed != world_size:
                raise ValueError(
                    f"ParallelConfig({shown}): pp x dp_replicate x dp_shard x tp = {fixed} must "
                    f"equal num_workers={world_size} (use num_workers={fixed}, or set one "
                    "field to -1 to take the rest of the world size)"
                )
            sizes = {n: getattr(self, n) for n in MESH_DIMS}
        return MeshShape(**sizes)

    def to_dict(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in ("dp_replicate", "dp_shard", "tp", "pp")}

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """``"dp_shard=2,tp=2"`` (``ringtrain run --parallel``) as a ``ParallelConfig``; the
        fields not named keep their defaults.

        Raises:
            ValueError: an item is not ``NAME=INT`` or names no field (the fields are listed).
        """
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, eq, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if not eq or name not in MESH_DIMS:
                raise ValueError(
                    f"{item!r} is not NAME=SIZE with NAME one of {', '.join(MESH_DIMS)} "
                    "(e.g. dp_shard=2,tp=2)"
                )
            try:
                sizes[name] = int(value)
            except ValueError:
                raise ValueError(f"{item!r}: the size must be an integer (-1: the rest)") from None
        return cls(**sizes)
