"""A lost rank of an HSDP run (2 replica groups x dp_shard 2, W=4): elastic on the dp_replicate
axis (the lost rank's replica group leaves, the other continues in place from memory) vs the
restart of the whole mesh from the latest disk checkpoint (fixed num_workers), side by side
(issue 22).

Each round runs both; rank 1 SIGKILLs itself after step ``--kill-step`` (checkpoints every
``--every`` steps). Reported (medians over rounds): SIGKILL -> the first step after it that the
run had not done before (recovery), the steps done twice, and the whole run's wall time.

    python benchmarks/hsdp_elastic.py                  # 3 rounds
    python benchmarks/hsdp_elastic.py --repeats 5 --width 512
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _hsdp_elastic_workload  # noqa: E402

import ringtrain as rt  # noqa: E402


def _one(elastic: bool, args: argparse.Namespace, root: str, name: str) -> dict[str, float]:
    out = os.path.join(root, name)
    os.makedirs(out)
    config = {
        "width": args.width,
        "kill_step": args.kill_step,
        "every": args.every,
        "steps": args.steps,
        "max": 4,
        "out": out,
    }
    scaling = rt.ScalingConfig(
        num_workers=(2, 4) if elastic else 4,
        parallel=rt.ParallelConfig(dp_replicate=-1 if elastic else 2, dp_shard=2),
        elastic_grow_after_s=None,  # stay at 2: the recovery is what is measured
    )
    run = rt.RunConfig(
        name=name,
        storage_path=os.path.join(root, "runs"),
        progress="off",
        failure_config=rt.FailureConfig(max_failures=2),
    )
    start = time.perf_counter()
    result = rt.Trainer(
        _hsdp_elastic_workload.train_fn, scaling, run, train_loop_config=config
    ).fit()
    wall = time.perf_counter() - start
    if result.error is not None:
        raise RuntimeError(f"{name}: {result.error}")
    with open(os.path.join(out, "killed")) as f:
        killed = float(f.read())
    steps: list[tuple[int, float]] = []
    for file in os.listdir(out):
        if file.endswith(".steps"):
            with open(os.path.join(out, file)) as f:
                steps += [(int(a), float(b)) for a, b in (line.split() for line in f)]
    after = [t for s, t in steps if t > killed and s > args.kill_step]
    redone = {s for s, t in steps if t > killed and s <= args.kill_step}
    return {"recovery_s": min(after) - killed, "redone": len(redone), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-step", type=int, default=14)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"elastic": [], "restart": []}
    with tempfile.TemporaryDirectory() as root:
        for i in range(args.repeats):
            for kind in ("elastic", "restart"):
                results[kind].append(_one(kind == "elastic", args, root, f"{kind}{i}"))
                print(kind, i, results[kind][-1], flush=True)
    med = {
        kind: {key: statistics.median(r[key] for r in rows) for key in rows[0]}
        for kind, rows in results.items()
    }
    print("\n| HSDP 2x2, W=4, SIGKILL rank 1 | recovery (s) | steps redone | run wall (s) |")
    print("|---|---|---|---|")
    for kind in ("elastic", "restart"):
        m = med[kind]
        print(f"| {kind} | {m['recovery_s']:.2f} | {m['redone']:.0f} | {m['wall_s']:.1f} |")
    ratio = med["restart"]["recovery_s"] / med["elastic"]["recovery_s"]
    print(f"\nrecovery: restart / elastic = {ratio:.1f}x (medians of {args.repeats} rounds)")


if __name__ == "__main__":
    main()
