"""Train functions for tests/multiprocess/test_pipeline.py (issue 22): a tiny GPT written as a
chain (embedding, blocks, norm, head: what ``rt.prepare_pipeline`` splits), with the output head
optionally tied to the token embedding across stages; and the single-process reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import ringtrain as rt
from parallel_workloads import (
    GLOBAL_BATCH,
    TP_PLAN,
    VOCAB,
    Block,
    D,
    T,
    Tokens,
    after_step,
    train_reference,
)

N_BLOCKS = 4


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(T, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class ChainGPT(nn.Module):
    """``embed -> blocks.0 .. blocks.3 -> ln -> head``; ``tied``: the head's weight is the token
    embedding's."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.Sequential(*(Block() for _ in range(N_BLOCKS)))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.blocks(self.embed(idx))))


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum (state to checkpoint): Adam would turn the rounding noise of gradients
    that are zero in exact arithmetic (a key projection's component along the LayerNorm bias)
    into lr-sized differences between equally correct runs."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


def reference(steps: int, tied: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch: the losses per step and the final parameters."""
    return train_reference(
        lambda: ChainGPT(tied), optimizer_for, lambda m, x, y: lm_loss(m(x), y), steps
    )


SPLITS = {2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]}


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _gather_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every stage's parameters, on every rank (a collective over the world)."""
    mine = {k: _local(v).detach().clone() for k, v in model.state_dict().items()}
    everything: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine)
    out: dict[str, torch.Tensor] = {}
    for part in everything:
        out.update(part or {})
    return out


def pipeline_fn(config: dict) -> None:
    """SGD on ChainGPT through ``rt.prepare_pipeline`` for ``config["steps"]`` steps of the
    global batch (config: schedule, microbatches, tied, data_parallel, tp, stages_per_rank,
    ckpt_at, crash, loss_file, out). The last stage's rank with dp coordinate 0 appends the
    step's loss (mean over the dp ranks) to ``loss_file``; rank 0 saves all parameters to
    ``out``. With ``crash`` rank 1 SIGKILLs itself two steps after the checkpoint (attempt 0)."""
    ctx = rt.get_context()
    torch.manual_seed(ctx.world_rank + 100)  # rank 0's model is broadcast
    if ctx.world_rank == 0:
        torch.manual_seed(0)
    mesh = ctx.mesh
    pp = mesh["pp"].size()
    per_rank = config.get("stages_per_rank")
    model = rt.prepare_pipeline(
        ChainGPT(config.get("tied", False)),
        split_points=SPLITS[pp * (per_rank or 1)],
        microbatches=config["microbatches"],
        schedule=config["schedule"],
        stages_per_rank=per_rank,
        data_parallel=config.get("data_parallel", "ddp"),
        tp_plan=TP_PLAN if config.get("tp") else None,
    )
    optimizer = optimizer_for(model)
    dp_group = mesh["dp_replicate", "dp_shard"]._flatten().get_group()
    dp = dist.get_world_size(dp_group)
    loader = rt.prepare_data_loader(
        DataLoader(Tokens(), batch_size=GLOBAL_BATCH // dp, shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    resumed_at, batches = state.step, []
    writer = model.is_last and mesh["dp_replicate"].get_local_rank() == 0
    writer = writer and mesh["dp_shard"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    for _ in state.epochs(1):
        for x, y, idx in loader:
            optimizer.zero_grad()
            losses = model.step(x, target=y, loss_fn=lm_loss)
            optimizer.step()
            state.step += 1
            batches.append(sorted(idx.tolist()))
            mean = losses.mean() if losses is not None else torch.zeros(())
            if model.is_last:
                dist.all_reduce(mean, group=dp_group)
                mean /= dp
            after_step(ctx, config, state, mean, writer=writer)
            if state.step == config["steps"]:
                break
    full = _gather_params(model)
    if ctx.world_rank == 0:
        torch.save(full, config["out"])
    rt.report(
        {
            "batches": batches,
            "resumed_at": resumed_at,
            "stages": model.stage_indices,
            "attempt": ctx.attempt,
        }
    )
