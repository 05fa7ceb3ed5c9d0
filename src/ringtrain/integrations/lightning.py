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
* :class:`RingtrainCallback`: reports ``trainer.callback_metrics`` with a checkpoint at the end of
  every training epoch (and every ``every_n_steps`` optimizer steps).

A checkpoint of this integration holds ``lightning.ckpt`` (``Trainer.save_checkpoint``, written
by rank 0: model, optimizers, LR schedulers, loop progress, callbacks, and the state of stateful
data loaders) and one ``lightning_rng_rank_NNNNN.pt`` per rank (its Python, NumPy, torch and CUDA
RNG states, which Lightning's checkpoint does not hold). Lightning, not this module, restores the
first; the callback restores the second in its ``setup`` hook, before Lightning builds the data
loaders.

This module imports ``lightning``; ``import ringtrain`` never imports it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.plugins.environments import ClusterEnvironment
    from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "ringtrain.integrations.lightning needs PyTorch Lightning 2.x (the `lightning` package): "
        "pip install 'ringtrain[lightning]'"
    ) from exc

from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.env import DistributedContext, detect_source
from ringtrain.session import get_checkpoint, get_context, report
from ringtrain.state import capture_rng, restore_rng

__all__ = [
    "CHECKPOINT_FILE",
    "RingtrainCallback",
    "RingtrainEnvironment",
    "get_ckpt_path",
    "prepare_trainer",
]

logger = logging.getLogger("ringtrain")

CHECKPOINT_FILE = "lightning.ckpt"
"""The file ``Trainer.save_checkpoint`` writes in each checkpoint of this integration."""


def rng_file(rank: int) -> str:
    """The per-rank RNG file of ``rank`` in a checkpoint of this integration."""
    return f"lightning_rng_rank_{rank:05d}.pt"


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
       a single-device strategy is accepted only for a world size of 1;
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
            "prepare_trainer(trainer) takes a lightning.pytorch.Trainer, got "
            f"{type(trainer).__module__}.{type(trainer).__name__} (the `pytorch_lightning` "
            "package is not supported: `import lightning.pytorch as pl`)"
        )
    ctx = get_context()
    strategy = trainer.strategy
    problems = _check_strategy(strategy, ctx)
    if not problems and isinstance(strategy, DDPStrategy):
        problems = _check_devices(trainer, strategy, ctx)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ValueError(
            f"prepare_trainer: this Trainer does not fit ringtrain's worker group (rank "
            f"{ctx.world_rank} of world size {ctx.world_size}, {ctx.local_world_size} worker(s) "
            f"on this node):\n{lines}"
        )
    if isinstance(strategy, DDPStrategy):
        _reconcile(strategy, ctx)
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
    if not isinstance(strategy, DDPStrategy) or isinstance(strategy, DeepSpeedStrategy):
        return [
            f"the Trainer runs {name}; the ringtrain integration supports Lightning's "
            "DDPStrategy: pass pl.Trainer(strategy='ddp')"
        ]
    problems = []
    start_method = getattr(strategy, "_start_method", "popen")
    if start_method != "popen":
        problems.append(
            f"the Trainer's DDP strategy starts its own processes (start_method={start_method!r}, "
            "as strategy='ddp_spawn', 'ddp_fork' or 'ddp_notebook' do), but ringtrain already "
            "started one process per worker: pass pl.Trainer(strategy='ddp')"
        )
    env = strategy.cluster_environment
    if not isinstance(env, RingtrainEnvironment):
        problems.append(
            f"the Trainer's cluster environment is {type(env).__name__}, which does not know "
            "ringtrain's ranks and world size: pass pl.Trainer(..., "
            "plugins=[RingtrainEnvironment()])"
        )
    return problems


def _check_devices(
    trainer: pl.Trainer, strategy: DDPStrategy, ctx: DistributedContext
) -> list[str]:
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


def _reconcile(strategy: DDPStrategy, ctx: DistributedContext) -> None:
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
    checkpoint from the run directory must never run code (docs/security.md)."""
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        return original(checkpoint_path, weights_only=True)

    strategy.load_checkpoint = load_checkpoint


def get_ckpt_path(checkpoint: Checkpoint | None = None) -> str | None:
    """The ``lightning.ckpt`` of the run's latest checkpoint, for ``trainer.fit(ckpt_path=...)``.

    :func:`prepare_trainer` calls it; call it yourself only to resume a Trainer that does not go
    through ``prepare_trainer``.

    Args:
        checkpoint: the checkpoint to resume from (default: :func:`ringtrain.get_checkpoint`).

    Returns:
        A private local copy of the file, verified against the checkpoint's signed manifest,
        or ``None`` on a fresh run.

    Raises:
        FileNotFoundError: if the checkpoint has no ``lightning.ckpt`` (it was not written by
            :class:`RingtrainCallback`).
    """
    ckpt = checkpoint if checkpoint is not None else get_checkpoint()
    if ckpt is None:
        return None
    if not ckpt.has_file(CHECKPOINT_FILE):
        raise FileNotFoundError(
            f"{ckpt.uri} has no {CHECKPOINT_FILE}: it was not written by RingtrainCallback, so a "
            "Lightning Trainer cannot resume from it (start a new run with another "
            "RunConfig(name=...))"
        )
    # Lightning reads a path: it gets a private copy, checked against the manifest's SHA-256
    # as it was copied (the same path for every call on this checkpoint handle).
    return ckpt.verified_copy(CHECKPOINT_FILE)


def _load_rng(ckpt: Checkpoint, rank: int) -> dict[str, Any] | None:
    from ringtrain.state import _load

    state: dict[str, Any] | None = _load(ckpt, rng_file(rank))
    return state


# --------------------------------------------------------------------------------------- callback


class RingtrainCallback(pl.Callback):
    """Report Lightning's metrics and checkpoints to ringtrain.

    At the end of every training epoch (after that epoch's validation), and every
    ``every_n_steps`` optimizer steps if given, every rank calls :func:`ringtrain.report` with its
    ``trainer.callback_metrics`` (0-d tensors become floats; ``epoch`` and ``step``, the global
    step, are added) and a checkpoint: ``trainer.save_checkpoint`` writes ``lightning.ckpt``
    (Lightning's DDP writes it on global rank 0 only) and every rank its RNG states, into a
    temporary directory that ``report`` copies into the run's ``checkpoint_NNNNNN`` and that is
    then deleted. Every rank reports at the same points, as ``report`` requires.

    On a restarted attempt, :func:`prepare_trainer` points Lightning at that checkpoint; this
    callback then restores the rank's RNG states in its ``setup`` hook. The resumed run continues
    exactly where the checkpoint was taken: at an epoch's end with any data loader; mid-epoch (a
    checkpoint of ``every_n_steps``) when the training data loader is stateful (has
    ``state_dict``/``load_state_dict``, as ``rt.prepare_data_loader``'s loader and torchdata's
    ``StatefulDataLoader`` do; Lightning saves rank 0's loader state). With a plain
    ``DataLoader``, Lightning restarts a resumed epoch's data from its first batch.

    Outside a ringtrain run (no run directory) only the metrics are reported.

    Args:
        every_n_steps: also report (with a checkpoint) every this many optimizer steps
            (``trainer.global_step``); ``None``: only at epoch ends.
        checkpoint: attach checkpoints (``False``: metrics only, nothing to resume from).

    Raises:
        ValueError: if ``every_n_steps`` is not a positive int or None.
    """

    def __init__(self, every_n_steps: int | None = None, checkpoint: bool = True) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):
            raise ValueError(
                f"RingtrainCallback.every_n_steps must be a positive int or None, got "
                f"{every_n_steps!r} (use None to report only at the end of each epoch)"
            )
        self.every_n_steps = every_n_steps
        self.checkpoint = checkpoint
        self._last_step_reported: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The RNG states are restored here, at the same point of Lightning's start-up relative to
        # the training data loader's first iter() (which draws a seed from the global torch RNG)
        # as the one where they were captured: after this hook Lightning builds the loader and
        # calls iter() once before the first batch, as the uninterrupted run did after the
        # checkpoint at an epoch's end. A resumed run skips the sanity-check validation.
        if stage != "fit":
            return
        ckpt = get_checkpoint()
        if ckpt is None or trainer.ckpt_path is None or trainer.ckpt_path != get_ckpt_path(ckpt):
            return
        rank = trainer.global_rank
        state = _load_rng(ckpt, rank)
        if state is None:
            logger.warning(
                "rank %d: %s has no %s (written at another world size?); the RNG streams start "
                "afresh",
                rank,
                ckpt.uri,
                rng_file(rank),
            )
            return
        restore_rng(state)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning has restored the checkpoint by now: its private verified copy can go.
        ckpt = get_checkpoint()
        if ckpt is not None:
            ckpt.release_verified_copies()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.on_train_start(trainer, pl_module)  # a fit that had nothing left to train

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        n = self.every_n_steps
        step = trainer.global_step
        if n is None or step == 0 or step % n or step == self._last_step_reported:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # the epoch-end report follows right away
        self._last_step_reported = step
        self._report(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        metrics = _to_python(trainer.callback_metrics)
        metrics.setdefault("epoch", trainer.current_epoch)
        metrics.setdefault("step", trainer.global_step)
        if not self.checkpoint or get_context().run_dir is None:
            report(metrics)
            return
        tmp = tempfile.mkdtemp(prefix="ringtrain_lightning_")
        try:
            # Every rank calls save_checkpoint: it is collective (a barrier; sharded strategies
            # write a part on every rank). Under DDP only global rank 0 writes the file.
            trainer.save_checkpoint(os.path.join(tmp, CHECKPOINT_FILE), weights_only=False)
            torch.save(capture_rng(), os.path.join(tmp, rng_file(trainer.global_rank)))
            report(metrics, checkpoint=Checkpoint.from_directory(tmp))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step_reported": self._last_step_reported}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step_reported = state_dict.get("last_step_reported")


def _to_python(metrics: Any) -> dict[str, Any]:
    """``trainer.callback_metrics`` with tensors as Python numbers (or lists)."""
    out: dict[str, Any] = {}
    for key, value in dict(metrics).items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = value.item() if value.numel() == 1 else value.tolist()
        out[str(key)] = value
    return out
