"""Train functions for tests/e2e/test_exact_resume.py and benchmarks/exact_order.py (issue 18):
bit-exact resume at any world size. Loaded by reference in the worker processes.

A kill schedule is a list of ``[attempt, rank, *moment]``: in attempt ``attempt``, rank ``rank``
SIGKILLs itself at ``moment``: ``["step", n]`` (right after optimizer step ``n``),
``["epoch_start", e]`` (before the first batch of epoch ``e``) or ``["write", round, nbytes]``
(after writing ``nbytes`` bytes of a file of checkpoint round ``round``: a half-written file).
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

import ringtrain as rt
from workloads import NoisyDataset, _arm_kill_during_write, _kill_self

STEPS_PER_EPOCH = 10  # 120 samples, per-rank batch 120 // (10 W): 10 steps at W = 2, 3, 4 (and 1)


def make_net(size: str = "small") -> nn.Module:
    """``"small"``: a 2.6k-parameter MLP with dropout; ``"300k"``: 299k parameters (1.2 MB of
    gradients: several DDP buckets with ``bucket_cap_mb=0.25``). Seeded: identical on all ranks."""
    torch.manual_seed(0)
    hidden = {"small": (64, 32), "300k": (512, 64)}[size]
    return nn.Sequential(
        nn.Linear(6, hidden[0]),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Linear(hidden[0], hidden[0] if size == "300k" else hidden[1]),
        nn.ReLU(),
        nn.Linear(hidden[0], hidden[1]) if size == "300k" else nn.Identity(),
        nn.Linear(hidden[1], 3),
    )


def _prepare(net: nn.Module, config: dict) -> tuple[nn.Module, torch.optim.Optimizer]:
    strategy = config.get("strategy", "ddp")
    if strategy == "fsdp":
        model = rt.prepare_model(
            net, parallel_strategy="fsdp", fsdp_config=rt.FSDPConfig(shard_modules=[nn.Linear])
        )
    elif strategy == "hvd":
        import ringtrain.horovod as hvd

        hvd.init()
        model = rt.prepare_model(net, parallel_strategy=None)
    else:
        model = rt.prepare_model(
            net,
            bucket_cap_mb=config.get("bucket_cap_mb"),
            bucket_order=config.get("bucket_order", "fixed"),
            comm_hook=config.get("comm_hook"),
            static_graph=config.get("static_graph"),
            precision=config.get("precision", "32"),
        )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if config.get("precision", "32") != "32":
        optimizer = rt.prepare_optimizer(optimizer)  # "16-mixed": loss scaling (GradScaler)
    if strategy == "hvd":
        import ringtrain.horovod as hvd

        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            fusion_threshold_bytes=config.get("fusion_bytes"),
        )
    return model, optimizer


def _final_state(model: nn.Module, optimizer: torch.optim.Optimizer, config: dict) -> dict | None:
    """Full parameters and optimizer state (rank 0; None elsewhere). Every rank calls it."""
    if config.get("strategy") == "fsdp":
        from fsdp_workloads import _full_state

        full = _full_state(model, optimizer)
        opt = {k: v for k, v in full["optimizer"].items()}
        return {"model": full["model"], "optimizer": opt} if _rank() == 0 else None
    if _rank() != 0:
        return None
    module = model.module if hasattr(model, "module") else model
    final = {"model": module.state_dict(), "optimizer": optimizer.state_dict()["state"]}
    scaler = getattr(optimizer, "grad_scaler", None)  # "16-mixed": the loss scale and its tracker
    return final if scaler is None else {**final, "grad_scaler": scaler.state_dict()}


def _rank() -> int:
    return rt.get_context().world_rank


def exact_resume_fn(config: dict) -> None:
    """``config["epochs"]`` epochs of momentum SGD with dropout, NumPy and Python noise and a
    StepLR, on 10 steps per epoch at any world size; a report with a checkpoint every
    ``config.get("every", 4)`` steps and at each epoch's end. Kills by ``config["kills"]``
    (module docstring). Rank 0 saves ``{"model", "optimizer", "step"}`` to ``config["out"]``.

    Options: ``strategy`` ("ddp", "fsdp", "hvd"), ``model`` ("small", "300k"), ``precision``
    (DDP: "32", "bf16-mixed", "16-mixed"), ``bucket_cap_mb``, ``bucket_order``, ``comm_hook``,
    ``static_graph``, ``fusion_bytes`` (Horovod), ``loader_workers``. Rank 0's file also has
    ``"device"``, where the parameters trained (``"cuda:0"``, ``"cpu"``)."""
    ctx = rt.get_context()
    kills = [
        k[2:] for k in config.get("kills", ()) if (k[0], k[1]) == (ctx.attempt, ctx.world_rank)
    ]
    for moment in kills:
        if moment[0] == "write":
            _arm_kill_during_write(moment[1], moment[2])
    net = make_net(config.get("model", "small"))
    np.random.seed(0)
    random.seed(0)
    model, optimizer = _prepare(net, config)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.5)
    loader = rt.prepare_data_loader(
        DataLoader(
            NoisyDataset(),
            batch_size=120 // (STEPS_PER_EPOCH * ctx.world_size),
            shuffle=True,
            num_workers=config.get("loader_workers", 0),
        )
    )
    state = rt.TrainState(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, data_loader=loader
    )
    state.restore()
    every = config.get("every", 4)
    loss = torch.zeros(())
    for epoch in state.epochs(config["epochs"]):
        if ["epoch_start", epoch] in kills:
            _kill_self()
        for x, y in loader:
            noise = torch.from_numpy(np.random.randn(*x.shape)).float().to(x.device)
            x = x + 0.01 * noise * random.random()
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            rt.backward(loss)  # scales the loss under "16-mixed"; loss.backward() otherwise
            optimizer.step()
            scheduler.step()
            state.step += 1
            if ["step", state.step] in kills:
                _kill_self()
            if state.step % every == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
        rt.report({"loss": loss.item(), "step": state.step, "epoch_end": epoch}, checkpoint=state)
    final = _final_state(model, optimizer, config)
    if final is not None:
        device = str(next(model.parameters()).device)  # where it trained (FSDP gathers to CPU)
        torch.save({**final, "step": state.step, "device": device}, config["out"])
    if config.get("strategy") == "hvd":
        import ringtrain.horovod as hvd

        hvd.shutdown()


def run_exact(
    tmp_path: Any, name: str, workers: int, *, epochs: int, job: dict | None = None, **config: Any
) -> tuple[rt.Result, dict]:
    """Run :func:`exact_resume_fn` for ``epochs`` on ``workers`` processes as
    ``tmp_path/runs/<name>`` (``job``: more ``support.run_job`` arguments, ``config``: the
    function's options) and return the Result (no error: asserted) and rank 0's final state."""
    from support import run_job  # the pytest process's helper; workers never need it

    out = tmp_path / f"{name}.pt"
    result = run_job(
        exact_resume_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=name,
        train_loop_config={"epochs": epochs, "out": str(out), **config},
        **(job or {}),
    )
    assert result.error is None, result.error
    return result, torch.load(out, weights_only=True)


def assert_final_states_equal(clean: dict, got: dict, context: str = "") -> None:
    """Two final states of :func:`exact_resume_fn` (``{"model", "optimizer", "step"}``) are equal,
    tensor by tensor with ``torch.equal``; ``context`` ends each failure's message."""
    assert got["step"] == clean["step"], context
    assert got["model"].keys() == clean["model"].keys()
    for k, v in clean["model"].items():
        assert torch.equal(got["model"][k], v), (
            f"parameter {k} differs (max |diff| {(got['model'][k] - v).abs().max():.3g}) {context}"
        )
    assert got["optimizer"].keys() == clean["optimizer"].keys()
    for i, s in clean["optimizer"].items():
        for name, v in s.items():
            assert torch.equal(got["optimizer"][i][name], v), f"optimizer {i}.{name} {context}"


# ------------------------------------------------------------------ fresh vs long-lived DDP


def _batch(step: int, rank: int, d: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, d, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, accum: int) -> None:
    optimizer.zero_grad()
    for micro in range(accum):
        x, y = _batch(step * accum + micro, _rank())
        with rt.accumulate(model, accum) if accum > 1 else _null():
            loss = nn.functional.cross_entropy(model(x), y) / accum
            rt.backward(loss)
    optimizer.step()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def fresh_vs_long_lived_fn(config: dict) -> None:
    """What every restarted attempt does, in one process, for each of ``config["variants"]``:
    train ``steps`` steps with one DDP (long past the first step, after which torch's DDP
    rebuilds its buckets), then build a fresh one from the same parameters, optimizer state and
    per-rank state (PowerSGD's), and run one more step in both. Reports ``results``: per
    variant ``[equal, max_diff, buckets]`` (``torch.equal`` on every parameter; the largest
    difference; the DDP bucket count).

    Variant keys: ``model``, ``bucket_cap_mb``, ``bucket_order``, ``comm_hook``,
    ``comm_hook_options``, ``static_graph``, ``precision``, ``accum`` (micro-batches per step
    under ``rt.accumulate``), ``steps``."""
    results = [_fresh_vs_long_lived(variant) for variant in config["variants"]]
    rt.report({"results": results, "rank": _rank()})


def _fresh_vs_long_lived(variant: dict) -> list:
    steps, accum = variant.get("steps", 3), variant.get("accum", 1)
    kwargs = {
        "bucket_cap_mb": variant.get("bucket_cap_mb"),
        "bucket_order": variant.get("bucket_order", "fixed"),
        "comm_hook": variant.get("comm_hook"),
        "comm_hook_options": variant.get("comm_hook_options"),
        "static_graph": variant.get("static_graph"),
        "precision": variant.get("precision", "32"),
    }
    net = make_net(variant.get("model", "small"))
    net.eval()  # no dropout: both models compute the same function
    twin = copy.deepcopy(net)
    long_lived = rt.prepare_model(net, **kwargs)
    opt = rt.prepare_optimizer(torch.optim.SGD(long_lived.parameters(), lr=0.1, momentum=0.9))
    for step in range(steps):
        _train_step(long_lived, opt, step, accum)
    # What a checkpoint holds (deep copies: nothing shared with the long-lived objects).
    from ringtrain.worker.state_files import model_rank_state as _model_rank_state

    saved_model = copy.deepcopy(net.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    scaler = getattr(opt, "grad_scaler", None)
    saved_scaler = copy.deepcopy(scaler.state_dict()) if scaler is not None else None
    saved_rank = {k: copy.deepcopy(o.state_dict()) for k, o in _model_rank_state(net).items()}
    _train_step(long_lived, opt, steps, accum)
    # The restarted worker: a new module, a new DDP and a new optimizer, loaded from it.
    twin.load_state_dict(saved_model)
    fresh = rt.prepare_model(twin, **kwargs)
    opt2 = rt.prepare_optimizer(torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9))
    opt2.load_state_dict(saved_opt)
    if saved_scaler is not None:
        opt2.grad_scaler.load_state_dict(saved_scaler)
    mine = _model_rank_state(fresh)
    for key, sd in saved_rank.items():
        if key in mine:
            mine[key].load_state_dict(sd)
    _train_step(fresh, opt2, steps, accum)
    with torch.no_grad():
        pairs = list(zip(long_lived.parameters(), fresh.parameters(), strict=True))
        equal = all(torch.equal(p, q) for p, q in pairs)
        diff = max(float((p - q).abs().max()) for p, q in pairs)
    return [equal, diff, _bucket_count(long_lived)]


def _bucket_count(model: nn.Module) -> int:
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return 0
    return len(model.reducer._get_zeros_like_grad_buckets())  # one tensor per bucket
