"""Train functions for tests/multiprocess/test_parallel_mesh.py (issue 22), loaded by reference in
the worker processes: a tiny GPT whose attention and MLP are split by a TP plan, trained on a fixed
token dataset; and the single-process reference the mesh runs must match."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ringtrain as rt
from ringtrain.worker.data import ResumableDistributedSampler
from support import wait_for_checkpoint

VOCAB, T, D, HEADS = 32, 8, 16, 4
GLOBAL_BATCH = 8  # samples per step over all data-parallel ranks
SAMPLES = 64  # 8 steps per epoch
TP_PLAN = {
    "blocks.*.attn.qkv": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc1": "colwise",
    "blocks.*.mlp.fc2": "rowwise",
}


class Tokens(Dataset):
    """``(x (T,), y (T,), index)``: fixed random tokens, ``y`` the next token of ``x``."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(7)
        self.data = torch.randint(0, VOCAB, (SAMPLES, T + 1), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.data[i, :-1], self.data[i, 1:], i


class Attention(nn.Module):
    """Head-major fused qkv (``[head][q|k|v][head_dim]``): a contiguous slice of its output
    features is whole heads, so ``"colwise"`` on ``qkv`` splits by heads."""

    def __init__(self) -> None:
        super().__init__()
        # No bias: a key bias gets a zero gradient in exact arithmetic, which Adam turns into
        # updates of its rounding noise (parameters would then differ by ~lr between runs).
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv(x).view(B, S, -1, 3, D // HEADS)  # -1: the heads on this TP rank
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D, 4 * D)
        self.fc2 = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(D), Attention()
        self.ln2, self.mlp = nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(T, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def train_reference(
    make_model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch (seed 0, the sampler's shuffle of seed 0): the losses per
    step and the final parameters of ``make_model()`` trained by ``make_optimizer(model)``."""
    torch.manual_seed(0)
    model = make_model()
    opt = make_optimizer(model)
    sampler = ResumableDistributedSampler(Tokens(), num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(Tokens(), batch_size=GLOBAL_BATCH, sampler=sampler)
    losses = []
    for (x, y, _), _step in zip(loader, range(steps), strict=False):
        loss = loss_fn(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch: the losses per step and the final parameters."""
    return train_reference(
        TinyGPT, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), loss_of, steps
    )


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=opts)


def after_step(ctx: Any, config: dict, state: Any, mean: torch.Tensor, writer: bool) -> None:
    """The end of a parity workload's step ``state.step``: the ``writer`` rank appends
    ``{"step", "loss": mean}`` to ``config["loss_file"]``; a checkpoint at
    ``config["ckpt_at"]``; with ``config["crash"]`` rank 1 of attempt 0 SIGKILLs itself two
    steps later, once the checkpoint is published."""
    if writer:
        with open(config["loss_file"], "a") as f:
            f.write(json.dumps({"step": state.step, "loss": mean.item()}) + "\n")
    if state.step == config.get("ckpt_at"):
        rt.report({"step": state.step}, checkpoint=state)
    crash_now = config.get("crash") and ctx.attempt == 0 and ctx.world_rank == 1
    if crash_now and state.step == config["ckpt_at"] + 2:
        wait_for_checkpoint(str(ctx.run_dir))
        os.kill(os.getpid(), signal.SIGKILL)


def mesh_fn(config: dict) -> None:
    """AdamW on TinyGPT for ``config["steps"]`` steps of the global batch, the model prepared
    with ``TP_PLAN`` on the run's mesh; a TrainState checkpoint at ``config["ckpt_at"]``.

    Rank 0 appends ``{"step", "loss"}`` to ``config["loss_file"]`` and saves the full parameters
    to ``config["out"]`` at the end. Every rank's last report holds the sample indices of each
    of its batches, its mesh coordinates, the step it resumed at and its local parameter count.
    With ``config["crash"]`` rank 1 SIGKILLs itself two steps after the checkpoint (attempt 0).
    """
    ctx = rt.get_context()
    torch.manual_seed(ctx.world_rank)  # different on every rank: prepare_model broadcasts rank 0's
    if ctx.world_rank == 0:
        torch.manual_seed(0)
    model = rt.prepare_model(
        TinyGPT(), tp_plan=TP_PLAN, fsdp_config=rt.FSDPConfig(shard_modules=[Block])
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mesh = ctx.mesh
    dp = mesh["dp_replicate"].size() * mesh["dp_shard"].size()
    loader = rt.prepare_data_loader(
        DataLoader(Tokens(), batch_size=GLOBAL_BATCH // dp, shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    resumed_at, batches = state.step, []
    for _ in state.epochs(1):
        for x, y, idx in loader:
            loss = loss_of(model, x, y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            batches.append(sorted(idx.tolist()))
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # TP peers hold the same loss: the world mean is the dp mean
            mean /= dist.get_world_size()
            after_step(ctx, config, state, mean, writer=ctx.world_rank == 0)
            if state.step == config["steps"]:
                break
    full = _full_params(model)
    if ctx.world_rank == 0:
        torch.save(full, config["out"])
    local = sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )
    rt.report(
        {
            "batches": batches,
            "resumed_at": resumed_at,
            "coords": {name: mesh[name].get_local_rank() for name in mesh.mesh_dim_names},
            "local_numel": local,
            "attempt": ctx.attempt,
        }
    )
