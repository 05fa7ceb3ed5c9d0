"""Seed 003: a TorchTrainer loop that reports ``Checkpoint.from_dict`` every epoch and resumes
from ``get_checkpoint().to_dict()`` (Ray's imports)."""

import sys

import ray.train
import torch
from ray.train import Checkpoint, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer


def train_func(config):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        state = checkpoint.to_dict()
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    for epoch in range(start, config["epochs"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ray.train.report(
            {"loss": loss.item(), "epoch": epoch, "start": start},
            checkpoint=Checkpoint.from_dict(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
            ),
        )


if __name__ == "__main__":
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": int(sys.argv[1])},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="seed003_dict"),
    )
    result = trainer.fit()
    print("epoch", result.metrics["epoch"], "start", result.metrics["start"])
    print("loss", result.metrics["loss"])
    print("checkpoint epoch", result.checkpoint.to_dict()["epoch"])
