"""The steady-state step cost of an elastic run against a plain one (issue 19, goodput).

An elastic run (``ScalingConfig(num_workers=(1, 2))``) pays at every step boundary for what lets
it survive a lost worker in place: the in-memory snapshot of the ``TrainState`` (copied into
buffers it reuses, then its per-rank part sent to the ring neighbour) and the agreement on
pausing for a grow. A plain run (``num_workers=2``) pays none of it. Goodput as issue 19 defines
it counts useful steps at the *plain* run's step period, so every millisecond the elastic path
adds to a full-world step is lost goodput, failures or not.

Workload: ``benchmarks/goodput.py``'s (``_goodput_worker.train_fn``: an MLP 784-1024-1024-10,
1.86 M parameters, momentum SGD, DDP on gloo, batch 64 per worker, a ``TrainState`` checkpoint
every ``--every`` steps written asynchronously), 2 local workers, ``--steps`` steps, no failure.
The runs alternate plain, elastic, elastic, plain, ... (``--runs`` of each), so a change of the
machine's load hits both alike. A run's step period is the median of the periods between
consecutive steps of rank 0 (the time its ``optimizer.step()`` returned); the figure of a mode
is the median over its runs, and the ratio elastic / plain is the overhead.

``--profile`` times, in every worker, the parts a step boundary runs
(``_elastic_overhead_worker``): the snapshot copy, the ring replication (before it was removed),
the grow-flag and preemption-flag agreements and the whole ``TrainState.step`` increment, and
each step's phases (forward, loss + backward with DDP's allreduce, ``optimizer.step()``, the
rest), and prints them per call (ms, mean over ranks and runs).

Usage::

    python benchmarks/elastic_overhead.py                          # 3 + 3 runs of 400 steps
    python benchmarks/elastic_overhead.py --runs 5 --steps 600 --profile
    python benchmarks/elastic_overhead.py --snapshot-interval 10   # a snapshot every 10 steps
    python benchmarks/elastic_overhead.py --modes plain,elastic,spares  # + a hot spare
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringtrain as rt

MODES = ("plain", "elastic", "spares")
"""``plain``: 2 workers; ``elastic``: ``num_workers=(1, 2)``; ``spares``: 2 workers and one hot
spare (whose snapshots also gather every rank's RNG states)."""


def one_run(mode: str, args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    """Run ``mode`` once: (median step period s, per-step ms of each profiled part)."""
    import _elastic_overhead_worker

    with tempfile.TemporaryDirectory(prefix="rt_elastic_overhead_") as tmp:
        log = os.path.join(tmp, "log")
        os.mkdir(log)
        config = {
            "steps": args.steps,
            "every": args.every,
            "batch": 64,
            "log": log,
            "profile": args.profile,
        }
        elastic = mode == "elastic"
        result = rt.Trainer(
            _elastic_overhead_worker.train_fn,
            rt.ScalingConfig(
                num_workers=(1, 2) if elastic else 2,
                spares=int(mode == "spares"),
                resources_per_worker={"CPU": 1},
            ),
            rt.RunConfig(
                name=mode,
                storage_path=os.path.join(tmp, "runs"),
                failure_config=rt.FailureConfig(
                    max_failures=int(mode == "spares"),
                    snapshot_interval_steps=args.snapshot_interval,
                ),
                checkpoint_config=rt.CheckpointConfig(num_to_keep=2, async_save=True),
                progress="off",
            ),
            train_loop_config=config,
        ).fit()
        if result.error is not None:
            raise SystemExit(f"{mode}: the run failed: {result.error}")
        with open(os.path.join(log, "steps.jsonl")) as f:
            times = [r["time"] for r in map(json.loads, f) if r["rank"] == 0]
        period = statistics.median(b - a for a, b in itertools.pairwise(times[args.skip :]))
        return period, _profile(log)


def _profile(log: str) -> dict[str, float]:
    """Per-step milliseconds of each timed part, mean over the ranks' profile files."""
    per_rank: dict[str, list[float]] = defaultdict(list)
    for name in sorted(os.listdir(log)):
        if not name.startswith("profile_rank"):
            continue
        with open(os.path.join(log, name)) as f:
            data = json.load(f)
        for part, total in data["totals_s"].items():
            per_rank[part].append(total / max(1, data["counts"][part]) * 1000)
    return {part: statistics.mean(values) for part, values in per_rank.items()}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each mode (interleaved)")
    parser.add_argument("--steps", type=int, default=400, help="steps per run")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out (warm-up)")
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--snapshot-interval", type=int, default=1, help="elastic runs")
    parser.add_argument("--profile", action="store_true", help="time the step-boundary parts")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--modes", default="plain,elastic", help=f"comma-separated, of {', '.join(MODES)}"
    )
    args = parser.parse_args(argv)
    modes = tuple(args.modes.split(","))
    if "plain" not in modes or not set(modes) <= set(MODES):
        parser.error(f"--modes: 'plain' and others of {', '.join(MODES)}")
    periods: dict[str, list[float]] = {mode: [] for mode in modes}
    parts: dict[str, dict[str, list[float]]] = {mode: defaultdict(list) for mode in modes}
    for run in range(args.runs):
        for mode in modes if run % 2 == 0 else modes[::-1]:  # ABBA: no mode always first
            period, profile = one_run(mode, args)
            periods[mode].append(period)
            for part, ms in profile.items():
                parts[mode][part].append(ms)
            print(f"run {run + 1} {mode:8s} step period {period * 1000:6.2f} ms", flush=True)
    medians = {mode: statistics.median(values) for mode, values in periods.items()}
    ratios = {mode: medians[mode] / medians["plain"] for mode in modes if mode != "plain"}
    ratio = ratios.get("elastic", next(iter(ratios.values()), 1.0))
    print(f"median step period: plain {medians['plain'] * 1000:.2f} ms", end="")
    for mode, r in ratios.items():
        print(f"; {mode} {medians[mode] * 1000:.2f} ms, x{r:.3f} ({(r - 1) * 100:+.1f} %)", end="")
    print()
    for mode in modes:
        for part, values in sorted(parts[mode].items()):
            print(f"  {mode:8s} {part:40s} {statistics.mean(values):7.3f} ms per call")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "periods_s": periods,
                    "median_s": medians,
                    "ratio": ratio,
                    "ratios": ratios,
                    "profile_ms": {m: {p: v for p, v in d.items()} for m, d in parts.items()},
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
