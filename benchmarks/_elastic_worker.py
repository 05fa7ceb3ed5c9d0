"""The train function of benchmarks/elastic.py (imported by reference in the workers)."""

from __future__ import annotations

import json
import os
import signal
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt


def train_fn(config):
    """``layers`` x ``nn.Linear(width, width)`` regression, momentum SGD, a TrainState reported
    with a checkpoint every ``every`` steps. On attempt 0 at the first world size, rank
    ``kill_rank`` (default 1) writes
    ``time.time()`` to ``{log}/kill`` and SIGKILLs itself right after step ``kill_step`` (after
    the checkpoint of that step is on storage). Every rank logs, per step, ``time``: when
    ``optimizer.step()`` returned (the step is complete), and ``snapshot_s``: how long the
    ``state.step`` increment took after it (in an elastic run: the in-memory snapshot).
    ``slow_s``: sleep that long after each step at 2 workers (the grow benchmark)."""
    ctx = rt.get_context()
    torch.manual_seed(0)
    width, layers = config["width"], config["layers"]
    net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    model = rt.prepare_model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    n = 3 * config["batch"] * config["steps"]  # one epoch of `steps` global batches
    data = TensorDataset(torch.randn(n, width), torch.randn(n, width))
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=config["batch"], shuffle=True))
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    killer = (
        ctx.attempt == 0 and ctx.world_size == 3 and ctx.world_rank == config.get("kill_rank", 1)
    )
    log = os.path.join(config["log"], f"{os.getpid()}.jsonl")
    for _epoch in state.epochs(1):
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done = time.time()  # the step's update is applied: the step is complete
            state.step += 1  # (elastic: takes the in-memory snapshot of this step)
            with open(log, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "step": state.step,
                            "time": done,
                            "snapshot_s": time.time() - done,
                            "attempt": ctx.attempt,
                            "world": rt.get_context().world_size,
                        }
                    )
                    + "\n"
                )
            if state.step % config["every"] == 0:
                rt.report({"step": state.step}, checkpoint=state)
            if config.get("slow_s") and rt.get_context().world_size == 2:
                time.sleep(config["slow_s"])  # growing back: time for a worker to start
            if killer and state.step == config["kill_step"]:
                time.sleep(config["settle_s"])  # let the checkpoint of this step be published
                with open(os.path.join(config["log"], "kill"), "w") as f:
                    f.write(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step >= config["steps"]:
                return
