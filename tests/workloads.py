"""Train functions for the multi-process tests. They live in an importable module so that the
worker processes load them by reference, exactly as a user's module would be loaded."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt


def make_dataset(n: int = 48, d: int = 8) -> TensorDataset:
    # 48 divides evenly over 1, 2 and 3 ranks with batches of 4, 8 and 12: no sampler padding.
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d, generator=g)
    y = (x @ torch.randn(d, 1, generator=g)).squeeze(1) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y)


def make_model(d: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def save_checkpoint(model: torch.nn.Module, **extra) -> rt.Checkpoint:
    d = tempfile.mkdtemp(prefix="rt_test_ckpt_")
    module = model.module if hasattr(model, "module") else model
    torch.save({"model": module.state_dict(), **extra}, os.path.join(d, "model.pt"))
    return rt.Checkpoint.from_directory(d)


def equivalence_fn(config):
    """``steps`` SGD steps over a shuffled dataset; rank 0 saves the final parameters."""
    model = rt.prepare_model(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(
        DataLoader(make_dataset(), batch_size=config["batch_size"], shuffle=True)
    )
    step = 0
    while step < config["steps"]:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step == config["steps"]:
                break
    ckpt = save_checkpoint(model) if rt.get_context().world_rank == 0 else None
    rt.report({"loss": loss.item(), "steps": step}, checkpoint=ckpt)


def metrics_fn(config):
    ctx = rt.get_context()
    assert dist.is_initialized() == (ctx.world_size > 1)
    for i in range(config["rounds"]):
        t = torch.tensor([float(ctx.world_rank)])
        if ctx.world_size > 1:
            dist.all_reduce(t)
        rt.report(
            {
                "round": i,
                "rank": ctx.world_rank,
                "rank_sum": t.item(),
                "score": config["scores"][i],
            },
            checkpoint=save_checkpoint(torch.nn.Linear(1, 1)) if ctx.world_rank == 0 else None,
        )


def raising_fn(config):
    ctx = rt.get_context()
    rt.report({"ok": 1})
    if ctx.world_rank == config["bad_rank"]:
        raise ValueError(f"bad batch on rank {ctx.world_rank}")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the healthy rank waits for its peer in a collective
    time.sleep(30)


def sigkill_fn(config):
    ctx = rt.get_context()
    rt.report({"ok": 1})
    if ctx.world_rank == config["bad_rank"]:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.zeros(1)
    dist.all_reduce(t)
    time.sleep(30)


def sleeper_fn(config):
    """Write this worker's pid to a file, then sleep: for orphan tests."""
    ctx = rt.get_context()
    with open(os.path.join(config["pid_dir"], f"rank{ctx.world_rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def flaky_fn(config):
    """Fails on rank 1 in the first attempt only; resumes its counter from the checkpoint."""
    ctx = rt.get_context()
    start = 0
    ckpt = rt.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            start = torch.load(os.path.join(d, "model.pt"), weights_only=True)["step"] + 1
    for step in range(start, config["steps"]):
        if ctx.attempt == 0 and ctx.world_rank == 1 and step == config["fail_at"]:
            raise RuntimeError("transient failure")
        model = torch.nn.Linear(1, 1)
        ckpt = save_checkpoint(model, step=step) if ctx.world_rank == 0 else None
        rt.report({"step": step, "attempt": ctx.attempt, "start": start}, checkpoint=ckpt)


def threads_fn():
    rt.report({"threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")})
