"""Lightning's sharded strategies on ringtrain's workers (:mod:`ringtrain.integrations.lightning`).

What each needs beyond the DDP path (the evidence is in docs/lightning.md):

* ``FSDPStrategy`` (FSDP1): Lightning refuses it without a GPU when the ``Trainer`` is built
  (``strategy="fsdp"`` or an ``FSDPStrategy()`` with ``accelerator="cpu"``: "The strategy `fsdp`
  requires a GPU accelerator", ``accelerator_connector.py``), and torch's
  ``FullyShardedDataParallel`` refuses a CPU module unless it is given ``device_id=cpu`` ("FSDP
  needs a non-CPU accelerator device"), which Lightning never passes
  (``device_id=self.root_device.index``, ``None`` on CPU). :class:`RingtrainFSDPStrategy` is
  Lightning's ``FSDPStrategy`` that wraps with ``device_id=torch.device("cpu")`` on a CPU worker
  (and is Lightning's own on a GPU worker); FSDP1 then trains on gloo.
* ``ModelParallelStrategy`` (FSDP2 + TP in ``configure_model``): runs on CPU as it is; its mesh
  ``("data_parallel", "tensor_parallel")`` must agree with ringtrain's ``ParallelConfig``
  (:func:`model_parallel_sizes`).
* ``DeepSpeedStrategy``: refused on CPU by Lightning itself (``setup_environment``: "The
  DeepSpeed strategy is only supported on CUDA GPUs"); :func:`strategy_problems` says so and
  names ``rt.prepare_deepspeed``.

Loading a sharded checkpoint runs DCP's reader, which unpickles ``.metadata`` with ``pickle`` and
non-tensor values with ``torch.load(weights_only=False)``, and FSDPStrategy loads a full
(``state_dict_type="full"``, its default) checkpoint with a plain ``pickle.Unpickler``
(``lightning.fabric.utilities.load._lazy_load``): :func:`safe_loading` replaces all three while
Lightning loads (ringtrain's allow-list reader, ``torch.load(weights_only=True)``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
)

from ringtrain.cluster.env import DistributedContext
from ringtrain.config.parallel import MeshShape

__all__ = [
    "RingtrainDeepSpeedStrategy",
    "RingtrainFSDPStrategy",
    "model_parallel_sizes",
    "reconcile_model_parallel",
    "safe_loading",
    "strategy_problems",
]


class RingtrainFSDPStrategy(FSDPStrategy):
    """Lightning's ``FSDPStrategy`` (FSDP1) that also runs on CPU workers (gloo).

    On a GPU worker it is Lightning's ``FSDPStrategy`` unchanged. On a CPU worker it wraps the
    module with ``FullyShardedDataParallel(..., device_id=torch.device("cpu"))``, the one
    argument torch needs to shard on CPU and Lightning does not pass; being a subclass, it also
    passes Lightning's "requires a GPU accelerator" check, which refuses only
    ``strategy="fsdp"`` and an exact ``FSDPStrategy``. Arguments are ``FSDPStrategy``'s.

    Example::

        trainer = pl.Trainer(strategy=RingtrainFSDPStrategy(), accelerator="cpu",
                             plugins=[RingtrainEnvironment()], callbacks=[RingtrainCallback()])
    """

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.fsdp import FullyShardedDataParallel

        wrapped = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
        if self.root_device.type == "cpu" and not wrapped:
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            # Lightning's own _setup_model now sees a wrapped model: it keeps it, and sets up
            # torchmetrics and activation checkpointing as usual (the policy was applied above).
            self.kwargs.pop("auto_wrap_policy", None)
        wrapped_model: torch.nn.Module = super()._setup_model(model)
        return wrapped_model

    # A full state dict (state_dict_type="full", Lightning's default) on CPU: torch's FSDP1 with
    # offload_to_cpu=True, which Lightning always asks for, crashes the process (SIGSEGV in
    # _full_post_state_dict_hook's clone, torch 2.13): the parameters are on CPU already, so
    # these three gather without offloading.

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with _no_offload(self.root_device.type == "cpu"):
            state: dict[str, Any] = super().lightning_module_state_dict()
            return state

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        with _no_offload(self.root_device.type == "cpu"):
            state: dict[str, Any] = super().optimizer_state(optimizer)
            return state

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        with _no_offload(self.root_device.type == "cpu"):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)


@contextlib.contextmanager
def _no_offload(active: bool) -> Iterator[None]:
    """While open (and ``active``), Lightning's FSDP full-state-dict context does not offload
    to CPU (see :class:`RingtrainFSDPStrategy`)."""
    if not active:
        yield
        return
    import lightning.pytorch.strategies.fsdp as lightning_fsdp

    original = lightning_fsdp._get_full_state_dict_context

    def context(module: torch.nn.Module, world_size: int, rank0_only: bool = True) -> Any:
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.api import FullOptimStateDictConfig

        return FSDP.state_dict_type(
            module=module,
            state_dict_type=StateDictType.FULL_STATE_DICT,
            state_dict_config=FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            optim_state_dict_config=FullOptimStateDictConfig(
                offload_to_cpu=False, rank0_only=rank0_only
            ),
        )

    lightning_fsdp._get_full_state_dict_context = context
    try:
        yield
    finally:
        lightning_fsdp._get_full_state_dict_context = original


class RingtrainDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` (ZeRO stage 1, 2 or 3) that also runs on CPU workers
    (DeepSpeed's CPU accelerator, gloo).

    On a GPU worker it is Lightning's ``DeepSpeedStrategy`` unchanged. On a CPU worker it sets
    ``DS_ACCELERATOR=cpu`` (unless set: DeepSpeed reads it once, when it first picks its
    accelerator) and steps around Lightning's three CUDA-only assumptions:
    ``setup_environment`` refuses a non-CUDA accelerator; ``setup_distributed`` checks that the
    device indices are the local ranks (a CPU device has none); ``deepspeed.initialize`` gets
    ``device_rank=root_device.index``, ``None`` on CPU, which DeepSpeed compares with 0. Arguments
    are ``DeepSpeedStrategy``'s.
    """

    # Lightning's ParallelStrategy property, typed here (mypy does not follow lightning).
    parallel_devices: list[torch.device] | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        super().__init__(*args, **kwargs)

    def _on_cpu(self) -> bool:
        return bool(self.parallel_devices) and self.root_device.type == "cpu"

    def setup_environment(self) -> None:
        if self._on_cpu():
            DDPStrategy.setup_environment(self)  # without the "only on CUDA GPUs" refusal
        else:
            super().setup_environment()

    def setup_distributed(self) -> None:
        if not self._on_cpu():
            super().setup_distributed()
            return
        from lightning.fabric.utilities.seed import reset_seed

        from ringtrain.parallel.deepspeed import no_compiled_ops

        reset_seed()
        self.set_world_ranks()
        # Else DeepSpeed's CPU backend JIT-compiles its shared-memory allreduce here, on first
        # use on a machine: ~75 s of C++ on 2 cores (the Lightning DeepSpeed parity test took
        # 100 s in a fresh CI, 23-35 s with the build cached).
        no_compiled_ops()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        if not self._on_cpu():
            return super()._setup_model_and_optimizer(*args, **kwargs)
        devices = self.parallel_devices
        assert devices is not None
        # DeepSpeed's CPU accelerator ignores the index; it only has to be the local rank.
        self.parallel_devices = [torch.device("cpu", i) for i in range(len(devices))]
        try:
            return super()._setup_model_and_optimizer(*args, **kwargs)
        finally:
            self.parallel_devices = devices


# ------------------------------------------------------------------------------------- checking


def strategy_problems(strategy: Any, ctx: DistributedContext, env_type: type) -> list[str]:
    """What is wrong with ``strategy`` on this worker, each with its fix (empty: nothing).

    Args:
        strategy: the Trainer's strategy (a ``ParallelStrategy``).
        ctx: this worker's context.
        env_type: the cluster environment class the strategy must use
            (``RingtrainEnvironment``).
    """
    name = type(strategy).__name__
    on_cpu = not ctx.use_gpu
    if isinstance(strategy, DeepSpeedStrategy) and on_cpu:
        ours = isinstance(strategy, RingtrainDeepSpeedStrategy)
        return _environment(strategy, env_type) if ours else [_deepspeed_problem(strategy)]
    if not isinstance(strategy, (DDPStrategy, FSDPStrategy, ModelParallelStrategy)):
        return [
            f"the Trainer runs {name}; the ringtrain integration supports Lightning's "
            "DDPStrategy (strategy='ddp'), FSDPStrategy (RingtrainFSDPStrategy() on CPU), "
            "ModelParallelStrategy and DeepSpeedStrategy (RingtrainDeepSpeedStrategy() on CPU)"
        ]
    problems = []
    start_method = getattr(strategy, "_start_method", "popen")
    if start_method != "popen":
        problems.append(
            f"the Trainer's DDP strategy starts its own processes (start_method={start_method!r}, "
            "as strategy='ddp_spawn', 'ddp_fork' or 'ddp_notebook' do), but ringtrain already "
            "started one process per worker: pass pl.Trainer(strategy='ddp')"
        )
    if isinstance(strategy, FSDPStrategy):
        problems += _fsdp_problems(strategy, ctx)
    if isinstance(strategy, ModelParallelStrategy):
        problems += _model_parallel_problems(strategy, ctx)
    return problems + _environment(strategy, env_type)


def _environment(strategy: ParallelStrategy, env_type: type) -> list[str]:
    env = strategy.cluster_environment
    if isinstance(env, env_type):
        return []
    return [
        f"the Trainer's cluster environment is {type(env).__name__}, which does not know "
        "ringtrain's ranks and world size: pass pl.Trainer(..., plugins=[RingtrainEnvironment()])"
    ]


def _deepspeed_problem(strategy: Any) -> str:
    return (
        f"the Trainer runs {type(strategy).__name__} on CPU workers, which Lightning refuses "
        "(DeepSpeedStrategy.setup_environment: 'The DeepSpeed strategy is only supported on "
        "CUDA GPUs'): use pl.Trainer(strategy=RingtrainDeepSpeedStrategy(stage=...)) (from "
        "ringtrain.integrations.lightning), or give the workers GPUs "
        "(ScalingConfig(use_gpu=True))"
    )


def _fsdp_problems(strategy: FSDPStrategy, ctx: DistributedContext) -> list[str]:
    problems = []
    if not ctx.use_gpu and not isinstance(strategy, RingtrainFSDPStrategy):
        problems.append(
            f"the Trainer runs {type(strategy).__name__} on a CPU worker, where torch's FSDP "
            "needs device_id=cpu, which Lightning does not pass: use "
            "pl.Trainer(strategy=RingtrainFSDPStrategy(...)) "
            "(from ringtrain.integrations.lightning)"
        )
    return problems


def _model_parallel_problems(strategy: ModelParallelStrategy, ctx: DistributedContext) -> list[str]:
    try:
        model_parallel_sizes(strategy, ctx)
    except ValueError as exc:
        return [str(exc)]
    return []


# ----------------------------------------------------------------------------------------- mesh


def model_parallel_sizes(
    strategy: ModelParallelStrategy, ctx: DistributedContext
) -> tuple[int, int]:
    """``(data_parallel_size, tensor_parallel_size)`` of ``strategy`` on ringtrain's mesh.

    ringtrain's mesh (``ScalingConfig.parallel``, or ``dp_shard`` = world size without one)
    maps onto Lightning's two dimensions as ``data_parallel = dp_replicate * dp_shard`` and
    ``tensor_parallel = tp`` (both put tensor-parallel peers on adjacent ranks). A size left at
    ``"auto"`` is taken from ringtrain's mesh (Lightning's own "auto", the number of nodes x the
    devices per node, does not apply: ringtrain decides the layout); a size given must agree.

    Raises:
        ValueError: ``pp > 1`` (Lightning's strategy has no pipeline dimension), or a size that
            contradicts ``ScalingConfig.parallel`` or the world size; the message names the fix.
    """
    shape: MeshShape = ctx.config.mesh or MeshShape(dp_shard=ctx.world_size)
    if shape.pp > 1:
        raise ValueError(
            f"ScalingConfig.parallel has pp={shape.pp}, but Lightning's ModelParallelStrategy has "
            "no pipeline dimension: use pp=1 with Lightning, or rt.prepare_pipeline in a plain "
            "train function"
        )
    derived = {"data_parallel_size": shape.dp_size, "tensor_parallel_size": shape.tp}
    given = {
        "data_parallel_size": strategy._data_parallel_size,
        "tensor_parallel_size": strategy._tensor_parallel_size,
    }
    source = (
        f"ScalingConfig.parallel (dp_replicate={shape.dp_replicate} x dp_shard="
        f"{shape.dp_shard}, tp={shape.tp})"
        if ctx.config.mesh is not None
        else f"ringtrain's {ctx.world_size} workers (no ScalingConfig.parallel: all data-parallel)"
    )
    wrong = [f"{k}={given[k]}" for k in derived if given[k] != "auto" and given[k] != derived[k]]
    if wrong:
        raise ValueError(
            f"ModelParallelStrategy({', '.join(wrong)}) contradicts {source}, which gives "
            f"data_parallel_size={derived['data_parallel_size']}, tensor_parallel_size="
            f"{derived['tensor_parallel_size']}: leave both at 'auto' (ringtrain fills them in) "
            "or set ScalingConfig(parallel=rt.ParallelConfig(dp_shard=..., tp=...)) to match"
        )
    return derived["data_parallel_size"], derived["tensor_parallel_size"]


def reconcile_model_parallel(strategy: ModelParallelStrategy, ctx: DistributedContext) -> None:
    """Fill ``strategy``'s sizes from ringtrain's mesh (:func:`model_parallel_sizes`)."""
    dp, tp = model_parallel_sizes(strategy, ctx)
    strategy._data_parallel_size = dp
    strategy._tensor_parallel_size = tp


# -------------------------------------------------------------------------------------- loading


def _deepspeed_globals() -> list[Any]:
    """DeepSpeed's data-only classes that its checkpoints pickle (loss scalers, the ZeRO stage
    enum, ZeRO-1/2's ``fragment_address(numel, start)`` in ``param_slice_mappings``), allowed
    beside ``weights_only``'s own when DeepSpeed is in use."""
    import sys

    if "deepspeed" not in sys.modules:
        return []
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def safe_loading() -> Iterator[None]:
    """While it is open, loading a checkpoint cannot run code: ``torch.load`` always uses
    ``weights_only=True``, DCP's ``FileSystemReader.read_metadata`` parses ``.metadata`` with
    ringtrain's allow-list reader (:mod:`ringtrain.checkpoint.dcp_metadata`) instead of
    ``pickle``, and FSDPStrategy's full-checkpoint loader (``_lazy_load``, a plain
    ``pickle.Unpickler``) is ``torch.load(weights_only=True)`` (allowing DeepSpeed's loss
    scaler and ZeRO-stage classes, data only, when DeepSpeed is loaded). Lightning's strategies
    load through these (``torch.distributed.checkpoint.load`` with the default reader and
    planner, ``torch.load`` of ``meta.pt``). Process-wide while open: open it only around a
    load, in a worker."""
    import lightning.pytorch.strategies.fsdp as lightning_fsdp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from ringtrain.checkpoint.sharded import _safe_reader

    original_load = torch.load
    original_read = FileSystemReader.read_metadata
    original_lazy = lightning_fsdp._lazy_load

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(_deepspeed_globals()):
            return original_load(*args, **kwargs)

    def read_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        safe = _safe_reader(str(self.path), fsspec_url=False)
        safe.load_id = self.load_id
        return safe.read_metadata(*args, **kwargs)

    def lazy_load(filename: Any) -> Any:
        return original_load(filename, map_location="cpu", weights_only=True)

    torch.load = load
    FileSystemReader.read_metadata = read_metadata  # type: ignore[method-assign]
    lightning_fsdp._lazy_load = lazy_load
    try:
        yield
    finally:
        torch.load = original_load
        FileSystemReader.read_metadata = original_read  # type: ignore[method-assign]
        lightning_fsdp._lazy_load = original_lazy
