"""Train functions for the DiLoCo tests (tests/multiprocess/test_diloco*.py): loaded by reference
in the worker processes.

:func:`diloco_fn` is :func:`exact_workloads.exact_resume_fn`'s loop (momentum SGD or AdamW,
dropout, NumPy and Python noise, 10 steps per epoch at any world size, a checkpoint every
``every`` steps and at each epoch's end) on a model prepared with ``parallel_strategy="diloco"``
(or ``"ddp"``, the reference). Every rank saves its own final state to ``out_<rank>.pt``: local
parameters, inner optimizer state and, for DiLoCo, the global parameters, the outer optimizer
state and the step counters, so that a comparison covers every replica.

A kill schedule is a list of ``[attempt, rank, *moment]`` as in ``exact_workloads``, plus
``["exchange", n]``: the rank SIGKILLs itself right after starting its n-th outer exchange of the
attempt (its collective launched, its peers inside it: mid-exchange).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import ringtrain as rt
from exact_workloads import STEPS_PER_EPOCH, make_net
from workloads import NoisyDataset, _arm_kill_during_write, _kill_self


def _arm_kill_mid_exchange(n: int) -> None:
    from ringtrain.parallel import diloco_exchange

    original = diloco_exchange.Exchange._start
    count = [0]

    def start(self: Any, tensors: list[torch.Tensor]) -> None:
        original(self, tensors)
        count[0] += 1
        if count[0] == n:
            _kill_self()

    diloco_exchange.Exchange._start = start  # type: ignore[method-assign]


def _prepare(net: nn.Module, config: dict) -> nn.Module:
    if config.get("strategy", "diloco") == "ddp":
        return rt.prepare_model(net)
    options = dict(config.get("diloco", {}))
    outer = options.pop("outer", None)
    if outer == "adam":  # any torch.optim factory
        options["outer_optimizer"] = lambda params: torch.optim.Adam(params, lr=0.05)
    return rt.prepare_model(
        net,
        parallel_strategy="diloco",
        diloco_config=rt.DiLoCoConfig(**options),
        **config.get("model_kwargs", {}),
    )


def _inner(model: nn.Module, config: dict) -> torch.optim.Optimizer:
    if config.get("inner", "sgd") == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=3e-3)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def diloco_fn(config: dict) -> None:
    """See the module docs. Options: ``strategy`` ("diloco", "ddp"), ``diloco`` (DiLoCoConfig
    fields; ``"outer": "adam"`` for an Adam outer optimizer), ``inner`` ("sgd", "adamw"),
    ``model`` ("small", "300k"), ``every``, ``kills``, ``losses`` (append each step's loss to
    ``out_<rank>.losses``); ``how``, ``notice_step``, ``marker``, ``driver_pid``: a preemption
    notice (``preempt_workloads.NoticeAt``) from rank ``notice_rank``."""
    ctx = rt.get_context()
    kills = [
        k[2:] for k in config.get("kills", ()) if (k[0], k[1]) == (ctx.attempt, ctx.world_rank)
    ]
    for moment in kills:
        if moment[0] == "write":
            _arm_kill_during_write(moment[1], moment[2])
        elif moment[0] == "exchange":
            _arm_kill_mid_exchange(moment[1])
    if config.get("how") and ctx.world_rank == config.get("notice_rank", 0):
        from preempt_workloads import NoticeAt
        from ringtrain.worker.session import current_session

        current_session().hooks.register(NoticeAt(config))  # a preemption notice at a step
    inject = config.get("inject")
    if inject and (ctx.world_rank, ctx.attempt) == (inject["rank"], 0):
        from ringtrain.integrity.inject import inject_bitflip

        inject_bitflip(inject["where"], inject["step"])  # a transient flip, first attempt only
    net = make_net(config.get("model", "small"))
    np.random.seed(0)
    random.seed(0)
    model = _prepare(net, config)
    optimizer = rt.prepare_optimizer(_inner(model, config))
    loader = rt.prepare_data_loader(
        DataLoader(
            NoisyDataset(), batch_size=120 // (STEPS_PER_EPOCH * ctx.world_size), shuffle=True
        )
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    if state.restore() and config.get("strategy", "diloco") == "diloco":
        _note_resume(model, config, ctx)
    every = config.get("every", 4)
    loss = torch.zeros(())
    losses = []
    for epoch in state.epochs(config["epochs"]):
        if ["epoch_start", epoch] in kills:
            _kill_self()
        for x, y in loader:
            noise = torch.from_numpy(np.random.randn(*x.shape)).float()
            x = x + 0.01 * noise * random.random()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            losses.append(loss.item())
            if ["step", state.step] in kills:
                _kill_self()
            if state.step % every == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
        rt.report({"loss": loss.item(), "step": state.step, "epoch_end": epoch}, checkpoint=state)
    torch.save(final_state(model, optimizer, state.step), f"{config['out']}_{ctx.world_rank}.pt")
    if config.get("losses"):
        with open(f"{config['out']}_{ctx.world_rank}.losses", "a") as f:
            f.write("".join(f"{v!r}\n" for v in losses))


def _note_resume(model: nn.Module, config: dict, ctx: Any) -> None:
    """Append ``"<attempt> <inner step> <in flight>"`` to ``out_<rank>.resumes``: where this
    attempt resumed, and whether an outer exchange was in flight in the checkpoint."""
    from ringtrain.parallel.diloco import outer_sync

    sync = outer_sync(model)
    with open(f"{config['out']}_{ctx.world_rank}.resumes", "a") as f:
        f.write(f"{ctx.attempt} {sync.inner_steps} {int(sync.in_flight is not None)}\n")


def resumes(out: Any, rank: int) -> list[tuple[int, int, int]]:
    """What :func:`_note_resume` wrote for ``rank`` of the run whose ``out`` prefix is ``out``."""
    try:
        with open(f"{out}_{rank}.resumes") as f:
            return [tuple(int(v) for v in line.split()) for line in f]  # type: ignore[misc]
    except FileNotFoundError:
        return []


def final_state(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """This rank's whole state: local model, inner optimizer and, under DiLoCo, the outer loop."""
    from ringtrain.parallel.diloco import outer_sync

    module = model.module if hasattr(model, "module") else model
    out: dict[str, Any] = {
        "step": step,
        "model": {k: v.clone() for k, v in module.state_dict().items()},
        "optimizer": optimizer.state_dict()["state"],
    }
    try:
        sync = outer_sync(model)
    except ValueError:
        return out
    out["global"] = [p.detach().clone() for p in sync.global_params]
    out["outer"] = sync.outer.state_dict()["state"]
    out["counters"] = [sync.inner_steps, sync.outer_steps]
    out["stats"] = [sync.stats.bytes_sent, sync.stats.peak_bytes, sync.stats.exchanges]
    return out


def run_diloco(
    tmp_path: Any, name: str, workers: int, *, epochs: int, job: dict | None = None, **config: Any
) -> tuple[rt.Result, list[dict]]:
    """Run :func:`diloco_fn` on ``workers`` processes as ``tmp_path/runs/<name>`` and return the
    Result (no error: asserted) and every rank's final state."""
    from support import run_job

    out = tmp_path / name
    result = run_job(
        diloco_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=name,
        train_loop_config={"epochs": epochs, "out": str(out), **config},
        **(job or {}),
    )
    assert result.error is None, result.error
    ranks = workers if isinstance(workers, int) else workers[1]
    return result, [torch.load(f"{out}_{r}.pt", weights_only=True) for r in range(ranks)]


def assert_states_equal(clean: list[dict], got: list[dict], context: str = "") -> None:
    """Every rank's final state equal, tensor by tensor (``torch.equal``)."""
    assert len(clean) == len(got), context
    for rank, (a, b) in enumerate(zip(clean, got, strict=True)):
        where = f"rank {rank} {context}"
        assert a["step"] == b["step"], where
        assert a.get("counters") == b.get("counters"), where
        for k, v in a["model"].items():
            diff = (b["model"][k] - v).abs().max()
            assert torch.equal(b["model"][k], v), f"local {k} differs by {diff:.3g}, {where}"
        for i, v in enumerate(a.get("global", [])):
            assert torch.equal(b["global"][i], v), f"global parameter {i} differs, {where}"
        for key in ("optimizer", "outer"):
            for i, s in a.get(key, {}).items():
                for n, v in s.items():
                    assert torch.equal(b[key][i][n], v), f"{key} {i}.{n} differs, {where}"


def elastic_fn(config: dict) -> None:
    """DiLoCo (``config["diloco"]``, AdamW inside) on an elastic run laid out on
    ``ParallelConfig(dp_replicate=-1, dp_shard=1)``. On attempt 0 at world size
    ``first_world``, rank ``kill_rank`` SIGKILLs itself right after step ``kill_step`` (once);
    the grow-back hooks of ``workloads._elastic_grow_hooks`` apply. Per step every rank appends
    ``[pid, world, rank, step, inner_steps, outer_steps, replicas]`` to
    ``{log}/{pid}.jsonl`` and after each restore ``[world, rank, step, max |local - global|]``
    to ``{log}/{pid}.restores``; at the end every rank saves :func:`final_state` to
    ``out_<rank>.pt``."""
    import json
    import os

    from ringtrain.parallel.diloco import outer_sync
    from workloads import _elastic_grow_hooks

    ctx = rt.get_context()
    first_world = ctx.attempt == 0 and ctx.world_size == config.get("first_world")
    net = make_net()
    model = rt.prepare_model(
        net, parallel_strategy="diloco", diloco_config=rt.DiLoCoConfig(**config["diloco"])
    )
    optimizer = rt.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))
    loader = rt.prepare_data_loader(
        DataLoader(NoisyDataset(), batch_size=config["batch_size"], shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    restored = state.restore()
    sync = outer_sync(model)
    log = os.path.join(config["log"], f"{os.getpid()}.jsonl")
    if restored:  # how far this replica's local parameters are from the global ones
        pairs = zip(sync.params, sync.global_params, strict=True)
        drift = max(float((p - g).abs().max()) for p, g in pairs)
        with open(log.replace(".jsonl", ".restores"), "a") as f:
            f.write(json.dumps([ctx.world_size, ctx.world_rank, state.step, drift]) + "\n")
    for _ in state.epochs(config["epochs"]):
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            state.step += 1
            record = [
                os.getpid(),
                rt.get_context().world_size,
                rt.get_context().world_rank,
                state.step,
                sync.inner_steps,
                sync.outer_steps,
                sync.topology.replicas,
            ]
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            killed = first_world and rt.get_context().world_rank == config["kill_rank"]
            if killed and state.step == config["kill_step"]:
                _kill_self()
            _elastic_grow_hooks(config, state.step)
    rank = rt.get_context().world_rank
    torch.save(final_state(model, optimizer, state.step), f"{config['out']}_{rank}.pt")
