"""Elastic recovery (issue 8): time from a worker's death to the next completed training step,
resize in place vs full restart from the disk checkpoint.

Each run: 3 local workers (gloo, ``resources_per_worker={"CPU": 1}``), ``_elastic_worker.train_fn``
(``layers`` x ``Linear(width, width)``, momentum SGD, a TrainState checkpointed every ``every``
steps, asynchronously); rank ``--kill-rank`` (default 1) SIGKILLs itself right after step
``kill_step`` (after waiting ``settle_s`` so that the checkpoint of that step is on storage: both
modes then resume from the same step). Recovery = (first step after the kill completed by every rank
of the new group: its ``optimizer.step()`` returned) - (the kill's ``time.time()``). Also printed:
what the ``state.step`` increment costs per step (in place: the in-memory snapshot taken there) and
the step period, from the steps without a failure in between.

- in place: ``ScalingConfig(num_workers=(2, 3))``, ``FailureConfig(snapshot_interval_steps=1)``:
  the two survivors re-form the group and continue from their in-memory snapshot.
- restart: ``ScalingConfig(num_workers=3)``, ``FailureConfig(max_failures=1)``: the group is
  stopped, three fresh processes start and restore the checkpoint from disk.
- grow (``--grow``): as in place, with ``elastic_grow_after_s=0``: once the group runs at 2, a
  third worker is started (capacity returned) and joins at the next step boundary, receiving
  the state by broadcast. Measured from the ``resize`` event of the grow: capacity return (the
  worker started) -> first step completed at 3 workers (``resume_s``), and how long the two
  members were paused for it (``paused_s``: from leaving the train function to that step).
  The steps at 2 workers sleep ``--slow-s`` so that the run outlasts the worker's start.

Usage::

    python benchmarks/elastic.py --runs 3                       # small model (~0.8 M params)
    python benchmarks/elastic.py --runs 3 --width 4096 --layers 6 --batch 2 \
        --kill-step 2 --settle-s 6                              # 100.7 M params
    python benchmarks/elastic.py --runs 3 --grow                # growing back 2 -> 3
    python benchmarks/elastic.py --runs 3 --kill-rank 0         # losing rank 0
"""

from __future__ import annotations

import argparse
import glob
import itertools
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
            "kill_rank": args.kill_rank,
            "settle_s": args.settle_s,
            "log": tmp,
        }
        elastic = mode == "in_place"
        result = rt.Trainer(
            _elastic_worker.train_fn,
            rt.ScalingConfig(
                num_workers=(2, 3) if elastic else 3,
                resources_per_worker={"CPU": 1},
                elastic_grow_after_s=None if elastic else 10.0,  # measure the shrink alone
            ),
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
        logs = []
        for path in glob.glob(os.path.join(tmp, "*.jsonl")):
            with open(path) as f:
                logs.append([json.loads(line) for line in f])
        STEP_COSTS.setdefault(mode, []).extend(_step_costs(logs))
        after = [r for records in logs for r in records if r["time"] > killed]
        first = min(r["step"] for r in after)
        return max(r["time"] for r in after if r["step"] == first) - killed


# mode -> [(snapshot_s, step period s)] of the steps run without a failure in between
STEP_COSTS: dict[str, list[tuple[float, float]]] = {}


def _step_costs(logs: list[list[dict]]) -> list[tuple[float, float]]:
    """Per process, each step's ``snapshot_s`` and the time since its previous step at the
    same world size."""
    costs = []
    for records in logs:
        for prev, rec in itertools.pairwise(records):
            if rec["world"] == prev["world"] and rec["step"] == prev["step"] + 1:
                costs.append((rec["snapshot_s"], rec["time"] - prev["time"]))
    return costs


def grow_run(args: argparse.Namespace) -> tuple[float, float]:
    """One run that shrinks 3 -> 2 and grows back: ``(resume_s, paused_s)`` of the grow."""
    import _elastic_worker

    with tempfile.TemporaryDirectory(prefix="rt_elastic_bench_") as tmp:
        config = {
            "width": args.width,
            "layers": args.layers,
            "batch": args.batch,
            "steps": args.kill_step + args.grow_steps,
            "every": args.kill_step,
            "kill_step": args.kill_step,
            "settle_s": 0.0,
            "slow_s": args.slow_s,
            "log": tmp,
        }
        result = rt.Trainer(
            _elastic_worker.train_fn,
            rt.ScalingConfig(
                num_workers=(2, 3), resources_per_worker={"CPU": 1}, elastic_grow_after_s=0.0
            ),
            rt.RunConfig(
                name="grow",
                storage_path=os.path.join(tmp, "runs"),
                failure_config=rt.FailureConfig(max_failures=1, snapshot_interval_steps=1),
                progress="off",
            ),
            train_loop_config=config,
        ).fit()
        with open(os.path.join(result.path, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
        grows = [e for e in events if e["type"] == "resize" and e["new_world_size"] == 3]
        if not grows or grows[0]["resume_s"] is None:
            raise SystemExit("the group did not grow back before the run ended: raise --grow-steps")
        return float(grows[0]["resume_s"]), float(grows[0]["paused_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="per worker at 3 workers")
    parser.add_argument("--kill-step", type=int, default=4)
    parser.add_argument("--kill-rank", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--json", help="write the numbers to this file")
    parser.add_argument("--grow", action="store_true", help="measure growing back 2 -> 3")
    parser.add_argument("--grow-steps", type=int, default=60, help="--grow: steps after the kill")
    parser.add_argument("--slow-s", type=float, default=0.25, help="--grow: sleep per step at 2")
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}) = {params / 1e6:.1f} M params"
    )
    if args.grow:
        runs = [grow_run(args) for _ in range(args.runs)]
        resume = [r for r, _ in runs]
        paused = [p for _, p in runs]
        print(
            f"grow 2 -> 3: capacity return -> first step at 3 workers: median "
            f"{statistics.median(resume):.2f} s ({', '.join(f'{t:.2f}' for t in resume)}); "
            f"members paused: median {statistics.median(paused):.2f} s "
            f"({', '.join(f'{t:.2f}' for t in paused)})"
        )
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"params": params, "resume_s": resume, "paused_s": paused}, f, indent=1)
        return
    out: dict[str, list[float]] = {}
    for mode in ("in_place", "restart"):
        out[mode] = [one_run(mode, args) for _ in range(args.runs)]
        times = ", ".join(f"{t:.2f}" for t in out[mode])
        print(
            f"{mode:9s} death -> next step: median {statistics.median(out[mode]):.2f} s ({times})"
        )
    ratio = statistics.median(out["restart"]) / statistics.median(out["in_place"])
    print(f"in place is {ratio:.2f}x faster than the full restart")
    for mode, costs in STEP_COSTS.items():
        if costs:
            snap = statistics.median(c for c, _ in costs)
            period = statistics.median(p for _, p in costs)
            print(
                f"{mode:9s} per step: state.step increment (elastic: the in-memory snapshot) "
                f"median {snap * 1000:.0f} ms; a step (optimizer step to optimizer step) "
                f"median {period:.2f} s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": params, "seconds": out, "ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
