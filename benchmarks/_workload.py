"""The workload both variants of ``benchmarks/overhead.py`` run, step for step.

Imported by the hand-written DDP script (``_ddp_worker.py``, launched by torchrun) and by the
ringtrain train function (``_ringtrain_driver.py``), so the two loops differ only in how the
processes are started and in ringtrain's ``report()`` calls.

An MLP 784 -> 1024 -> 1024 -> 10 (1,863,690 parameters), one synthetic batch of 64 samples per
worker generated once with a fixed seed, SGD with momentum. Each step (forward + backward with
DDP's gradient all-reduce + optimizer step) is timed with ``time.perf_counter``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

IN_FEATURES, HIDDEN, CLASSES = 784, 1024, 10
BATCH_PER_WORKER = 64
MODEL_SEED = 0
DATA_SEED = 1000
LR = 0.01
REPORT_EVERY = 50


def build_model() -> nn.Module:
    torch.manual_seed(MODEL_SEED)
    return nn.Sequential(
        nn.Linear(IN_FEATURES, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, CLASSES),
    )


def num_parameters() -> int:
    return sum(p.numel() for p in build_model().parameters())


def make_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's synthetic batch, generated once (seed depends only on the rank)."""
    g = torch.Generator().manual_seed(DATA_SEED + rank)
    x = torch.randn(BATCH_PER_WORKER, IN_FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (BATCH_PER_WORKER,), generator=g)
    return x, y


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def proc_start_time() -> float | None:
    """Wall-clock time this process was created (Linux /proc, 10 ms resolution), else None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return btime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def train_loop(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    steps: int,
    on_report: Callable[[int, float], None],
) -> dict[str, Any]:
    """Run ``steps`` steps; call ``on_report(step, loss)`` every REPORT_EVERY steps and after the
    last one. Returns the timings: per-step durations (s), the wall-clock time the first step
    completed, and the wall time of the whole loop (reports included) and when it ended."""
    loss_fn = nn.CrossEntropyLoss()
    durations: list[float] = []
    first_step_wall: float | None = None
    loop_start = time.perf_counter()
    for i in range(steps):
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        durations.append(time.perf_counter() - t)
        if first_step_wall is None:
            first_step_wall = time.time()
        step = i + 1
        if step % REPORT_EVERY == 0 or step == steps:
            on_report(step, loss.item())
    loop_s = time.perf_counter() - loop_start
    return {
        "first_step_wall": first_step_wall,
        "loop_end_wall": time.time(),
        "step_durations": durations,
        "loop_s": loop_s,
    }


def write_timings(out_prefix: str, rank: int, record: dict[str, Any]) -> None:
    """Write one rank's record to ``{out_prefix}.rank{rank}.json`` (atomically)."""
    path = f"{out_prefix}.rank{rank}.json"
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)
