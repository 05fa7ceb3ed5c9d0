"""Elastic recovery (issue 8): time from a worker's death to the next completed training step,
resize in place vs full restart from the disk checkpoint.

Each run: 3 local workers (gloo, ``resources_per_worker={"CPU": 1}``), ``_elastic_worker.train_fn``
(``layers`` x ``Linear(width, width)``, momentum SGD, a TrainState checkpointed every ``every``
steps, asynchronously); rank 1 SIGKILLs itself right after step ``kill_step`` (after waiting
``settle_s`` so that the checkpoint of that step is on storage: both modes then resume from
the same step). Recovery = (first step after the kill completed by every rank of the new
group) - (the kill's ``time.time()``).

- in place: ``ScalingConfig(num_workers=(2, 3))``, ``FailureConfig(snapshot_interval_steps=1)``:
  the two survivors re-form the group and continue from their in-memory snapshot.
- restart: ``ScalingConfig(num_workers=3)``, ``FailureConfig(max_failures=1)``: the group is
  stopped, three fresh processes start and restore the checkpoint from disk.

Usage::

    python benchmarks/elastic.py --runs 3                       # small model (~0.8 M params)
    python benchmarks/elastic.py --runs 3 --width 4096 --layers 6 --batch 2 \
        --kill-step 2 --settle-s 6                              # 100.7 M params
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringtrain as rt


def one_run(mode: str, args: argparse.Namespace) -> float:
    import _elastic_worker

    with tempfile.TemporaryDirectory(prefix="rt_elastic_bench_") as tmp:
        config = {
            "width": args.width,
            "layers": args.layers,
            "batch": args.batch,
            "steps": args.kill_step + 3,
            "every": args.kill_step,
            "kill_step": args.kill_step,
            "settle_s": args.settle_s,
            "log": tmp,
        }
        elastic = mode == "in_place"
        result = rt.Trainer(
            _elastic_worker.train_fn,
            rt.ScalingConfig(num_workers=(2, 3) if elastic else 3, resources_per_worker={"CPU": 1}),
            rt.RunConfig(
                name=mode,
                storage_path=os.path.join(tmp, "runs"),
                failure_config=rt.FailureConfig(max_failures=1, snapshot_interval_steps=1),
                progress="off",
            ),
            train_loop_config=config,
        ).fit()
        assert len(result.failures) == 1, result.failures
        with open(os.path.join(tmp, "kill")) as f:
            killed = float(f.read())
        after = []
        for path in glob.glob(os.path.join(tmp, "*.jsonl")):
            with open(path) as f:
                after += [json.loads(line) for line in f]
        after = [r for r in after if r["time"] > killed]
        first = min(r["step"] for r in after)
        return max(r["time"] for r in after if r["step"] == first) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="per worker at 3 workers")
    parser.add_argument("--kill-step", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f} M params"
    )
    out: dict[str, list[float]] = {}
    for mode in ("in_place", "restart"):
        out[mode] = [one_run(mode, args) for _ in range(args.runs)]
        times = ", ".join(f"{t:.2f}" for t in out[mode])
        print(
            f"{mode:9s} death -> next step: median {statistics.median(out[mode]):.2f} s ({times})"
        )
    ratio = statistics.median(out["restart"]) / statistics.median(out["in_place"])
    print(f"in place is {ratio:.1f}x faster than the full restart")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "seconds": out, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
