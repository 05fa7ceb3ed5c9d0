"""The train function of ``benchmarks/goodput.py`` (imported by reference in the workers).

An MLP (784-1024-1024-10) trained with momentum SGD on synthetic data, DDP through
``rt.prepare_model``, one ``rt.TrainState`` (model, optimizer, data loader) restored at start and
reported with a checkpoint every ``every`` steps (asynchronously: the benchmark's ``RunConfig``).
It trains until ``state.step`` reaches ``steps``.

For the benchmark's fault injector and its accounting, every process

- writes its pid to ``{log}/rank{R}.pid`` when it enters the train function (``R``: its rank then);
- appends one line per completed step to ``{log}/steps.jsonl``, every rank (before
  ``state.step += 1``, so a step lost in a failure is logged again when re-trained):
  ``{"step": S, "time": t, "world": W, "rank": R, "pid": p, "group": [d, a, g]}`` (the step's
  ``optimizer.step()`` has returned; ``group`` names the group that trained it: the driver's pid,
  the restart attempt and the elastic generation). A step's execution is one ``(group, step)``
  pair: a step lost in a failure and trained again appears under two groups. (Only rank 0 logged
  before, which missed a step whose allreduce completed on the survivor while rank 0 was killed
  before its line: "recomputed -2 steps" in the 10-minute elastic-kill run.)
"""

from __future__ import annotations

import json
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt


def train_fn(config: dict) -> None:
    """Train until ``config["steps"]``; see the module docstring for the files it writes."""
    ctx = rt.get_context()
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    model = rt.prepare_model(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    n = 4096
    data = TensorDataset(
        torch.randn(n, 784, generator=generator), torch.randint(0, 10, (n,), generator=generator)
    )
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=config["batch"], shuffle=True))
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    with open(os.path.join(config["log"], f"rank{ctx.world_rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    steps_log = os.path.join(config["log"], "steps.jsonl")
    for _epoch in state.epochs(1_000_000):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            done = time.time()
            # Logged before the step counter moves (the moment its snapshot/checkpoint can
            # include it): a kill after this line re-trains the step and logs it again.
            here = rt.get_context()
            record = {
                "step": state.step + 1,
                "time": done,
                "world": here.world_size,
                "rank": here.world_rank,
                "pid": os.getpid(),
                "group": _group_id(here),
            }
            with open(steps_log, "a") as f:
                f.write(json.dumps(record) + "\n")
            state.step += 1
            if state.step % config["every"] == 0:
                rt.report({"loss": loss.item()}, checkpoint=state)
            if state.step >= config["steps"]:
                return


def _group_id(ctx: rt.DistributedContext) -> list[int]:
    """The group that trains now: [driver pid, restart attempt, elastic generation]."""
    from ringtrain.elastic.worker import current_runtime

    runtime = current_runtime()
    generation = runtime.generation if runtime is not None else 0
    return [ctx.config.driver_pid or 0, ctx.attempt, generation]
