"""Lightning train functions for tests/backends/test_lightning.py, importable by worker processes.

``train_fn`` runs under ringtrain (``rt.Trainer(...).fit()``); running this file as a script runs
the same LightningModule with Lightning's own DDP launcher (``strategy="ddp"``, ``devices=2``,
``accelerator="cpu"``), the reference the ringtrain run must match::

    python tests/lightning_workloads.py OUT.pt EPOCHS
"""

from __future__ import annotations

import json
import os
import signal
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt

BATCHES = 5  # training batches per rank and epoch (limit_train_batches)


def make_data(n: int = 80, d: int = 6, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()
    return TensorDataset(x, y)


class TinyModule(pl.LightningModule):
    """Two linear layers with dropout (so that resuming needs the RNG states), momentum SGD and a
    StepLR schedule (so that it needs the optimizer and scheduler states)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        acc = (self(x).argmax(dim=1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)]


class TinyData(pl.LightningDataModule):
    """Plain DataLoaders (Lightning adds the DistributedSampler), or with ``prepared=True`` the
    training loader of ``rt.prepare_data_loader`` (stateful: resumes mid-epoch)."""

    def __init__(self, prepared: bool = False) -> None:
        super().__init__()
        self.prepared = prepared

    def train_dataloader(self):
        loader = DataLoader(make_data(), batch_size=4, shuffle=True)
        return rt.prepare_data_loader(loader) if self.prepared else loader

    def val_dataloader(self):
        return DataLoader(make_data(n=16, seed=2), batch_size=8)


class KillAt(pl.Callback):
    """SIGKILL this process after optimizer step ``step`` (first attempt only)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordStart(pl.Callback):
    """Rank 0 appends ``{"attempt", "step", "ckpt_path", "device"}`` to ``path`` when training
    starts (``device``: the module's, e.g. ``"cuda:0"``; Lightning moves it back to the CPU when
    ``fit`` ends)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            with open(self.path, "a") as f:
                entry = {
                    "attempt": rt.get_context().attempt,
                    "step": trainer.global_step,
                    "ckpt_path": str(trainer.ckpt_path) if trainer.ckpt_path else None,
                    "device": str(pl_module.device),
                }
                f.write(json.dumps(entry) + "\n")


def quiet_trainer_kwargs(
    epochs: int, batches: int = BATCHES, deterministic: bool | None = True
) -> dict:
    """``pl.Trainer`` arguments for ``epochs`` epochs of ``batches`` batches: no sanity check,
    logger, Lightning checkpoints, progress bar or model summary (``deterministic=None``:
    Lightning's default)."""
    kwargs: dict = dict(
        max_epochs=epochs,
        limit_train_batches=batches,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if deterministic is not None:
        kwargs["deterministic"] = deterministic
    return kwargs


_trainer_kwargs = quiet_trainer_kwargs


def assert_same_parameters(a: dict, b: dict) -> None:
    """Two :func:`save_final` files hold the same step and, tensor by tensor (``torch.equal``),
    the same parameters."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"parameter {k} differs"


def save_final(module: pl.LightningModule, trainer: pl.Trainer, out: str) -> None:
    if trainer.global_rank == 0:
        state = {k: v.clone() for k, v in module.state_dict().items()}
        torch.save({"model": state, "step": trainer.global_step}, out)


def train_fn(config: dict) -> None:
    """The issue's user code, plus test hooks: ``kill`` = ``(rank, step)`` SIGKILLs that rank
    after that step on attempt 0; rank 0 writes the final weights to ``config["out"]``."""
    from ringtrain.integrations.lightning import (
        RingtrainCallback,
        RingtrainEnvironment,
        prepare_trainer,
    )

    ctx = rt.get_context()
    pl.seed_everything(0, verbose=False)
    callbacks: list[pl.Callback] = [RingtrainCallback(every_n_steps=config.get("every"))]
    kill = config.get("kill")
    if kill and ctx.attempt == 0 and ctx.world_rank == kill[0]:
        callbacks.append(KillAt(kill[1]))
    if config.get("starts"):
        callbacks.append(RecordStart(config["starts"]))
    trainer = pl.Trainer(
        accelerator="auto",
        devices="auto",
        strategy="ddp",
        plugins=[RingtrainEnvironment()],
        callbacks=callbacks,
        **_trainer_kwargs(config["epochs"]),
    )
    trainer = prepare_trainer(trainer)
    module = TinyModule()
    trainer.fit(module, datamodule=TinyData(prepared=config.get("prepared", False)))
    save_final(module, trainer, config["out"])


def native_main(out: str, epochs: int) -> None:
    """Lightning's own DDP: this script is started once; Lightning starts rank 1 itself."""
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", **_trainer_kwargs(epochs))
    module = TinyModule()
    trainer.fit(module, datamodule=TinyData())
    save_final(module, trainer, out)
    if trainer.global_rank == 0:
        with open(out + ".json", "w") as f:
            json.dump({k: float(v) for k, v in trainer.callback_metrics.items()}, f)


if __name__ == "__main__":
    native_main(sys.argv[1], int(sys.argv[2]))
