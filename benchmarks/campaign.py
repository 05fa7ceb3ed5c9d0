"""The fault campaign as a benchmark (issue 18): how often a DDP training resumes exactly, and how
long recovery takes, at W=2 and W=3.

For each world size, ``ringtrain.chaos.run_campaign`` runs the train function below once without
faults, then ``--runs`` times under a seeded-random schedule of ``--faults-per-run`` faults drawn
from SIGKILL of a random rank at a random moment of a step, SIGKILL in the middle of a checkpoint
file write, SIGSTOP (caught by ``FailureConfig.worker_timeout_s``, ``--hang-timeout``) and SIGKILL
of the driver (the run resumed with ``Trainer.restore(path).fit()``). Every checkpoint of every
faulty run is compared bit for bit with the clean run's.

The train function: a 4-layer MLP with dropout (70 k parameters; ``--width 512``: 352 k) under DDP
(``prepare_model(bucket_order=--bucket-order, bucket_cap_mb=--bucket-cap-mb)``) on gloo, SGD with
momentum, StepLR, input noise from NumPy and Python's ``random`` (all RNG in the TrainState),
``prepare_data_loader`` over 240 samples, batch 8 per worker, a TrainState checkpoint every 2
steps, 2 epochs (30 steps at W=2, 20 at W=3).

Printed, per world size: runs, exact, diverged, hung, errored, with orphans, faults injected,
mean and median recovery time (seconds from a fault to the first training step of the restarted
workers; includes the hang timeout for SIGSTOP faults and a new driver for driver kills).

Usage::

    python benchmarks/campaign.py                          # W=2,3, 3 runs each, seed 0
    python benchmarks/campaign.py --workers 2 --runs 1     # smoke run
    python benchmarks/campaign.py --json /tmp/campaign.json
    # torch's DDP (buckets rebuilt after the first step), several buckets: W=3 should diverge
    python benchmarks/campaign.py --workers 3 --faults kill --bucket-order rebuild \\
        --width 512 --bucket-cap-mb 0.25
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import ringtrain as rt
from ringtrain.chaos import FAULT_KINDS, run_campaign
from ringtrain.chaos.display import Display


def train_fn(config):
    import random

    import numpy as np
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(240, 16, generator=gen), torch.randint(0, 4, (240,), generator=gen)
    width = config.get("width", 192)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, width),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 160),
        torch.nn.ReLU(),
        torch.nn.Linear(160, 4),
    )
    model = rt.prepare_model(
        net, bucket_order=config.get("bucket_order", "fixed"), bucket_cap_mb=config.get("cap_mb")
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    loader = rt.prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True))
    state = rt.TrainState(
        model=model, optimizer=optimizer, lr_scheduler=scheduler, data_loader=loader
    )
    state.restore()
    for _epoch in state.epochs(config.get("epochs", 2)):
        for xb, yb in loader:
            noise = torch.from_numpy(np.random.randn(*xb.shape)).float() * random.random()
            loss = torch.nn.functional.cross_entropy(model(xb + 0.01 * noise), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            state.step += 1
            if state.step % 2 == 0:
                rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--faults", default=",".join(FAULT_KINDS))
    parser.add_argument("--faults-per-run", type=int, default=2)
    parser.add_argument("--hang-timeout", type=float, default=5.0)
    parser.add_argument("--out", default=None, help="campaign directory (default: a temp dir)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--bucket-order",
        choices=("fixed", "rebuild"),
        default="fixed",
        help="prepare_model(bucket_order=...): 'rebuild' is torch's DDP, whose buckets are rebuilt "
        "after the first step (before issue 18's fix: a resumed run at W>=3 differs at ULP level)",
    )
    parser.add_argument("--width", type=int, default=192, help="hidden width (192: 70 k params)")
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=None, help="DDP bucket size (default: torch's 25)"
    )
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="ringtrain-campaign-")
    started = time.time()
    report = run_campaign(
        train_fn,
        train_loop_config={
            "epochs": 2,
            "bucket_order": args.bucket_order,
            "cap_mb": args.bucket_cap_mb,
            "width": args.width,
        },
        scaling_config=rt.ScalingConfig(num_workers=2),
        runs=args.runs,
        seed=args.seed,
        faults=tuple(args.faults.split(",")),
        faults_per_run=args.faults_per_run,
        workers=tuple(int(w) for w in args.workers.split(",")),
        hang_timeout_s=args.hang_timeout,
        out_dir=out,
        display=Display("plain"),
    )
    if args.json:
        report.write_json(args.json)
    print(f"\ncampaign directory: {out}; {time.time() - started:.0f} s in all\n")
    print(
        "| W | runs | exact | diverged | hung | errored | orphans | faults injected | "
        "recovery mean (median) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for w in report.config.workers:
        s = report.summary(w)
        rec = [x for r in report.runs if r.world_size == w for x in r.recovery_s]
        median = f"{statistics.median(rec):.2f}" if rec else "-"
        mean = f"{s['mean_recovery_s']:.2f} s ({median} s)" if rec else "-"
        print(
            f"| {w} | {s['runs']} | {s['exact']} | {s['diverged']} | {s['hung']} | "
            f"{s['errored']} | {s['orphans']} | {s['faults_injected']} | {mean} |"
        )
    print()
    for r in report.runs:
        kinds = ", ".join(f"{f['kind']}@{f.get('fired_at_step', f['step'])}" for f in r.faults)
        print(f"- W={r.world_size} run {r.index} (seed {r.seed}; {kinds}): {r.verdict}: {r.detail}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
