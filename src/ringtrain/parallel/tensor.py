"""Tensor parallelism from a plan of module-name patterns, and the whole mesh wrapping
(TP, activation checkpointing, FSDP2 over the data-parallel dimensions) of
:class:`ringtrain.ParallelStrategy`.

A TP plan maps ``fnmatch`` patterns over ``model.named_modules()`` names to a style::

    {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.proj": "rowwise"}

``"colwise"`` / ``"rowwise"`` / ``"sequence"`` are torch's ``ColwiseParallel()``,
``RowwiseParallel()`` and ``SequenceParallel()``; a ``ParallelStyle`` object is used as given.
:func:`resolve_tp_plan` expands the patterns to module names (every pattern must match), and
:func:`wrap_on_mesh` applies, in torchtitan's order: rank 0's parameters broadcast to every rank,
``parallelize_module`` on ``mesh["tp"]``, activation checkpointing of the FSDP units, and
``fully_shard`` over ``mesh["dp_replicate", "dp_shard"]`` (HSDP) or ``mesh["dp_shard"]``.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch import nn

from ringtrain.cluster.mesh import dp_mesh
from ringtrain.parallel.fsdp import (
    FSDPConfig,
    check_fsdp_model,
    finish_meta,
    prepare_sharding,
    shard_units,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from ringtrain.cluster.env import DistributedContext

logger = logging.getLogger("ringtrain")

TP_STYLES = ("colwise", "rowwise", "sequence")
"""The style names a TP plan may use (besides ``ParallelStyle`` objects)."""


def _is_style(value: object) -> bool:
    from torch.distributed.tensor.parallel import ParallelStyle

    return isinstance(value, ParallelStyle)


def check_tp_plan(plan: object) -> dict[str, Any]:
    """Validate a TP plan's form (not yet against a model); return a copy.

    Raises:
        TypeError: ``plan`` is not a mapping of str patterns.
        ValueError: a style is neither one of :data:`TP_STYLES` nor a ``ParallelStyle``.
    """
    if not isinstance(plan, Mapping):
        raise TypeError(
            f"tp_plan must be a dict of module-name pattern -> style, got {type(plan).__name__} "
            "(e.g. tp_plan={'blocks.*.mlp.fc1': 'colwise', 'blocks.*.mlp.fc2': 'rowwise'})"
        )
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise TypeError(f"tp_plan keys must be module-name patterns (str), got {pattern!r}")
        if style not in TP_STYLES and not _is_style(style):
            raise ValueError(
                f"tp_plan[{pattern!r}] = {style!r}: use one of {', '.join(map(repr, TP_STYLES))} "
                "or a torch.distributed.tensor.parallel.ParallelStyle object"
            )
    return dict(plan)


def _style(style: Any) -> ParallelStyle:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "sequence":
        return SequenceParallel()
    return style


def resolve_tp_plan(model: nn.Module, plan: Mapping[str, Any]) -> dict[str, ParallelStyle]:
    """``{module name: ParallelStyle}`` for every module a pattern of ``plan`` matches
    (``fnmatch.fnmatchcase``).

    Raises:
        ValueError: a pattern matches no module (the message names it and shows some module
            names); a module is matched by two patterns.
    """
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, ParallelStyle] = {}
    owner: dict[str, str] = {}
    for pattern, style in check_tp_plan(plan).items():
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            shown = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of the model (module names: "
                f"{shown or 'none'}); fix the pattern or drop it"
            )
        for name in hits:
            if name in owner:
                raise ValueError(
                    f"tp_plan: module {name!r} is matched by both {owner[name]!r} and "
                    f"{pattern!r}; make the patterns disjoint"
                )
            owner[name] = pattern
            resolved[name] = _style(style)
    return resolved


def wrap_on_mesh(
    model: nn.Module,
    ctx: DistributedContext,
    mesh: DeviceMesh,
    config: FSDPConfig,
    tp_plan: Mapping[str, Any] | None,
) -> nn.Module:
    """Apply ``tp_plan`` on ``mesh["tp"]``, then FSDP2 over the data-parallel dimensions.

    Args:
        model: the plain module (same parameters on every rank after the broadcast).
        ctx: this worker's context.
        mesh: the worker's 4-D mesh (``ctx.mesh``).
        config: FSDP's options (units, mixed precision, activation checkpointing...).
        tp_plan: pattern -> style; ``None`` or ``tp == 1``: checked, no TP.

    Returns:
        The same module object: parameters are ``DTensor`` (TP placements on ``mesh["tp"]``,
        sharded on the data-parallel mesh), or plain when the mesh has one rank.

    Raises:
        TypeError / ValueError: a bad plan or model (before any collective).
    """
    units = check_fsdp_model(model, config)  # checks first: nothing talks to peers yet
    plan = resolve_tp_plan(model, tp_plan) if tp_plan else {}
    from torch.distributed.tensor.parallel import parallelize_module

    tp, dp = mesh["tp"], dp_mesh(mesh)
    meta = prepare_sharding(model, ctx.device, config)  # placement, rank 0's broadcast
    if plan and tp.size() > 1:
        parallelize_module(model, tp, plan)
    sharded = dp.size() > 1 or tp.size() == 1
    if sharded:
        shard_units(model, units, dp, config, ctx.device)
    if meta:
        finish_meta(model, config, ctx.device)
    logger.info(
        "mesh %s: TP on %d module(s), FSDP2 over %s",
        dict(zip(mesh.mesh_dim_names or (), mesh.shape, strict=True)),
        len(plan) if tp.size() > 1 else 0,
        dp.mesh_dim_names if sharded else "nothing (one data-parallel rank)",
    )
    return model
