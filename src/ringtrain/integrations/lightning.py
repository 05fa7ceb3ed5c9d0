"""PyTorch Lightning on ringtrain's workers: keep the ``LightningModule``, gain ringtrain's
orchestration (fault tolerance, checkpoint retention, monitoring).

ringtrain starts one process per worker; in each, Lightning's own ``DDPStrategy``
(``strategy="ddp"``) runs as if torchrun had started it::

    def train_fn(config):
        trainer = pl.Trainer(max_epochs=config["epochs"], accelerator="auto", devices="auto",
                             strategy="ddp", plugins=[RingtrainEnvironment()],
                             callbacks=[RingtrainCallback()])
        trainer = prepare_trainer(trainer)
        trainer.fit(MyModule(config), datamodule=MyData())

    rt.Trainer(train_fn, scaling_config=rt.ScalingConfig(num_workers=2)).fit()

Three pieces, modelled on Lightning's ``TorchElasticEnvironment`` (a cluster environment whose
processes are created by someone else) and on the roles of Ray Train's ``RayLightningEnvironment``,
``prepare_trainer`` and ``RayTrainReportCallback``:

* :class:`RingtrainEnvironment`: a Lightning ``ClusterEnvironment`` that reads rank, world size,
  local rank, node rank and the rendezvous address from :func:`ringtrain.get_context`.
* :func:`prepare_trainer`: checks that the ``Trainer`` fits the worker group and explains each
  mismatch; makes Lightning's device/node counts agree with ringtrain's world size; on a
  restarted attempt, points ``trainer.ckpt_path`` at the run's latest checkpoint.
* :class:`RingtrainCallback` (in :mod:`ringtrain.integrations.lightning_callback`, importable
  from here): reports ``trainer.callback_metrics`` with a checkpoint at the end of
  every training epoch (and every ``every_n_steps`` optimizer steps).

A checkpoint of this integration holds ``lightning.ckpt`` (``Trainer.save_checkpoint``, written
by rank 0: model, optimizers, LR schedulers, loop progress, callbacks, and the state of stateful
data loaders) and one ``lightning_rng_rank_NNNNN.pt`` per rank (its Python, NumPy, torch and CUDA
RNG states, which Lightning's checkpoint does not hold). Lightning, not this module, restores the
first; the callback restores the second in its ``setup`` hook, before Lightning builds the data
loaders. Sharded strategies (FSDP, ModelParallel) write ``lightning.ckpt/`` instead, a directory
of every rank's shards (:func:`~ringtrain.integrations.lightning_callback.own_files`).

The sharded strategies, what Lightning and torch refuse on CPU and the work-arounds, are in
:mod:`ringtrain.integrations.lightning_strategies` (:class:`RingtrainFSDPStrategy`).

This module imports ``lightning``; ``import ringtrain`` never imports it.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol, cast

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import (
        ModelParallelStrategy,
        ParallelStrategy,
        SingleDeviceStrategy,
    )
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"{__name__} needs PyTorch Lightning 2.x, which cannot be imported ({exc}): "
        "pip install 'ringtrain[lightning]'"
    ) from exc

from ringtrain.cluster.env import DistributedContext, detect_source
from ringtrain.integrations.lightning_callback import (
    CHECKPOINT_FILE,
    RingtrainCallback,
    get_ckpt_path,
    own_files,
    rng_file,
)
from ringtrain.integrations.lightning_strategies import (
    RingtrainDeepSpeedStrategy,
    RingtrainFSDPStrategy,
    reconcile_model_parallel,
    safe_loading,
    strategy_problems,
)
from ringtrain.worker.session import get_context

__all__ = [
    "CHECKPOINT_FILE",
    "RingtrainCallback",
    "RingtrainDeepSpeedStrategy",
    "RingtrainEnvironment",
    "RingtrainFSDPStrategy",
    "get_ckpt_path",
    "own_files",
    "prepare_trainer",
    "rng_file",
]

logger = logging.getLogger("ringtrain")


class _Placed(Protocol):
    """What :func:`prepare_trainer` sets on a strategy: every Lightning ``ParallelStrategy``
    (DDP, FSDP, DeepSpeed, ModelParallel) has these, though the base class does not declare
    ``num_nodes`` and ``set_world_ranks``."""

    parallel_devices: list[torch.device] | None
    num_nodes: int

    def set_world_ranks(self) -> None: ...

    def _configure_launcher(self) -> None: ...


# ------------------------------------------------------------------------------------ environment


class RingtrainEnvironment(ClusterEnvironment):
    """A Lightning ``ClusterEnvironment`` for processes that ringtrain started.

    Every value comes from :func:`ringtrain.get_context` (the local launcher's variables, or the
    Ray backend's), read when Lightning asks. ringtrain, not Lightning, creates the processes
    (``creates_processes_externally`` is True), and the world size and ranks are fixed by ringtrain:
    Lightning's ``set_world_size`` / ``set_global_rank`` (which compute ``num_nodes * devices``)
    are ignored here; :func:`prepare_trainer` makes the strategy's counts agree instead.

    Args:
        context: the worker's context (default: :func:`ringtrain.get_context` at each call).
    """

    def __init__(self, context: DistributedContext | None = None) -> None:
        super().__init__()
        self._context = context

    @property
    def context(self) -> DistributedContext:
        return self._context if self._context is not None else get_context()

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self.context.master_addr

    @property
    def main_port(self) -> int:
        return self.context.master_port

    @staticmethod
    def detect() -> bool:
        """True in a worker process that ringtrain started."""
        return detect_source() == "ringtrain"

    def world_size(self) -> int:
        return self.context.world_size

    def set_world_size(self, size: int) -> None:
        if size != self.context.world_size:
            logger.debug(
                "Lightning computed world size %d (num_nodes * devices); ringtrain's is %d and "
                "wins (prepare_trainer reconciles the two)",
                size,
                self.context.world_size,
            )

    def global_rank(self) -> int:
        return self.context.world_rank

    def set_global_rank(self, rank: int) -> None:
        pass  # ringtrain assigns ranks

    def local_rank(self) -> int:
        return self.context.local_rank

    def node_rank(self) -> int:
        return self.context.node_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Called by Lightning's launcher when ``fit`` starts.

        Raises:
            ValueError: if ``num_devices * num_nodes`` differs from ringtrain's world size (the
                trainer was not passed through :func:`prepare_trainer`).
        """
        world_size = self.context.world_size
        if num_devices * num_nodes != world_size:
            raise ValueError(
                f"Lightning runs devices={num_devices} x num_nodes={num_nodes} = "
                f"{num_devices * num_nodes} processes, but ringtrain started {world_size} "
                "workers: call `trainer = prepare_trainer(trainer)` "
                "(ringtrain.integrations.lightning) before trainer.fit()"
            )

    def __repr__(self) -> str:
        ctx = self.context
        return (
            f"RingtrainEnvironment(rank={ctx.world_rank}, world_size={ctx.world_size}, "
            f"local_rank={ctx.local_rank}, node_rank={ctx.node_rank})"
        )


# -------------------------------------------------------------------------------- prepare_trainer


def prepare_trainer(trainer: pl.Trainer) -> pl.Trainer:
    """Check that ``trainer`` fits ringtrain's worker group, reconcile the two, and resume.

    Lightning computes its world size as ``num_nodes * devices`` and gives each process
    ``parallel_devices[local_rank]``; ringtrain has already fixed the world size, the ranks and
    each worker's device. This function:

    1. checks the strategy: Lightning's ``DDPStrategy`` started as a script (``strategy="ddp"``),
       not one that spawns its own processes (``ddp_spawn``, ``ddp_fork``, ``ddp_notebook``);
       ``FSDPStrategy`` (on CPU: :class:`RingtrainFSDPStrategy`), ``ModelParallelStrategy``
       (its sizes must agree with ``ScalingConfig.parallel``), ``DeepSpeedStrategy`` on GPU
       workers only (:mod:`ringtrain.integrations.lightning_strategies` says why); a
       single-device strategy is accepted only for a world size of 1;
    2. checks that the cluster environment is a :class:`RingtrainEnvironment`;
    3. checks the device type against ``ScalingConfig.use_gpu`` and the ``devices`` and
       ``num_nodes`` the Trainer was given against the worker group (``devices`` may be 1, the
       number of workers on this node, or what ``devices="auto"`` resolves to; ``num_nodes``
       may be 1 or the number of nodes ringtrain uses);
    4. sets the strategy's ``parallel_devices`` (this worker's device, ``get_context().device``,
       at every local rank) and ``num_nodes`` so that ``num_nodes * devices`` equals ringtrain's
       world size: Lightning's ``DistributedSampler`` then shards the data into exactly
       ``world_size`` parts, and each rank computes on the device ringtrain gave it. (When the
       workers are spread unevenly over nodes, it uses one "node" of ``world_size`` devices.)
       A ``ModelParallelStrategy`` gets its ``data_parallel_size`` and
       ``tensor_parallel_size`` from ringtrain's mesh (its sampler shards over
       ``data_parallel`` only);
    5. on a restarted attempt (or a run started again with the same name), sets
       ``trainer.ckpt_path`` to the latest checkpoint (:func:`get_ckpt_path`), unless a path is
       already set: ``trainer.fit(...)`` then resumes from it without a ``ckpt_path`` argument.

    Args:
        trainer: a ``lightning.pytorch.Trainer`` built in the train function.

    Returns:
        The same trainer, reconciled.

    Raises:
        ValueError: listing every mismatch found, each with its fix.
        TypeError: if ``trainer`` is not a ``lightning.pytorch.Trainer``.
    """
    if not isinstance(trainer, pl.Trainer):
        raise TypeError(
            f"{__name__}.prepare_trainer(trainer) takes a {pl.__name__}.Trainer, got "
            f"{type(trainer).__module__}.{type(trainer).__name__}: each Lightning package has "
            "its own bridge module (docs/lightning.md); ringtrain.train.lightning's names follow "
            "the package your code imports"
        )
    ctx = get_context()
    strategy = trainer.strategy
    problems = _check_strategy(strategy, ctx)
    if not problems and isinstance(strategy, ParallelStrategy):
        problems = _check_devices(trainer, cast(_Placed, strategy), ctx)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"prepare_trainer: this Trainer does not fit ringtrain's worker group (rank "
            f"{ctx.world_rank} of world size {ctx.world_size}, {ctx.local_world_size} worker(s) "
            f"on this node):\n{lines}"
        )
    if isinstance(strategy, ParallelStrategy):
        _reconcile(cast(_Placed, strategy), ctx)
    if trainer.ckpt_path is None:
        path = get_ckpt_path()
        if path is not None:
            trainer.ckpt_path = path
            _force_weights_only(strategy)
            logger.info("rank %d: Lightning resumes from %s", ctx.world_rank, path)
    if not any(isinstance(cb, RingtrainCallback) for cb in getattr(trainer, "callbacks", [])):
        logger.warning(
            "prepare_trainer: the Trainer has no RingtrainCallback, so no metrics or checkpoints "
            "reach ringtrain and a restarted worker group starts from scratch "
            "(pass callbacks=[RingtrainCallback()])"
        )
    return trainer


def _check_strategy(strategy: Any, ctx: DistributedContext) -> list[str]:
    name = type(strategy).__name__
    if isinstance(strategy, SingleDeviceStrategy):
        if ctx.world_size == 1:
            return []
        return [
            f"the Trainer runs {name} (strategy='auto' picks it for one device), which does not "
            f"average gradients across ringtrain's {ctx.world_size} workers: pass "
            "pl.Trainer(strategy='ddp')"
        ]
    return strategy_problems(strategy, ctx, RingtrainEnvironment)


def _check_devices(trainer: pl.Trainer, strategy: _Placed, ctx: DistributedContext) -> list[str]:
    problems = []
    devices = list(strategy.parallel_devices or [])
    wanted = ctx.device
    kind = devices[0].type if devices else "cpu"
    if kind != wanted.type:
        if wanted.type == "cuda":
            fix = "pass pl.Trainer(accelerator='gpu') (or 'auto')"
        else:
            fix = (
                "pass pl.Trainer(accelerator='cpu'), or give each worker a GPU with "
                "ScalingConfig(use_gpu=True)"
            )
        problems.append(
            f"the Trainer computes on {kind!r} but ringtrain gave this worker {wanted} "
            f"(ScalingConfig.use_gpu={ctx.use_gpu}): {fix}"
        )
    lws = ctx.local_world_size
    try:
        auto = int(trainer.accelerator.auto_device_count())
    except Exception:
        auto = 1
    n = len(devices)
    if n not in {1, lws, auto}:
        problems.append(
            f"pl.Trainer(devices={n}) asks Lightning for {n} processes per node, but ringtrain "
            f"runs {lws} worker(s) on this node and each worker is one Lightning process: pass "
            f"devices='auto' (or devices={lws}) and choose the number of workers with "
            "ScalingConfig(num_workers=...)"
        )
    nodes = ctx.world_size // lws if ctx.world_size % lws == 0 else None
    if strategy.num_nodes not in {1, nodes}:
        problems.append(
            f"pl.Trainer(num_nodes={strategy.num_nodes}) does not match ringtrain's worker group "
            f"(world size {ctx.world_size}, {lws} worker(s) per node"
            + (f", so {nodes} node(s)" if nodes else "")
            + "): leave num_nodes at its default; prepare_trainer sets it from ringtrain"
        )
    return problems


def _reconcile(strategy: _Placed, ctx: DistributedContext) -> None:
    lws, world = ctx.local_world_size, ctx.world_size
    if world % lws == 0:
        per_node, nodes = lws, world // lws
    else:  # uneven placement: one "node" of world_size devices keeps the sampler right
        per_node, nodes = world, 1
    before = (len(strategy.parallel_devices or []), strategy.num_nodes)
    # Every slot holds this worker's device: Lightning only ever uses parallel_devices[local_rank]
    # (the root device) and len(parallel_devices) (processes per node).
    strategy.parallel_devices = [ctx.device] * per_node
    strategy.num_nodes = nodes
    strategy.set_world_ranks()
    strategy._configure_launcher()  # its launcher captured the old counts
    if isinstance(strategy, ModelParallelStrategy):
        reconcile_model_parallel(strategy, ctx)
    if before != (per_node, nodes):
        logger.debug(
            "prepare_trainer: Lightning devices x num_nodes %d x %d -> %d x %d (world size %d)",
            before[0],
            before[1],
            per_node,
            nodes,
            world,
        )


# ------------------------------------------------------------------------------------- checkpoint


def _force_weights_only(strategy: Any) -> None:
    """Make ``strategy`` load checkpoints with ``torch.load(weights_only=True)`` whatever the
    caller or the environment asks: Lightning passes ``weights_only=None``, which
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into an unrestricted (code-running) load, and a
    checkpoint from the run directory must never run code (docs/security.md). Sharded
    strategies' other readers (DCP's ``.metadata``, FSDP's ``_lazy_load``) are made safe by
    :func:`~ringtrain.integrations.lightning_strategies.safe_loading` around the load."""
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        # Sharded strategies broadcast rank 0's path before loading; each rank has its own
        # verified copy (rank 0's may be on another node, or deleted once rank 0 has loaded):
        # every rank loads its own.
        broadcast = strategy.broadcast
        strategy.broadcast = lambda obj, src=0: obj
        try:
            with safe_loading():  # sharded checkpoints: DCP's .metadata and values, meta.pt
                return original(checkpoint_path, weights_only=True)
        finally:
            strategy.broadcast = broadcast

    strategy.load_checkpoint = load_checkpoint
