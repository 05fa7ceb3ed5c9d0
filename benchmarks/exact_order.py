"""Bit-exact resume at any world size (issue 18): the cost of ringtrain's fixed DDP bucket order,
and how often a SIGKILLed run still ends bit-identical.

Step time: the same MLP wrapped by ``prepare_model(bucket_order="fixed")`` (ringtrain's
``FixedOrderDDP``, the default) and ``bucket_order="rebuild"`` (torch's DDP) side by side in one
W-worker gloo group, timed in interleaved blocks; prints the median over blocks of each block's
median step time, and the ratio fixed / rebuild (1.00 = no cost). Two runs per model, each
order built (and allocated) first in one of them, pooled; the per-run ratios are printed too (a
first trial that always built the fixed one first measured it 1.24x slower, which a plain-torch
check with the other build order did not reproduce). Two models: a small one
(2.6k parameters, latency-bound) and a big one (~16M parameters, 3 DDP buckets).

    python benchmarks/exact_order.py --workers 3 --rounds 7

Campaign: ``--campaign N`` runs, per world size in ``--campaign-workers`` (2 and 3) and per
bucket order, an uninterrupted run and N runs with a seeded random kill schedule (1 or 2
SIGKILLs of any rank: after a step, at an epoch's start, or in the middle of a checkpoint
write), and counts the runs whose final parameters and optimizer state are bit-identical to the
uninterrupted run's.

    python benchmarks/exact_order.py --campaign 8 --seed 2026
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the kill-schedule workload

import torch  # noqa: E402
from _exact_order_workload import ORDERS, step_time_fn  # noqa: E402

import ringtrain as rt  # noqa: E402

MODELS = {
    "small": {"sizes": [6, 64, 32, 3], "batch": 8, "block": 40, "warmup": 10},
    "16M": {"sizes": [1024, 3072, 3072, 1024, 10], "batch": 32, "block": 4, "warmup": 3},
}


def step_times(workers: int, rounds: int) -> None:
    print(f"step time, W={workers}, gloo on CPU, 2 runs x {rounds} interleaved blocks per order")
    print(
        f"{'model':<7} {'params':>8} {'buckets':>9} {'fixed (ms)':>11} {'rebuild (ms)':>13} "
        f"{'ratio':>6} {'fixed built 1st':>16} {'rebuild built 1st':>18}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in MODELS.items():
            blocks: dict[str, list[float]] = {o: [] for o in ORDERS}
            per_run = []
            for reverse in (False, True):  # each order built (and allocated) first once
                result = rt.Trainer(
                    step_time_fn,
                    rt.ScalingConfig(num_workers=workers),
                    rt.RunConfig(name=f"{name}{int(reverse)}", storage_path=tmp, progress="off"),
                    train_loop_config={**cfg, "rounds": rounds, "reverse_build": reverse},
                ).fit()
                run = json.loads(result.metrics["blocks"])
                per_run.append(statistics.median(run["fixed"]) / statistics.median(run["rebuild"]))
                for order, times in run.items():
                    blocks[order] += times
            buckets = json.loads(result.metrics["buckets"])
            fixed, rebuild = (statistics.median(blocks[o]) for o in ORDERS)
            print(
                f"{name:<7} {result.metrics['params']:>8} "
                f"{buckets['fixed']:>4}/{buckets['rebuild']:<4} {fixed * 1e3:>11.2f} "
                f"{rebuild * 1e3:>13.2f} {fixed / rebuild:>6.3f} {per_run[0]:>16.3f} "
                f"{per_run[1]:>18.3f}",
                flush=True,
            )


def _schedule(rng: random.Random, workers: int) -> list[list]:
    from test_exact_resume import _random_schedule

    return _random_schedule(rng, workers)


def _fit(root: str, name: str, workers: int, order: str, kills: list) -> dict:
    import exact_workloads as ew

    out = os.path.join(root, f"{name}.pt")
    rt.Trainer(
        ew.exact_resume_fn,
        rt.ScalingConfig(num_workers=workers),
        rt.RunConfig(
            name=name,
            storage_path=os.path.join(root, "runs"),
            failure_config=rt.FailureConfig(max_failures=len(kills)),
            progress="off",
        ),
        train_loop_config={"epochs": 3, "out": out, "kills": kills, "bucket_order": order},
    ).fit()
    return torch.load(out, weights_only=True)


def _identical(a: dict, b: dict) -> bool:
    same = a["step"] == b["step"] and all(
        torch.equal(v, b["model"][k]) for k, v in a["model"].items()
    )
    for i, s in a["optimizer"].items():
        same = same and all(torch.equal(v, b["optimizer"][i][k]) for k, v in s.items())
    return same


def campaign(n: int, seed: int, worker_counts: list[int]) -> None:
    print(f"kill campaign: {n} seeded runs per world size and order (seed {seed})")
    print(f"{'W':>2} {'bucket_order':<13} {'exact':>6} {'diverged':>9}  diverged seeds")
    with tempfile.TemporaryDirectory() as root:
        for workers in worker_counts:
            for order in ORDERS:
                clean = _fit(root, f"clean_w{workers}_{order}", workers, order, [])
                exact, diverged = 0, []
                for i in range(n):
                    run_seed = seed * 1000 + workers * 100 + i
                    kills = _schedule(random.Random(run_seed), workers)
                    got = _fit(root, f"w{workers}_{order}_{i}", workers, order, kills)
                    if _identical(clean, got):
                        exact += 1
                    else:
                        diverged.append(run_seed)
                print(
                    f"{workers:>2} {order:<13} {exact:>6} {len(diverged):>9}  {diverged}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=7, help="interleaved blocks per order")
    parser.add_argument("--campaign", type=int, default=0, help="kill runs per W and order")
    parser.add_argument("--campaign-workers", default="2,3")
    parser.add_argument("--seed", type=int, default=2026)
    args = parser.parse_args()
    if args.campaign:
        campaign(args.campaign, args.seed, [int(w) for w in args.campaign_workers.split(",")])
    else:
        step_times(args.workers, args.rounds)


if __name__ == "__main__":
    main()
