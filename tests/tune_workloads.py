"""Train functions for the sweep tests (tests/multiprocess/test_tune.py): real, tiny training
runs."""

from __future__ import annotations

import json
import math
import os
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt


def regression_fn(config):
    """Linear regression with plain SGD at ``config["lr"]``: small learning rates converge,
    ``lr`` above ~1 diverges (the loss grows geometrically). Reports ``score = -loss`` (capped)
    after every ``steps_per_round`` steps, with a TrainState checkpoint, for ``rounds`` rounds.

    Optional config: ``log`` (a directory: each worker appends ``{pid, rank, trial, start,
    end}`` to it), ``crash`` (``"once"``: rank 0 raises in attempt 0 after its first report;
    ``"always"``: in every attempt), ``sleep_s`` (per round), ``marker`` (a directory: a file
    per completed round, for a test to watch)."""
    ctx = rt.get_context()
    start = time.time()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1)
    torch.manual_seed(0)
    model = rt.prepare_model(torch.nn.Linear(8, 1, bias=False))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    loader = rt.prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    rounds = int(config.get("rounds", 4))
    per_round = int(config.get("steps_per_round", 4))
    crash = config.get("crash", "never")
    while state.step < rounds * per_round:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            if state.step % per_round == 0:
                value = loss.item()
                score = -min(value, 1e6) if math.isfinite(value) else -1e6
                time.sleep(float(config.get("sleep_s", 0.0)))
                rt.report({"score": score, "step": state.step}, checkpoint=state)
                if config.get("marker"):
                    path = os.path.join(config["marker"], f"round_{state.step // per_round}")
                    open(path, "w").close()
                if ctx.world_rank == 0 and (
                    crash == "always" or (crash == "once" and ctx.attempt == 0)
                ):
                    raise RuntimeError(f"trial crash ({crash}) at step {state.step}")
            if state.step >= rounds * per_round:
                break
    if config.get("log"):
        record = {
            "pid": os.getpid(),
            "rank": ctx.world_rank,
            "run": os.path.basename(ctx.run_dir.rstrip("/")),
            "start": start,
            "end": time.time(),
        }
        with open(os.path.join(config["log"], f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


def parent_fn(config):
    """Reports the worker process's parent pid (the zygote it was forked from, if any)."""
    rt.report({"score": float(config["k"]), "ppid": os.getppid()})
