"""Seed 001: a Ray Tune grid search over a TorchTrainer's learning rate (Ray's imports)."""

import ray.train
import torch
from ray import tune
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer


def train_func(config):
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    model = ray.train.torch.prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for epoch in range(config["epochs"]):
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ray.train.report({"loss": loss.item(), "epoch": epoch, "lr": config["lr"]})


if __name__ == "__main__":
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"epochs": 3},
        scaling_config=ScalingConfig(num_workers=2),
    )
    tuner = tune.Tuner(
        trainer,
        param_space={"train_loop_config": {"lr": tune.grid_search([1e-3, 1e-4, 1e-5])}},
    )
    results = tuner.fit()
    for result in results:
        print("trial", result.config["train_loop_config"]["lr"], result.metrics["loss"])
    best = results.get_best_result(metric="loss", mode="min")
    print("best lr", best.config["train_loop_config"]["lr"])
