"""DeepSpeed ZeRO (stages 1, 2 and 3) on ringtrain's workers, in DeepSpeed's own vocabulary.

``rt.prepare_deepspeed(model, config={...})`` is ``deepspeed.initialize`` on the process group
ringtrain already formed (no second rendezvous: DeepSpeed's communication backend wraps the
initialised ``torch.distributed`` group), with DeepSpeed's CPU accelerator chosen when the
worker has no GPU, and the config checked against the run (world size, batch sizes) first.
The engine it returns goes into :class:`ringtrain.TrainState` as ``model=``: a checkpoint then
holds DeepSpeed's own checkpoint (:mod:`ringtrain.checkpoint.deepspeed_io`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ringtrain.worker.session import get_context


def _check_batch(config: Mapping[str, Any], world_size: int) -> None:
    """Refuse batch sizes that cannot hold at ``world_size`` data-parallel ranks, naming the
    field and the fix (DeepSpeed's own message only says that they disagree)."""
    train = config.get("train_batch_size")
    micro = config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    if train is None and micro is None:
        raise ValueError(
            "prepare_deepspeed: config names neither 'train_batch_size' nor "
            "'train_micro_batch_size_per_gpu' (set 'train_micro_batch_size_per_gpu' to the "
            "per-worker batch size of your prepare_data_loader loader)"
        )
    for field, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(
                f"prepare_deepspeed: config[{field!r}] must be an int >= 1, got {value!r}"
            )
    if train is None:
        return
    if micro is not None and accum is not None and train != micro * accum * world_size:
        raise ValueError(
            f"prepare_deepspeed: config['train_batch_size']={train} must equal "
            f"train_micro_batch_size_per_gpu ({micro}) x gradient_accumulation_steps ({accum}) x "
            f"the run's {world_size} workers = {micro * accum * world_size} (drop "
            "'train_batch_size' to let DeepSpeed derive it)"
        )
    per_rank = micro if micro is not None else 1
    if train % (per_rank * world_size):
        raise ValueError(
            f"prepare_deepspeed: config['train_batch_size']={train} is not a multiple of "
            f"{world_size} workers x micro batch {per_rank} (use a multiple of "
            f"{per_rank * world_size}, or give 'train_micro_batch_size_per_gpu' alone)"
        )


def _check_config(config: Mapping[str, Any], world_size: int) -> None:
    """Refuse what contradicts ringtrain's run, naming the field and the fix."""
    if not isinstance(config, Mapping):
        raise TypeError(
            f"prepare_deepspeed: config must be DeepSpeed's config dict, got "
            f"{type(config).__name__} (load a JSON file with json.load first)"
        )
    _check_batch(config, world_size)
    zero = config.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else zero
    if stage not in (0, 1, 2, 3):
        raise ValueError(
            f"prepare_deepspeed: config['zero_optimization']['stage'] must be 0, 1, 2 or 3, "
            f"got {stage!r}"
        )
    for precision in ("fp16",):
        section = config.get(precision, {})
        if (
            isinstance(section, Mapping)
            and section.get("enabled")
            and not torch.cuda.is_available()
        ):
            raise ValueError(
                f"prepare_deepspeed: config['{precision}']['enabled'] needs a GPU: DeepSpeed's "
                "CPU accelerator has no fp16 training (use 'bf16' or fp32 on CPU)"
            )


def _use_cpu_accelerator() -> None:
    """DeepSpeed picks its accelerator once, from ``DS_ACCELERATOR`` or by probing for CUDA
    libraries; a worker without a GPU must get the CPU one (gloo, no compiled ops)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def no_compiled_ops() -> None:
    """On CPU, DeepSpeed's communication backend JIT-compiles a shared-memory allreduce (C++,
    ninja, minutes on a cold cache) that only its inference path uses; mark it incompatible so
    that nothing is compiled: training collectives go through the gloo group. Used by
    :func:`prepare_deepspeed` and by Lightning's ``RingtrainDeepSpeedStrategy``. A no-op with a
    GPU."""
    if torch.cuda.is_available():
        return
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None:
        deepspeed.ops.__compatible_ops__[builder.NAME] = False


def prepare_deepspeed(
    model: torch.nn.Module,
    config: Mapping[str, Any],
    *,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: Any = None,
) -> tuple[Any, Any]:
    """``deepspeed.initialize`` on ringtrain's process group; call it in the train function.

    Args:
        model: the model, built the same on every rank (seed it).
        config: DeepSpeed's config dict, in its vocabulary (``zero_optimization``, ``optimizer``,
            ``scheduler``, ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
            ``gradient_clipping``, ``bf16``...). ``train_micro_batch_size_per_gpu`` is the
            per-worker batch of the ``prepare_data_loader`` loader.
        optimizer: a ``torch.optim.Optimizer`` (or a callable of the parameters), instead of the
            config's ``optimizer`` section.
        model_parameters: what the optimizer optimizes (default: ``model.parameters()``).
        lr_scheduler: an LR scheduler (or a callable of the optimizer), instead of the config's
            ``scheduler`` section.

    Returns:
        ``(engine, optimizer)``: ``engine(x)`` runs the model, ``engine.backward(loss)`` and
        ``engine.step()`` train it (ZeRO's partitioned gradient reduction and update; the
        LR scheduler steps inside). Save it with ``rt.TrainState(model=engine, ...)``.

    Raises:
        ImportError: DeepSpeed is not installed (``pip install 'ringtrain[deepspeed]'``).
        ValueError / TypeError: the config contradicts the run (batch sizes that do not fit the
            world size, an unknown ZeRO stage, fp16 without a GPU), naming the field and fix.
        RuntimeError: no process group (call it inside a ringtrain train function).
    """
    ctx = get_context()
    _check_config(config, ctx.world_size)
    if ctx.world_size > 1 and not torch.distributed.is_initialized():
        raise RuntimeError(
            "prepare_deepspeed: no process group: call it inside a train function that "
            "ringtrain runs (Trainer(...).fit())"
        )
    _use_cpu_accelerator()
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "prepare_deepspeed needs DeepSpeed: pip install 'ringtrain[deepspeed]'"
        ) from exc
    no_compiled_ops()
    if not torch.distributed.is_initialized():  # one process: a group of one, no rendezvous
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1
        )
    # dist_init_required=False: DeepSpeed wraps the initialised group, never rendezvouses.
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    engine, ds_optimizer, _loader, _scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters if model_parameters is not None else model.parameters(),
        lr_scheduler=lr_scheduler,
        config=dict(config),
        dist_init_required=False,
    )
    return engine, ds_optimizer
