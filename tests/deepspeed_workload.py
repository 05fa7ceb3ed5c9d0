"""Train functions of the DeepSpeed tests (workers import them by name)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt

STEPS = 6
MICRO = 4  # per-worker batch


def ds_config(stage: int, **more: Any) -> dict[str, Any]:
    """DeepSpeed's config dict: ZeRO ``stage``, torch's AdamW (no compiled ops), fp32."""
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}},
        "steps_per_print": 10**9,
        **more,
    }


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(world_size: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    n = MICRO * world_size * STEPS
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """The engine's whole parameters on every rank (ZeRO-3 gathers its partitions)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _gather(t: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _reference_step(ref: torch.nn.Module, opt: Any, sched: Any, x: Any, y: Any) -> float:
    loss = torch.nn.functional.cross_entropy(ref(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def _one_stage(stage: int, world: int) -> dict[str, Any]:
    engine, _opt = rt.prepare_deepspeed(_net(), config=ds_config(stage))
    ref = _net()  # single-process training on the same global batch
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    from deepspeed.runtime.lr_schedules import WarmupLR

    ref_sched = WarmupLR(ref_opt, warmup_num_steps=4)
    loader = rt.prepare_data_loader(DataLoader(_data(world), batch_size=MICRO, shuffle=True))
    worst_loss = 0.0
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        ref_loss = _reference_step(ref, ref_opt, ref_sched, _gather(x), _gather(y))
        worst_loss = max(worst_loss, abs(mean.item() / world - ref_loss))
    got = full_params(engine)
    worst_param = max((got[n] - p).abs().max().item() for n, p in ref.named_parameters())
    return {
        "loss_diff": worst_loss,
        "param_diff": worst_param,
        "steps": engine.global_steps,
        "params": got,
    }


def equivalence_fn(config: dict[str, Any]) -> None:
    """ZeRO stages 1, 2 and 3 one after the other on the same group, each against single-process
    AdamW on the gathered global batch; rank 0 reports the worst differences per stage."""
    ctx = rt.get_context()
    out = {s: _one_stage(s, ctx.world_size) for s in (1, 2, 3)}
    if ctx.world_rank == 0:  # the uninterrupted runs that resume_fn's must match bit for bit
        torch.save({s: d.pop("params") for s, d in out.items()}, config["out"])
    else:
        for d in out.values():
            d.pop("params")
    rt.report({f"stage{s}_{m}": x for s, d in out.items() for m, x in d.items()})


def resume_fn(config: dict[str, Any]) -> None:
    """ZeRO ``config["stage"]`` for STEPS steps, checkpointing every 2 steps with TrainState;
    on attempt 0, rank ``kill_rank`` SIGKILLs itself after step ``kill`` (if given). Rank 0
    saves the final parameters to ``config["out"]`` (the same run as ``equivalence_fn``'s)."""
    ctx = rt.get_context()
    world = ctx.world_size
    engine, optimizer = rt.prepare_deepspeed(_net(), config=ds_config(config["stage"]))
    loader = rt.prepare_data_loader(DataLoader(_data(world), batch_size=MICRO, shuffle=True))
    state = rt.TrainState(model=engine, optimizer=optimizer, data_loader=loader)
    state.restore()
    for _epoch in state.epochs(1):
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(engine(x), y)
            engine.backward(loss)
            engine.step()
            state.step += 1
            if ctx.attempt == 0 and ctx.world_rank == 1 and state.step == config.get("kill"):
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % 2 == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
    params = full_params(engine)
    if ctx.world_rank == 0:
        torch.save({"params": params, "steps": engine.global_steps}, config["out"])
