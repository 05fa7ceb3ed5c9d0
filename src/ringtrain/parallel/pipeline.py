"""Pipeline parallelism: :func:`prepare_pipeline` cuts a model into stages on ``mesh["pp"]``.

The model is read as a **chain**: its top-level children in registration order, each called on
the previous one's output (``nn.Sequential`` and models written like it). A child that is an
``nn.ModuleList`` is always expanded into its items (it is not callable), an ``nn.Sequential``
when a split point names one of its items (``"blocks.4"``), recursively. ``split_points`` are
the names of the chain units where a new stage starts; ``len(split_points) + 1`` stages, no
tracing. Each stage keeps its modules under their original names, so a stage's ``state_dict``
keys are the model's own (checkpoints and the single-process model share names), and a
parameter shared by two stages (a tied embedding and output head) has its gradient summed
between the ranks that hold it after every step.

Stages are placed on the ``pp`` ranks in order; with ``schedule="Interleaved1F1B"`` each rank holds
``stages_per_rank`` of them (rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...``: Narayanan et
al. 2021's interleaved placement). Each stage's module is then wrapped over the data-parallel
dimensions of the mesh: ``DistributedDataParallel`` (``data_parallel="ddp"``, the default) or
FSDP2 (``"fsdp"``, HSDP on ``dp_replicate x dp_shard``); with a ``tp_plan`` the plan is applied to
the stage's modules on ``mesh["tp"]`` first (then FSDP2), as :class:`ringtrain.ParallelStrategy`.

The schedules are ``torch.distributed.pipelining``'s: ``"GPipe"`` (all forwards, then all
backwards), ``"1F1B"`` (one forward, one backward in the steady state: at most ``pp`` microbatches
of activations held) and ``"Interleaved1F1B"``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ringtrain.cluster.mesh import dp_mesh
from ringtrain.parallel.fsdp import FSDPConfig
from ringtrain.parallel.pipeline_model import PipelineModel, StageModule, Unit, tie_groups

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

logger = logging.getLogger("ringtrain")

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
"""The schedule names :func:`prepare_pipeline` accepts."""

DATA_PARALLEL = ("ddp", "fsdp")


# ------------------------------------------------------------------------------ splitting


def chain_units(model: nn.Module, split_points: Sequence[str]) -> list[Unit]:
    """The model's chain: ``(name, module)`` of its top-level children in order, an
    ``nn.ModuleList`` expanded into its items, an ``nn.Sequential`` too when a split point lies
    inside it (recursively)."""
    units: list[Unit] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            inside = any(p.startswith(name + ".") for p in split_points)
            if isinstance(child, nn.ModuleList) or (inside and isinstance(child, nn.Sequential)):
                visit(name + ".", child)
            else:
                units.append((name, child))

    visit("", model)
    return units


def split_model(model: nn.Module, split_points: Sequence[str]) -> list[list[Unit]]:
    """Cut the chain of ``model`` before each of ``split_points``: ``len(split_points) + 1``
    stages, each a non-empty list of ``(name, module)`` in order.

    Raises:
        TypeError: ``split_points`` is not a sequence of str.
        ValueError: a split point names no unit of the chain (the message lists the units), or
            the split points are repeated or out of the chain's order.
    """
    if isinstance(split_points, str) or not isinstance(split_points, Sequence):
        raise TypeError(
            f"prepare_pipeline(split_points=...) must be a list of module names where a stage "
            f"starts, got {split_points!r} (e.g. split_points=['blocks.2'])"
        )
    if not all(isinstance(p, str) for p in split_points):
        raise TypeError(f"prepare_pipeline(split_points=...) must hold str, got {split_points!r}")
    units = chain_units(model, split_points)
    names = [name for name, _ in units]
    starts = []
    for point in split_points:
        if point not in names:
            raise ValueError(
                f"prepare_pipeline(split_points=...): {point!r} matches no module of the model's "
                f"chain (its units: {', '.join(names[:16])}{', ...' if len(names) > 16 else ''}); "
                "name a top-level child or an item of a top-level nn.Sequential/ModuleList"
            )
        starts.append(names.index(point))
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise ValueError(
            f"prepare_pipeline(split_points={list(split_points)!r}): the split points must be "
            "distinct, in the chain's order, and not its first unit (every stage needs a module)"
        )
    bounds = [0, *starts, len(units)]
    return [units[a:b] for a, b in itertools.pairwise(bounds)]


# ------------------------------------------------------------------------------ arguments


def check_arguments(
    schedule: object, microbatches: object, stages_per_rank: object, data_parallel: object
) -> int:
    """Validate :func:`prepare_pipeline`'s scalar arguments (before any process group); return
    the number of stages per rank.

    Raises:
        ValueError: naming the argument and the accepted values.
    """
    if schedule not in SCHEDULES:
        raise ValueError(
            f"prepare_pipeline(schedule={schedule!r}) is not known: use one of "
            f"{', '.join(map(repr, SCHEDULES))}"
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"prepare_pipeline(microbatches={microbatches!r}) must be an int >= 1 (the number "
            "of microbatches each batch is cut into; it must divide the batch size)"
        )
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(
            f"prepare_pipeline(data_parallel={data_parallel!r}): use 'ddp' or 'fsdp' (how each "
            "stage is replicated or sharded over the mesh's data-parallel ranks)"
        )
    if stages_per_rank is None:
        return 2 if schedule == "Interleaved1F1B" else 1
    if isinstance(stages_per_rank, bool) or not isinstance(stages_per_rank, int):
        raise ValueError(f"prepare_pipeline(stages_per_rank={stages_per_rank!r}) must be an int")
    if schedule != "Interleaved1F1B" and stages_per_rank != 1:
        raise ValueError(
            f"prepare_pipeline(stages_per_rank={stages_per_rank}) needs "
            f"schedule='Interleaved1F1B' ({schedule!r} runs one stage per rank)"
        )
    if stages_per_rank < 1:
        raise ValueError(f"prepare_pipeline(stages_per_rank={stages_per_rank}) must be >= 1")
    return stages_per_rank


def _check_counts(n_stages: int, pp: int, per_rank: int, microbatches: int, schedule: str) -> None:
    if n_stages != pp * per_rank:
        raise ValueError(
            f"prepare_pipeline: {n_stages - 1} split point(s) give {n_stages} stage(s), but the "
            f"mesh has pp={pp} rank(s) x {per_rank} stage(s) per rank: give "
            f"{pp * per_rank - 1} split point(s) (or change ParallelConfig(pp=...))"
        )
    if schedule != "GPipe" and microbatches < pp:
        raise ValueError(
            f"prepare_pipeline(microbatches={microbatches}, schedule={schedule!r}): needs at least "
            f"pp={pp} microbatches (use microbatches>={pp}, or schedule='GPipe')"
        )


# ------------------------------------------------------------------------------ prepare


def prepare_pipeline(
    model: nn.Module,
    split_points: Sequence[str],
    microbatches: int,
    schedule: str = "1F1B",
    *,
    stages_per_rank: int | None = None,
    data_parallel: str = "ddp",
    fsdp_config: FSDPConfig | None = None,
    tp_plan: Mapping[str, Any] | None = None,
    mesh: DeviceMesh | None = None,
) -> PipelineModel:
    """Cut ``model`` into pipeline stages over ``mesh["pp"]`` and keep this rank's.

    Every rank builds the whole model and calls this (a collective); rank 0's parameters and
    buffers are broadcast first, so ranks may build it with different seeds.

    Args:
        model: a chain (see the module's docstring): ``nn.Sequential`` or a module whose
            ``forward`` applies its top-level children in order.
        split_points: names of the chain units where a stage starts (``["blocks.2"]``:
            two stages); ``pp x stages_per_rank - 1`` of them.
        microbatches: how many microbatches each batch is cut into (must divide the batch
            size; ``>= pp`` for the 1F1B schedules).
        schedule: ``"GPipe"``, ``"1F1B"`` or ``"Interleaved1F1B"``.
        stages_per_rank: virtual stages per rank; only with ``"Interleaved1F1B"`` (default 2).
        data_parallel: ``"ddp"`` (replicate each stage over the data-parallel ranks) or
            ``"fsdp"`` (shard it with FSDP2; HSDP with ``dp_replicate > 1``); with ``tp_plan``
            FSDP2 is used.
        fsdp_config: FSDP2's options for ``"fsdp"`` (``sync_module_states`` is ignored: the
            whole model was broadcast already).
        tp_plan: a TP plan (:class:`ringtrain.ParallelStrategy`) over the whole model's module
            names; each stage applies the entries of its own modules on ``mesh["tp"]``.
        mesh: the 4-D mesh; default ``get_context().mesh``.

    Returns:
        A :class:`PipelineModel` holding this rank's stage(s).

    Raises:
        ValueError / TypeError: an unknown schedule, bad ``microbatches``, split points that
            match nothing or do not give ``pp x stages_per_rank`` stages, a TP pattern that
            matches nothing; all before any collective except the mesh's creation.
    """
    per_rank = check_arguments(schedule, microbatches, stages_per_rank, data_parallel)
    stage_units = split_model(model, split_points)
    plan = _resolve_plan(model, tp_plan)
    if mesh is None:
        from ringtrain.worker.session import get_context

        mesh = get_context().mesh
    assert mesh is not None
    pp_mesh = mesh["pp"]
    pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
    _check_counts(len(stage_units), pp, per_rank, microbatches, schedule)
    device = _device_of(mesh)
    model.to(device)
    _broadcast(model)
    mine = [pp_rank + v * pp for v in range(per_rank)]
    ties = tie_groups(stage_units, mesh, mine)
    stages = []
    for index in mine:
        chain = StageModule(stage_units[index])
        stages.append((index, chain, _wrap_stage(chain, mesh, data_parallel, fsdp_config, plan)))
    result = PipelineModel(
        stages, len(stage_units), microbatches, schedule, pp_mesh.get_group(), device
    )
    result._ties = ties
    logger.info(
        "pipeline: %d stages, %s, %d microbatches; pp rank %d holds stage(s) %s",
        len(stage_units),
        schedule,
        microbatches,
        pp_rank,
        mine,
    )
    return result


def _resolve_plan(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> dict[str, Any]:
    if not tp_plan:
        return {}
    from ringtrain.parallel.tensor import resolve_tp_plan

    return dict(resolve_tp_plan(model, tp_plan))


def _device_of(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _broadcast(model: nn.Module) -> None:
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def _wrap_stage(
    chain: StageModule,
    mesh: DeviceMesh,
    data_parallel: str,
    fsdp_config: FSDPConfig | None,
    plan: Mapping[str, Any],
) -> nn.Module:
    """The stage's module as the schedule runs it: DDP over the data-parallel ranks, or TP on
    ``mesh["tp"]`` and FSDP2 (:func:`ringtrain.parallel.tensor.wrap_on_mesh`)."""
    own = {name: style for name, style in plan.items() if _holds(chain, name)}
    if data_parallel == "fsdp" or plan:
        from ringtrain.parallel.tensor import wrap_on_mesh
        from ringtrain.worker.session import get_context

        config = dataclasses.replace(fsdp_config or FSDPConfig(), sync_module_states=False)
        return wrap_on_mesh(chain, get_context(), mesh, config, own or None)
    dp = dp_mesh(mesh)
    if dp.size() == 1:
        return chain
    if dp.ndim > 1:
        dp = dp._flatten()
    from ringtrain.comm.ddp import FixedOrderDDP  # buckets fixed: no rebuild across microbatches

    return FixedOrderDDP(chain, process_group=dp.get_group())


def _holds(chain: StageModule, name: str) -> bool:
    try:
        chain.get_submodule(name)
    except AttributeError:
        return False
    return True
