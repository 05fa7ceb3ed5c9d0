"""Worker side of benchmarks/exact_order.py (importable, so workers load it by reference)."""

from __future__ import annotations

import itertools
import json
import statistics
import time

import torch

import ringtrain as rt

ORDERS = ("fixed", "rebuild")
"""``prepare_model(bucket_order=...)``: ringtrain's fixed layout, and torch's DDP."""


def _mlp(sizes: list[int]) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(torch.nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def step_time_fn(config: dict) -> None:
    """Both DDPs of the same MLP side by side in one process group, timed in interleaved
    blocks of ``block`` steps (``rounds`` blocks each, after ``warmup`` steps each): reports
    every block's median step time per order."""
    sizes, batch = config["sizes"], config["batch"]
    models = {}
    # ``reverse_build``: build torch's first (the driver runs both, so that neither order is
    # always built, and allocated, first)
    for order in ORDERS[::-1] if config.get("reverse_build") else ORDERS:
        model = rt.prepare_model(_mlp(sizes), bucket_order=order)
        models[order] = (model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(rt.get_context().world_rank)
    x = torch.randn(batch, sizes[0], generator=g)
    y = torch.randint(0, sizes[-1], (batch,), generator=g)

    def run(order: str, steps: int) -> list[float]:
        model, opt = models[order]
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return times

    for order in ORDERS:
        run(order, config["warmup"])  # torch's DDP rebuilds its buckets in here
    blocks: dict[str, list[float]] = {order: [] for order in ORDERS}
    for i in range(config["rounds"]):
        # alternate which goes first, so that neither always follows the other
        for order in ORDERS if i % 2 == 0 else ORDERS[::-1]:
            blocks[order].append(statistics.median(run(order, config["block"])))
    params = sum(p.numel() for p in models["fixed"][0].parameters())
    buckets = {o: len(m.reducer._get_zeros_like_grad_buckets()) for o, (m, _) in models.items()}
    rt.report({"blocks": json.dumps(blocks), "params": params, "buckets": json.dumps(buckets)})
