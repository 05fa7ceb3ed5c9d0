"""Train functions for tests/multiprocess/test_fsdp.py (loaded by reference in the worker
processes)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

import ringtrain as rt
from ringtrain.parallel.fsdp import local_state_bytes
from workloads import NoisyDataset

GLOBAL_BATCH = 12  # 120 samples: 10 steps per epoch at every world size (1, 2, 3)


class Block(nn.Module):
    """A residual MLP block; 10 hidden units so that 3 ranks get uneven shards (4, 4, 2 rows)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(d, 10)
        self.down = nn.Linear(10, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class TinyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.tanh(self.inp(x))))


def probe_input() -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(99))


def _full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Full (unsharded) model and optimizer state keyed by parameter name, on rank 0."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    if not dist.is_initialized():
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()["state"]}
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=opts),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=opts).get("state", {}),
    }


def _variants_check() -> dict:
    """bf16 compute + activation checkpointing + CPU offload + size policy, on a fixed batch."""
    torch.manual_seed(1)
    net = TinyNet()
    cfg = rt.FSDPConfig(
        min_num_params=200,
        mixed_precision="bf16",
        activation_checkpointing=True,
        cpu_offload=True,
    )
    model = rt.prepare_model(net, parallel_strategy="fsdp", fsdp_config=cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = NoisyDataset()[0:12]
    losses = []
    for _ in range(6):
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    shard_dtypes = sorted({str(p.dtype) for p in model.parameters()})
    return {"bf16_losses": losses, "bf16_out_dtype": str(out.dtype), "shard_dtypes": shard_dtypes}


def fsdp_fn(config):
    """AdamW on TinyNet over NoisyDataset with a global batch of 12, ``config["steps"]`` steps
    (a multiple of 10, the steps per epoch).

    Rank 0 appends ``{"step", "loss"}`` (the global batch's mean loss) per step to
    ``config["loss_file"]``. At step ``config["ckpt_at"]`` every rank reports a checkpoint and
    rank 0 writes the model's output on a probe input to ``config["probe_file"]``; with
    ``config["stop"]`` the run ends there. At the end rank 0 saves the full parameters and
    optimizer state to ``config["out"]``; the last report has each rank's local state bytes.
    """
    ctx = rt.get_context()
    torch.manual_seed(ctx.world_rank)  # different on every rank: the broadcast must fix it
    net = TinyNet()
    before = list(net.parameters())
    if config["strategy"] == "fsdp":
        model = rt.prepare_model(
            net, parallel_strategy="fsdp", fsdp_config=rt.FSDPConfig(shard_modules=[Block])
        )
    else:
        model = rt.prepare_model(net, parallel_strategy="ddp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    loader = rt.prepare_data_loader(
        DataLoader(NoisyDataset(), batch_size=GLOBAL_BATCH // ctx.world_size, shuffle=True)
    )
    stale_error = ""
    if config.get("checks") and config["strategy"] == "fsdp":
        try:
            rt.TrainState(model=model, optimizer=torch.optim.SGD(before, lr=0.1))
        except TypeError as exc:
            stale_error = str(exc)
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    for _ in state.epochs(config["steps"] // 10):  # 10 steps per epoch
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            mean = loss.detach().clone()
            if dist.is_initialized():
                dist.all_reduce(mean)
                mean /= dist.get_world_size()
            if ctx.world_rank == 0:
                with open(config["loss_file"], "a") as f:
                    f.write(json.dumps({"step": state.step, "loss": mean.item()}) + "\n")
            if state.step == config["ckpt_at"]:
                with torch.no_grad():
                    probe = model(probe_input())
                if ctx.world_rank == 0:
                    torch.save(probe, config["probe_file"])
                rt.report({"step": state.step}, checkpoint=state)
                if config.get("stop"):
                    return
    metrics = {"step": state.step, **local_state_bytes(model, optimizer)}
    full = _full_state(model, optimizer)
    if config.get("checks"):
        metrics["stale_error"] = stale_error
        metrics.update(_variants_check())
    if ctx.world_rank == 0:
        torch.save({"step": state.step, **full}, config["out"])
    rt.report(metrics)
