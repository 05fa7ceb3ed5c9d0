"""Worker side of benchmarks/ddp_hooks.py (importable, so workers load it by reference)."""

from __future__ import annotations

import json
import statistics
import time

import torch
import torch.distributed as dist

import ringtrain as rt

HOOKS = (None, "bf16", "fp16", "powersgd")


def _mlp(width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 10),
    )


def bench_fn(config):
    width, steps, warmup = config["width"], config["steps"], config["warmup"]
    results = {}
    for hook in HOOKS:
        options = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 4}
        model = rt.prepare_model(
            _mlp(width), comm_hook=hook, comm_hook_options=options if hook == "powersgd" else None
        )
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, width), torch.randint(0, 10, (32,))
        sent = [0]
        original = dist.all_reduce

        def counting(tensor, *args, sent=sent, original=original, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        dist.all_reduce = counting
        times = []
        try:
            for step in range(warmup + steps):
                if step == warmup:
                    sent[0] = 0
                t0 = time.perf_counter()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                times.append(time.perf_counter() - t0)
        finally:
            dist.all_reduce = original
        params = sum(p.numel() for p in model.parameters())
        wire = sent[0] / steps if hook is not None else params * 4
        results[str(hook)] = {"step_s": statistics.median(times[warmup:]), "wire_bytes": wire}
    if rt.get_context().world_rank == 0:
        rt.report({"results": json.dumps(results), "params": params})
    else:
        rt.report({})
