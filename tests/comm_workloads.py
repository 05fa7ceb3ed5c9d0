"""Train functions for tests/multiprocess/test_comm_ddp.py and tests/multiprocess/test_amp.py
(issue 5, DDP-user side): communication hooks, DDP options, mixed precision and gradient
accumulation on real gloo ranks. They live in an importable module so that worker processes load
them by reference."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import ringtrain as rt
from workloads import NoisyDataset, make_dataset


class AllreduceLog:
    """Counts the ``dist.all_reduce`` calls made by Python comm hooks, with dtype and numel."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, int]] = []
        self._orig = dist.all_reduce

    def __enter__(self) -> AllreduceLog:
        def logged(tensor, *args, **kwargs):
            self.calls.append((tensor.dtype, tensor.numel()))
            return self._orig(tensor, *args, **kwargs)

        dist.all_reduce = logged
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self._orig


def counting_allreduce_hook(counter, bucket):
    """DDP's default averaging allreduce, counting its calls in ``counter["n"]``."""
    counter["n"] += 1
    buf = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


class WithUnusedHead(torch.nn.Module):
    """``_mlp()`` plus a head that forward never uses (DDP needs find_unused_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _mlp()
        self.unused = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.body(x)


def _loader(batch_size: int):
    return rt.prepare_data_loader(
        DataLoader(make_dataset(), batch_size=batch_size, shuffle=True), seed=3
    )


def _train(model, loader, steps: int, *, accumulate: int = 1, grad_scaler=None):
    sgd = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    opt = rt.prepare_optimizer(sgd, grad_scaler=grad_scaler)
    micro, done, first_loss = 0, 0, None
    while done < steps:
        for x, y in loader:
            with rt.accumulate(model, accumulate) as sync:
                loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
                rt.backward(loss / accumulate)
            first_loss = loss.item() if first_loss is None else first_loss
            micro += 1
            if sync:
                opt.step()
                opt.zero_grad()
                done += 1
                if done == steps:
                    break
    module = model.module if hasattr(model, "module") else model
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return params, first_loss, loss.item()


def options_fn(config):
    """Every comm_hook, precision and DDP option on the same data; rank 0 saves the results."""
    out = {"hooks": {}, "precision": {}, "ddp": {}, "accumulate": {}}
    steps = config["steps"]
    # ---- communication hooks: what goes on the wire, and the trained parameters
    for hook in (None, "bf16", "fp16", "powersgd"):
        options = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2}
        model = rt.prepare_model(
            _mlp(), comm_hook=hook, comm_hook_options=options if hook == "powersgd" else None
        )
        with AllreduceLog() as log:
            params, first, last = _train(model, _loader(4), steps)
        out["hooks"][str(hook)] = {"params": params, "first": first, "last": last, "log": log.calls}
    # ---- DDP options pass through
    for name, kwargs in {
        "small_buckets_static": dict(bucket_cap_mb=0.001, static_graph=True),
        "unused": dict(find_unused_parameters=True, ddp_kwargs={"gradient_as_bucket_view": True}),
    }.items():
        model = rt.prepare_model(WithUnusedHead() if name == "unused" else _mlp(), **kwargs)
        params, _, last = _train(model, _loader(4), 2)
        out["ddp"][name] = {
            "bucket_bytes_cap": model.bucket_bytes_cap,
            "static_graph": model.static_graph,
            "find_unused_parameters": model.find_unused_parameters,
            "gradient_as_bucket_view": model.gradient_as_bucket_view,
            "last": last,
        }
    # ---- precision: autocast inside, float32 outside
    for precision in ("32", "bf16-mixed", "16-mixed"):
        net = _mlp()
        inner = []
        net[0].register_forward_hook(lambda _m, _a, o, inner=inner: inner.append(o.dtype))
        model = rt.prepare_model(net, precision=precision)
        outer = model(torch.randn(2, 8)).dtype
        # A first scale that fp16 gradients do not overflow: no skipped step, so the trajectory
        # is comparable with fp32's (the default 2**16 skips the first steps, by design).
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if precision == "16-mixed" else None
        params, first, last = _train(model, _loader(4), steps, grad_scaler=scaler)
        out["precision"][precision] = {
            "params": params,
            "first": first,
            "last": last,
            "inner": str(inner[-1]),
            "outer": str(outer),
        }
    # ---- accumulation: 2 micro-batches of 4 == 1 batch of 8, with half the allreduces
    for name, batch, accumulate in (("plain", 8, 1), ("accumulated", 4, 2)):
        model = rt.prepare_model(_mlp())
        counter = {"n": 0}
        model.register_comm_hook(counter, counting_allreduce_hook)
        params, _, _ = _train(model, _loader(batch), steps // 2, accumulate=accumulate)
        out["accumulate"][name] = {"params": params, "allreduces": counter["n"]}
    if rt.get_context().world_rank == 0:
        torch.save(out, config["out"])
    rt.report({"done": 1})


def resume_fn(config):
    """fp16 mixed precision (GradScaler with a small growth interval and a scale that overflows
    at first), PowerSGD, and accumulation over 2 micro-batches, checkpointing every 3
    micro-steps (so every other checkpoint falls inside an accumulation group). On attempt 0,
    rank 1 SIGKILLs itself after micro-step ``config["kill"]``. Rank 0 saves the final state."""
    ctx = rt.get_context()
    kill = config.get("kill") if ctx.attempt == 0 and ctx.world_rank == 1 else None
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3)
    )
    model = rt.prepare_model(
        net,
        precision="16-mixed",
        comm_hook=config.get("comm_hook"),
        comm_hook_options={"start_powerSGD_iter": 2}
        if config.get("comm_hook") == "powersgd"
        else None,
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=3)
    optimizer = rt.prepare_optimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), grad_scaler=scaler
    )
    loader = rt.prepare_data_loader(DataLoader(NoisyDataset(), batch_size=6, shuffle=True), seed=1)
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    scales = []
    for _ in state.epochs(config["epochs"]):
        for x, y in loader:
            with rt.accumulate(model, 2) as sync:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                rt.backward(loss / 2)
            if sync:
                optimizer.step()
                optimizer.zero_grad()
                scales.append(scaler.get_scale())
            state.step += 1
            if kill == state.step:
                os.kill(os.getpid(), signal.SIGKILL)
            if state.step % 3 == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
    if ctx.world_rank == 0:
        module = model.module if hasattr(model, "module") else model
        torch.save(
            {
                "model": module.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict(),
                "step": state.step,
                "scales": scales,
            },
            config["out"],
        )
