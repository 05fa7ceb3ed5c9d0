"""Seed 004: seed 003 with `import pytorch_lightning as pl` (the package many Ray examples
import): a LightningModule on Ray Train (Ray's imports), with Ray's Lightning helpers, a
checkpoint kept by score, and the resume snippet of Ray's docs."""

import os

import pytorch_lightning as pl
import ray.train
import torch
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.lr = lr
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))


def train_func(config):
    model = Regressor(config["lr"])
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        devices="auto",
        accelerator="auto",
        strategy=RayDDPStrategy(),
        plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()],
        enable_progress_bar=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer = prepare_trainer(trainer)
    train, val = DataLoader(data(), batch_size=8), DataLoader(data(), batch_size=16)
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as ckpt_dir:
            ckpt_path = os.path.join(ckpt_dir, RayTrainReportCallback.CHECKPOINT_NAME)
            trainer.fit(model, train_dataloaders=train, val_dataloaders=val, ckpt_path=ckpt_path)
    else:
        trainer.fit(model, train_dataloaders=train, val_dataloaders=val)


if __name__ == "__main__":
    import sys

    epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"lr": 0.05, "epochs": epochs},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="seed004",
            checkpoint_config=CheckpointConfig(
                num_to_keep=2,
                checkpoint_score_attribute="val_loss",
                checkpoint_score_order="min",
            ),
        ),
    )
    result = trainer.fit()
    print("val_loss", result.metrics["val_loss"], "epoch", result.metrics["epoch"])
    print("checkpoint", result.checkpoint.path)
