"""Sharded data parallelism (ZeRO stage 3) with torch's FSDP2 ``fully_shard``.

``prepare_model(model, parallel_strategy="fsdp", fsdp_config=FSDPConfig(...))`` (that is,
:class:`ringtrain.FSDPStrategy`) lands here. Every
rank keeps only its 1/W slice (dim 0) of each parameter, of its gradient and, because the optimizer
is built over the sharded parameters, of the optimizer state: the ZeRO-3 partitioning of
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC 2020), as implemented by PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``, per-parameter
``DTensor`` sharding). A unit's full parameters are all-gathered just before its forward (and again
before its backward), and its gradients are reduce-scattered right after its backward, so at most
a few units are ever unsharded at once.

:func:`wrap_fsdp` applies, in this order (the order of torchtitan's ``parallelize``):

1. checks (before any process starts talking): the listed module types occur, tied parameters do
   not straddle two units, a model on the meta device has an ``init_fn``;
2. the process group (a one-process group at world size 1, so that a checkpoint of a sharded model
   loads the same way at every world size) and a one-dimensional device mesh over all ranks;
3. rank 0's parameters and buffers broadcast to every rank (``sync_module_states``), as DDP does;
4. activation checkpointing of each unit (``torch.distributed._composable.checkpoint``: the unit's
   activations are recomputed in backward instead of kept; parameter names do not change);
5. ``fully_shard`` on each unit, innermost first, then on the root (which owns whatever no unit
   owns: embeddings, final norm, output head), with the mixed-precision and offload policies;
6. with a meta-device model: ``to_empty`` and ``init_fn`` on the sharded parameters.

Units are the modules of the types in ``FSDPConfig.shard_modules`` (a transformer's blocks), or,
when it is ``None``, chosen by size: every module whose parameters not already in a smaller unit
number at least ``min_num_params`` (the rule of FSDP1's ``size_based_auto_wrap_policy``).

Works on CPU with gloo (including bf16 mixed precision and CPU offload, which there is a no-op) and
on GPU with NCCL. Parameters stay in their own dtype (float32) in the shards and in the optimizer;
mixed precision only changes the dtype of the all-gathered compute copies and of the gradient
reduction.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ringtrain.checkpoint.sharded import is_sharded_module, is_sharded_optimizer
from ringtrain.cluster.env import DistributedContext
from ringtrain.config.fsdp import MIXED_PRECISION, FSDPConfig

logger = logging.getLogger("ringtrain")

# --------------------------------------------------------------------------------- inspection


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_state_bytes(model: nn.Module, optimizer: Any = None) -> dict[str, int]:
    """Bytes this rank holds for ``model``'s parameters, their gradients and ``optimizer``'s
    state, counted from the local tensors (a ``DTensor`` counts its local shard only).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes; also ``"numel_params"``, the
        number of parameter elements held locally. Tensors shared between parameters (tied
        weights) count once.
    """
    seen: set[int] = set()
    params = grads = numel = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = _local(p)
        params += local.numel() * local.element_size()
        numel += local.numel()
        if p.grad is not None:
            g = _local(p.grad)
            grads += g.numel() * g.element_size()
    opt = 0
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local = _local(value)
                    opt += local.numel() * local.element_size()
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "total": params + grads + opt,
        "numel_params": numel,
    }


# ----------------------------------------------------------------------------------- checks


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _param_owners(model: nn.Module) -> dict[int, set[str]]:
    """``id(parameter) -> names of every module that registers it`` (tied weights: several)."""
    owners: dict[int, set[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(name)
    return owners


def _inside(name: str, unit: str) -> bool:
    return unit == "" or name == unit or name.startswith(unit + ".")


def select_units(model: nn.Module, config: FSDPConfig) -> list[tuple[str, nn.Module]]:
    """The submodules that become their own FSDP units (the root excluded), outermost first.

    Raises:
        ValueError: a type in ``shard_modules`` occurs nowhere in the model, or a unit shares a
            parameter (tied weights) with a module outside it.
    """
    named = [(n, m) for n, m in model.named_modules() if n]
    owners = _param_owners(model)

    def straddles(unit: str, module: nn.Module) -> str | None:
        for p in module.parameters():
            outside = [o for o in owners.get(id(p), ()) if not _inside(o, unit)]
            if outside:
                return outside[0] or "<root>"
        return None

    if config.shard_modules is not None:
        kinds = tuple(config.shard_modules)
        units = [(n, m) for n, m in named if isinstance(m, kinds)]
        found = {type(m) for _, m in units}
        missing = [k.__qualname__ for k in kinds if not any(issubclass(f, k) for f in found)]
        if missing:
            present = sorted({type(m).__qualname__ for _, m in named})
            raise ValueError(
                f"FSDPConfig.shard_modules: {', '.join(missing)} does not occur in the model "
                f"(its submodule types: {', '.join(present) or 'none'}); list the class of the "
                "repeated block, e.g. shard_modules=[TransformerBlock], or None for the size policy"
            )
        for name, module in units:
            other = straddles(name, module)
            if other is not None:
                raise ValueError(
                    f"FSDPConfig.shard_modules: unit {name!r} ({type(module).__qualname__}) shares "
                    f"a parameter with {other!r} outside it (tied weights); tied parameters must "
                    "live in one unit: shard a module that contains both, or untie them"
                )
        return units

    chosen: list[tuple[str, nn.Module]] = []

    def visit(name: str, module: nn.Module) -> set[int]:
        """Ids of the parameters under ``module`` that no chosen unit below it owns."""
        free = {id(p) for p in module.parameters(recurse=False)}
        for child_name, child in module.named_children():
            free |= visit(f"{name}.{child_name}" if name else child_name, child)
        if name and free:
            count = sum(p.numel() for p in module.parameters() if id(p) in free)
            if count >= config.min_num_params and straddles(name, module) is None:
                chosen.append((name, module))
                return set()
        return free

    visit("", model)
    return sorted(chosen, key=lambda item: item[0].count("."))


def check_fsdp_model(model: nn.Module, config: FSDPConfig) -> list[tuple[str, nn.Module]]:
    """Everything :func:`wrap_fsdp` checks before touching the process group.

    Returns:
        The units (see :func:`select_units`).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or already wrapped (DDP, FSDP).
        ValueError: see :func:`select_units`; a model on the meta device without
            ``FSDPConfig.init_fn``; a model without parameters.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"prepare_model(parallel_strategy='fsdp') needs an nn.Module, got {model!r}"
        )
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise TypeError(
            "prepare_model(parallel_strategy='fsdp') got a DistributedDataParallel model: pass "
            "the plain module (model.module)"
        )
    if is_sharded_module(model):
        raise TypeError("prepare_model(parallel_strategy='fsdp'): the model is already sharded")
    if not any(True for _ in model.parameters()):
        raise ValueError("prepare_model(parallel_strategy='fsdp'): the model has no parameters")
    if _on_meta(model) and config.init_fn is None:
        raise ValueError(
            "prepare_model(parallel_strategy='fsdp'): the model is on the meta device (it has no "
            "values yet) and FSDPConfig.init_fn is None: pass init_fn=... to initialise the "
            "sharded parameters after sharding (e.g. init_fn=lambda m: [x.reset_parameters() for "
            "x in m.modules() if hasattr(x, 'reset_parameters')]), or build the model on the CPU"
        )
    return select_units(model, config)


# ------------------------------------------------------------------------------------ wrapping


def _init_single_process_group(ctx: DistributedContext) -> None:
    """A process group of one rank (an in-memory store, no port), for FSDP at world size 1."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if ctx.use_gpu:
        torch.cuda.set_device(ctx.local_rank)
    dist.init_process_group(
        backend="nccl" if ctx.use_gpu else "gloo", store=dist.HashStore(), rank=0, world_size=1
    )


def _broadcast_from_rank0(model: nn.Module, device: torch.device) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device == device or device.type == "cpu":
                dist.broadcast(t.data, src=0)
            else:  # NCCL needs the tensor on the GPU
                tmp = t.data.to(device)
                dist.broadcast(tmp, src=0)
                t.data.copy_(tmp)


def wrap_fsdp(model: nn.Module, ctx: DistributedContext, config: FSDPConfig | None) -> nn.Module:
    """Shard ``model`` over all ranks with FSDP2 (see the module docstring for the order).

    Args:
        model: the plain module, on the CPU, already on ``ctx.device``, or on the meta device
            (then ``config.init_fn`` is required). Its parameters should be identical on every
            rank (``sync_module_states`` broadcasts rank 0's).
        ctx: this worker's context (world size, device).
        config: the sharding options; ``None`` is ``FSDPConfig()``.

    Returns:
        The same module object, now an ``FSDPModule`` (its class is swapped by ``fully_shard``):
        parameters are ``DTensor`` shards on ``ctx.device`` (on the CPU with ``cpu_offload``).
        Build the optimizer over ``model.parameters()`` after this call.

    Raises:
        TypeError / ValueError: see :func:`check_fsdp_model`.
    """
    config = config if config is not None else FSDPConfig()
    if not isinstance(config, FSDPConfig):
        raise TypeError(
            f"prepare_model(fsdp_config=...) must be a ringtrain.FSDPConfig, got "
            f"{type(config).__name__}"
        )
    units = check_fsdp_model(model, config)

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ringtrain.cluster.distributed import init_process_group

    if ctx.world_size > 1:
        init_process_group(ctx)
    else:
        _init_single_process_group(ctx)
    mesh = init_device_mesh(ctx.device.type, (dist.get_world_size(),))
    meta = prepare_sharding(model, ctx.device, config)
    shard_units(model, units, mesh, config, ctx.device)
    if meta:
        finish_meta(model, config, ctx.device)
    logger.info(
        "FSDP: %d unit(s) + root over %d rank(s)%s%s%s",
        len(units),
        dist.get_world_size(),
        f", {config.mixed_precision} compute" if config.mixed_precision else "",
        ", activation checkpointing" if config.activation_checkpointing else "",
        ", CPU offload" if config.cpu_offload else "",
    )
    return model


def prepare_sharding(model: nn.Module, device: torch.device, config: FSDPConfig) -> bool:
    """Before any sharding: move ``model`` to ``device`` (unless on the meta device or offloaded)
    and broadcast rank 0's parameters and buffers over the default group
    (``config.sync_module_states``). Returns whether the model is on the meta device."""
    import torch.distributed as dist

    meta = _on_meta(model)
    if not meta and not config.cpu_offload and device.type != "cpu":
        model.to(device)
    if not meta and config.sync_module_states and dist.get_world_size() > 1:
        _broadcast_from_rank0(model, device)
    return meta


def shard_units(
    model: nn.Module,
    units: Sequence[tuple[str, nn.Module]],
    mesh: Any,
    config: FSDPConfig,
    device: torch.device,
) -> None:
    """Activation checkpointing of each unit, then ``fully_shard`` on each unit (innermost
    first) and on the root over ``mesh`` (1-D: FSDP; 2-D ``(replicate, shard)``: HSDP), with
    ``config``'s mixed-precision and offload policies."""
    from torch.distributed._composable import checkpoint as checkpoint_activations
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    if config.mixed_precision is not None:
        param_dtype, reduce_dtype = (
            getattr(torch, name) for name in MIXED_PRECISION[config.mixed_precision]
        )
        unit_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        root_mp = MixedPrecisionPolicy(
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, output_dtype=torch.float32
        )
    else:
        unit_mp = root_mp = MixedPrecisionPolicy()
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=device.type == "cuda")
        if config.cpu_offload
        else OffloadPolicy()
    )
    if config.activation_checkpointing:
        for _, module in units:
            checkpoint_activations(module)
    # Innermost units first: fully_shard on a module leaves out parameters already in a unit.
    for _, module in sorted(units, key=lambda item: -item[0].count(".")):
        fully_shard(
            module,
            mesh=mesh,
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=unit_mp,
            offload_policy=offload,
        )
    fully_shard(
        model, mesh=mesh, reshard_after_forward=False, mp_policy=root_mp, offload_policy=offload
    )


def finish_meta(model: nn.Module, config: FSDPConfig, device: torch.device) -> None:
    """A meta-device model after sharding: ``to_empty`` on its device (the host with CPU
    offload; buffers on ``device``), then ``config.init_fn`` under ``no_grad``."""
    assert config.init_fn is not None
    model.to_empty(device="cpu" if config.cpu_offload else device)
    if config.cpu_offload and device.type != "cpu":
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None:
                    module._buffers[name] = buf.to(device)
    with torch.no_grad():
        config.init_fn(model)


__all__ = [
    "MIXED_PRECISION",
    "FSDPConfig",
    "check_fsdp_model",
    "finish_meta",
    "is_sharded_module",
    "is_sharded_optimizer",
    "local_state_bytes",
    "prepare_sharding",
    "select_units",
    "shard_units",
    "wrap_fsdp",
]
