"""The train function of benchmarks/hsdp_elastic.py: HSDP (FSDP2 over dp_shard=2, replicated over
dp_replicate) on a small MLP, a TrainState checkpoint every ``every`` steps; rank ``kill_rank``
SIGKILLs itself after step ``kill_step`` of the first attempt at the full size, writing the time
first. Every rank appends ``"<step> <unix time>"`` per step to ``{out}/<pid>.steps``."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt


def train_fn(config: dict[str, Any]) -> None:
    ctx = rt.get_context()
    torch.manual_seed(0)
    width = config["width"]
    net = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, 1)
    )
    model = rt.prepare_model(net, parallel_strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(960, width, generator=g), torch.randn(960, 1, generator=g))
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=8, shuffle=True))
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    log = os.path.join(config["out"], f"{os.getpid()}.steps")
    for _ in state.epochs(1):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            with open(log, "a") as f:
                f.write(f"{state.step} {time.time()}\n")
            first = ctx.attempt == 0 and rt.get_context().world_size == config["max"]
            if first and rt.get_context().world_rank == 1 and state.step == config["kill_step"]:
                with open(os.path.join(config["out"], "killed"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % config["every"] == 0:
                rt.report({"loss": loss.item()}, checkpoint=state)
            if state.step == config["steps"]:
                return
