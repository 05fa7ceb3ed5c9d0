"""Lightning's sharded strategies on ringtrain (tests/backends/test_lightning.py): a train
function for the workers and the single-process reference it must match.

With ``W`` data-parallel ranks of batch ``B`` each, step ``k`` trains on the ``k``-th batch of
every rank's ``DistributedSampler`` (which Lightning puts in, shuffled with seed 0): the
single-process reference takes their union as one batch of ``W*B``. The module has no dropout,
so the two agree up to the order of floating-point sums.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler

import ringtrain as rt
from lightning_workloads import make_data, quiet_trainer_kwargs

BATCH = 4  # per data-parallel rank
BATCHES = 5  # optimizer steps per epoch
EPOCHS = 2


def _net() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class ShardModule(pl.LightningModule):
    """Two linear layers, momentum SGD. ``configure_model`` (ModelParallelStrategy only) applies
    tensor parallelism (colwise then rowwise) over ``tensor_parallel`` and FSDP2 over
    ``data_parallel``, each when that dimension has more than one rank."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def configure_model(self) -> None:
        mesh = getattr(self, "_device_mesh", None)
        if mesh is None:  # FSDPStrategy: Lightning wraps the module itself
            return
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if mesh["tensor_parallel"].size() > 1:
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            parallelize_module(self.net, mesh["tensor_parallel"], plan)
        if mesh["data_parallel"].size() > 1:
            fully_shard(self.net, mesh=mesh["data_parallel"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return _optimizer(self.parameters())


class ShardData(pl.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_data(), batch_size=BATCH, shuffle=False)


class RecordLosses(pl.Callback):
    """Each rank appends ``{"attempt", "step", "loss"}`` per optimizer step to its own file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # type: ignore[no-untyped-def]
        entry = {
            "attempt": rt.get_context().attempt,
            "step": trainer.global_step,
            "loss": outputs["loss"].detach().item(),
        }
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as f:
            f.write(json.dumps(entry) + "\n")
        kill = getattr(self, "kill", None)
        if kill and trainer.global_step == kill:
            os.kill(os.getpid(), signal.SIGKILL)


def make_strategy(config: dict[str, Any]) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from ringtrain.integrations.lightning import RingtrainDeepSpeedStrategy, RingtrainFSDPStrategy

    kind = config["strategy"]
    if kind == "fsdp":
        return RingtrainFSDPStrategy(**config.get("strategy_kwargs", {}))
    if kind == "model_parallel":
        return ModelParallelStrategy(**config.get("strategy_kwargs", {}))
    if kind == "deepspeed":
        return RingtrainDeepSpeedStrategy(**config.get("strategy_kwargs", {}))
    return kind  # a string: "ddp", "fsdp", ...


def train_fn(config: dict[str, Any]) -> None:
    """``config``: ``strategy`` (see :func:`make_strategy`), ``losses`` (a path prefix),
    ``kill`` = ``(rank, step)`` SIGKILLs that rank after that step on attempt 0."""
    from ringtrain.integrations.lightning import (
        RingtrainCallback,
        RingtrainEnvironment,
        prepare_trainer,
    )

    ctx = rt.get_context()
    pl.seed_everything(0, verbose=False)
    module = ShardModule()  # the same initial weights as reference_losses
    record = RecordLosses(config["losses"])
    kill = config.get("kill")
    if kill and ctx.attempt == 0 and ctx.world_rank == kill[0]:
        record.kill = kill[1]  # type: ignore[attr-defined]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices="auto",
        strategy=make_strategy(config),
        plugins=[RingtrainEnvironment()],
        callbacks=[RingtrainCallback(), record],
        **quiet_trainer_kwargs(EPOCHS, BATCHES, deterministic=None),
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(module, datamodule=ShardData())


def reference_losses(dp_size: int) -> list[float]:
    """The loss of each optimizer step of one process training on the global batch."""
    torch.manual_seed(0)
    net = _net()
    opt = _optimizer(net.parameters())
    data = make_data()
    losses = []
    for epoch in range(EPOCHS):
        order = []
        for rank in range(dp_size):  # the DistributedSampler Lightning puts in
            sampler = DistributedSampler(data, num_replicas=dp_size, rank=rank, seed=0)
            sampler.set_epoch(epoch)
            order.append(list(sampler))
        for k in range(BATCHES):
            idx = [i for rank in range(dp_size) for i in order[rank][k * BATCH : (k + 1) * BATCH]]
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def run_losses(path: str, world_size: int) -> dict[int, dict[int, float]]:
    """``{rank: {step: loss}}`` as the run recorded them (a later attempt's entry wins)."""
    out: dict[int, dict[int, float]] = {}
    for rank in range(world_size):
        with open(f"{path}.rank{rank}") as f:
            for line in f:
                entry = json.loads(line)
                out.setdefault(rank, {})[entry["step"]] = entry["loss"]
    return out
