"""The worker's device mesh: ``get_context().mesh``.

:func:`build_mesh` lays the ranks out on a four-dimensional ``torch.distributed.DeviceMesh`` with
the named dimensions ``("pp", "dp_replicate", "dp_shard", "tp")`` (torchtitan's order, ``tp``
innermost so that tensor-parallel peers are adjacent ranks), over the existing default process
group. Every name is always present (a dimension of size 1 when unused), so that code can slice
``mesh["tp"]`` or ``mesh["dp_replicate", "dp_shard"]`` whatever the configuration.

:func:`context_mesh` is what ``DistributedContext.mesh`` calls: it initialises the default process
group if needed (a one-rank group at world size 1), builds the mesh from the run's
:class:`~ringtrain.config.parallel.MeshShape` (``WorkerConfig.mesh``) and caches it on the context.
Without a ``ParallelConfig`` the shape is ``dp_shard = world size``: one data-parallel dimension
over every rank (what DDP and FSDP use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from ringtrain.config.parallel import MESH_DIMS, MeshShape

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ringtrain.cluster.env import DistributedContext


class Resolvable(Protocol):
    """Anything that gives the mesh's sizes for a world size (:class:`ringtrain.ParallelConfig`)."""

    def resolve(self, world_size: int) -> MeshShape: ...


def mesh_shape(parallel: Resolvable | MeshShape | None, world_size: int) -> MeshShape:
    """The resolved sizes: ``parallel`` resolved for ``world_size``; ``None``: ``dp_shard`` =
    ``world_size``.

    Raises:
        ValueError: the sizes do not multiply to ``world_size``.
    """
    if parallel is None:
        return MeshShape(dp_shard=world_size)
    shape = parallel if isinstance(parallel, MeshShape) else parallel.resolve(world_size)
    if shape.world_size != world_size:
        raise ValueError(
            f"the mesh {dict(zip(MESH_DIMS, shape.sizes, strict=True))} has {shape.world_size} "
            f"ranks but the world size is {world_size} (ScalingConfig.parallel must multiply to "
            "num_workers)"
        )
    return shape


def build_mesh(
    parallel: Resolvable | MeshShape | None, world_size: int, device_type: str = "cpu"
) -> DeviceMesh:
    """A ``DeviceMesh`` over the default process group (which must be initialised, with
    ``world_size`` ranks) with the dimensions ``("pp", "dp_replicate", "dp_shard", "tp")``.

    Args:
        parallel: a :class:`ringtrain.ParallelConfig`, a resolved
            :class:`~ringtrain.config.parallel.MeshShape`, or ``None`` (one data-parallel
            dimension: ``dp_shard = world_size``).
        world_size: the number of ranks (``torch.distributed.get_world_size()``).
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).

    Returns:
        The mesh; ``mesh["tp"]``, ``mesh["dp_shard"]``, ``mesh["dp_replicate", "dp_shard"]``...
        are its sub-meshes. Every rank must call this (it creates one process group per
        dimension, a collective).

    Raises:
        ValueError: the sizes do not multiply to ``world_size``.
        RuntimeError: the default process group is not initialised.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    shape = mesh_shape(parallel, world_size)
    if not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs the default process group: call it inside a ringtrain worker "
            "(get_context().mesh initialises it) or after torch.distributed.init_process_group"
        )
    return init_device_mesh(device_type, shape.sizes, mesh_dim_names=MESH_DIMS)


def _init_group(ctx: DistributedContext) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain.cluster.distributed import init_process_group

    if dist.is_initialized():
        return
    if ctx.world_size > 1:
        init_process_group(ctx)
        return
    if ctx.use_gpu:  # one rank: an in-memory store, no port (as FSDP at world size 1)
        torch.cuda.set_device(ctx.local_rank)
    dist.init_process_group(
        backend="nccl" if ctx.use_gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )


def context_mesh(ctx: DistributedContext, cache: dict[str, Any]) -> DeviceMesh:
    """The mesh of this worker (``ctx.mesh``), built on first use and kept in ``cache`` while
    the default process group it was built over lives.

    Raises:
        ValueError: with GPUs, ``tp`` does not divide the workers per node (a TP group would
            span nodes).
    """
    import torch.distributed as dist

    _init_group(ctx)
    group = dist.distributed_c10d._get_default_group()
    cached = cache.get("mesh")
    if cached is not None and cached[0] is group:
        mesh: DeviceMesh = cached[1]
        return mesh
    shape = mesh_shape(elastic_shape(ctx.config.mesh, ctx), ctx.world_size)
    if ctx.use_gpu and ctx.local_world_size % shape.tp:
        raise ValueError(
            f"ParallelConfig(tp={shape.tp}) must divide the workers per node "
            f"({ctx.local_world_size}): tensor parallelism stays within a node; use tp="
            f"{_largest_divisor(ctx.local_world_size, shape.tp)} or more workers per node"
        )
    mesh = build_mesh(shape, ctx.world_size, ctx.device.type)
    cache["mesh"] = (group, mesh)
    return mesh


def elastic_shape(shape: MeshShape | None, ctx: DistributedContext) -> MeshShape | None:
    """``shape`` (resolved for ``max_workers``) at the current world size of an elastic run:
    ``dp_replicate`` becomes ``world_size / (pp * dp_shard * tp)``, the other sizes stay
    (:mod:`ringtrain.config.replica_groups`: only whole replica groups leave and join). ``shape``
    itself outside an elastic run, or when the world size is the one it was resolved for."""
    if shape is None or ctx.config.elastic is None or shape.world_size == ctx.world_size:
        return shape
    inner = shape.pp * shape.dp_shard * shape.tp
    if ctx.world_size % inner:
        return shape  # mesh_shape says why
    return MeshShape(
        pp=shape.pp, dp_replicate=ctx.world_size // inner, dp_shard=shape.dp_shard, tp=shape.tp
    )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel part of ``mesh``: ``mesh["dp_replicate", "dp_shard"]`` (2-D, HSDP)
    when ``dp_replicate > 1``, else ``mesh["dp_shard"]``."""
    if mesh["dp_replicate"].size() > 1:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]
