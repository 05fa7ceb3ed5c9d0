"""A tiny training script to watch ringtrain's terminal output: a few short epochs of a linear
model on random data, with the epoch loop of ``rt.TrainState.epochs`` (the live panel's progress
bar, ETA and ``epoch k/N`` come from it).

    ringtrain run -n 2 examples/tiny_epochs.py
    ringtrain run -n 2 examples/tiny_epochs.py --epochs 6 --step-s 0.05

Each rank trains on its shard; rank 0 prints ``epoch k/N`` after each epoch, as the panel shows it.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="steps per epoch per rank")
    parser.add_argument("--step-s", type=float, default=0.1, help="seconds each step sleeps")
    args = parser.parse_args()

    ctx = rt.get_context()
    torch.manual_seed(0)
    n = args.steps * 4 * ctx.world_size  # batches of 4: `steps` batches per rank
    data = TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=4))
    model = rt.prepare_model(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    for epoch in state.epochs(args.epochs):
        total = 0.0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
            time.sleep(args.step_s)  # a step long enough to watch
        if ctx.world_rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {total / len(loader):.4f}", flush=True)
        rt.report({"epoch": epoch, "loss": total / len(loader)})


if __name__ == "__main__":
    main()
