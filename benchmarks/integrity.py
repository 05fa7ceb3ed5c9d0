"""What the silent-data-corruption checks cost, how often they cry wolf, and what they catch
(docs/fault-tolerance.md, "Silent data corruption"; docs/benchmarks.md, "Silent data corruption").

``cost``: the steady-state step period of ``benchmarks/goodput.py``'s workload (an MLP
784-1024-1024-10, 1.86 M parameters, momentum SGD, DDP on gloo, batch 64 per worker, an
asynchronous checkpoint every 20 steps) at W=2 with no check, with ``replica_check_every=1`` and
``=10``, and with ``replay_check_every=100``; the runs alternate (ABBA...) and each mode's figure is
the median over its runs of the median period between rank 0's steps.

``false``: clean runs of ``tests/integrity_workloads.sdc_fn``-like training with both checks at
every step, across configurations (plain DDP; two DataLoader workers; bf16 autocast on CPU;
gradient accumulation over 2 micro-batches; the bf16 communication hook): the number of
``replica_mismatch`` events over the steps run (target: 0).

``detect``: at W=3 (``--workers``), a bit flipped once in a parameter, in the optimizer state, and
in one local gradient of a random rank at a random step (seeded; ``--trials`` each), with
``replica_check_every`` and ``replay_check_every`` as given: the share caught and the steps from
the flip to the check that caught it; for the transient gradient flip the rate is a function of
``replay_check_every`` (a flip is seen only if its rank's step is replayed). ``faulty``: a rank
whose gradient is wrong at every step from a random step on (a miscomputing core): the steps
until the replay check catches it.

Usage::

    python benchmarks/integrity.py cost --runs 3 --steps 300
    python benchmarks/integrity.py false --steps 2000
    python benchmarks/integrity.py detect --trials 10 --replay-every 1,2,4
    python benchmarks/integrity.py detect --trials 10 --replay-every 4,100 --cases faulty
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)

import ringtrain as rt

COST_MODES = {
    "off": {},
    "replica_check_every=1": {"replica_check_every": 1},
    "replica_check_every=10": {"replica_check_every": 10},
    "replay_check_every=100": {"replay_check_every": 100},
}


def _period(log: str, skip: int) -> float:
    with open(os.path.join(log, "steps.jsonl")) as f:
        times = [r["time"] for r in map(json.loads, f) if r["rank"] == 0]
    return statistics.median(b - a for a, b in itertools.pairwise(times[skip:]))


def cost(args: argparse.Namespace) -> dict:
    import _goodput_worker

    periods: dict[str, list[float]] = {mode: [] for mode in COST_MODES}
    order = list(COST_MODES)
    for run in range(args.runs):
        for mode in order if run % 2 == 0 else order[::-1]:
            with tempfile.TemporaryDirectory(prefix="rt_integrity_") as tmp:
                log = os.path.join(tmp, "log")
                os.mkdir(log)
                result = rt.Trainer(
                    _goodput_worker.train_fn,
                    rt.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                    rt.RunConfig(
                        name="cost",
                        storage_path=os.path.join(tmp, "runs"),
                        failure_config=rt.FailureConfig(**COST_MODES[mode]),
                        checkpoint_config=rt.CheckpointConfig(num_to_keep=2),
                        progress="off",
                    ),
                    train_loop_config={"steps": args.steps, "every": 20, "batch": 64, "log": log},
                ).fit()
                if result.error is not None:
                    raise SystemExit(f"{mode}: {result.error}")
                periods[mode].append(_period(log, args.skip))
            print(f"run {run + 1} {mode:24s} {periods[mode][-1] * 1000:7.2f} ms/step", flush=True)
    medians = {m: statistics.median(v) for m, v in periods.items()}
    base = medians["off"]
    for mode, value in medians.items():
        print(f"{mode:24s} median {value * 1000:7.2f} ms/step  x{value / base:.3f}")
    return {"periods_s": periods, "median_s": medians}


FALSE_CONFIGS = {
    "ddp": {},
    "loader workers": {"loader_workers": 2},
    "bf16 autocast": {"precision": "bf16-mixed"},
    "accumulation x2": {"accumulate": 2},
    "bf16 comm hook": {"comm_hook": "bf16"},
}


def false_positives(args: argparse.Namespace) -> dict:
    import integrity_workloads

    found: dict[str, dict] = {}
    for name, extra in FALSE_CONFIGS.items():
        with tempfile.TemporaryDirectory(prefix="rt_integrity_fp_") as tmp:
            per_epoch = 96 // (4 * args.workers)  # sdc_fn: 96 samples, 4 per batch per rank
            epochs = -(-args.steps // per_epoch)  # at least --steps steps
            result = rt.Trainer(
                integrity_workloads.sdc_fn,
                rt.ScalingConfig(num_workers=args.workers),
                rt.RunConfig(
                    name="fp",
                    storage_path=os.path.join(tmp, "runs"),
                    failure_config=rt.FailureConfig(replica_check_every=1, replay_check_every=1),
                    checkpoint_config=rt.CheckpointConfig(num_to_keep=1),
                    progress="off",
                ),
                train_loop_config={
                    "out": os.path.join(tmp, "out.pt"),
                    "epochs": epochs,
                    "ckpt_every": 50,
                    **extra,
                },
            ).fit()
            events = _events(result.path)
            steps = max((e.get("metrics", {}).get("step", 0) for e in events), default=0)
            mismatches = [e for e in events if e["type"] == "replica_mismatch"]
            found[name] = {"status": result.status, "steps": steps, "mismatches": len(mismatches)}
            print(f"{name:18s} {result.status:9s} steps {steps:6d} mismatches {len(mismatches)}")
    total = sum(v["steps"] for v in found.values())
    print(
        f"total clean steps {total}, false positives {sum(v['mismatches'] for v in found.values())}"
    )
    return found


#: sdc_fn: 96 samples, batch 4 -> 96 / (4 W) steps per epoch. Runs are three epochs (at least
#: three replay periods) and the flip lands at a step before the run's last check.
DETECT_EPOCHS = 3


def _events(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [json.loads(line) for line in f]


def detect(args: argparse.Namespace) -> dict:
    import integrity_workloads

    rng = random.Random(args.seed)
    out: dict[str, dict] = {}
    cases = [("param", args.replica_every, 0), ("optimizer", args.replica_every, 0)]
    cases += [("gradient", 0, m) for m in args.replay_every]
    cases += [("faulty", 0, m) for m in args.replay_every]
    cases = [c for c in cases if c[0] in args.cases]
    for name, replica, replay in cases:
        # "faulty": the rank's gradient is wrong at every step from the flip on (a core that
        # miscomputes); the run stops naming it after a rollback.
        where, every = ("gradient", True) if name == "faulty" else (name, False)
        caught, delays = 0, []
        for trial in range(args.trials):
            per_epoch = 96 // (4 * args.workers)
            epochs = max(DETECT_EPOCHS, -(-3 * replay // per_epoch))  # 3 replay periods or more
            steps = per_epoch * epochs
            last = steps - 1 if not replay else (steps // replay) * replay - 1
            rank, step = rng.randrange(args.workers), rng.randint(2, last)
            with tempfile.TemporaryDirectory(prefix="rt_integrity_det_") as tmp:
                trainer = rt.Trainer(
                    integrity_workloads.sdc_fn,
                    rt.ScalingConfig(num_workers=args.workers),
                    rt.RunConfig(
                        name="det",
                        storage_path=os.path.join(tmp, "runs"),
                        failure_config=rt.FailureConfig(
                            replica_check_every=replica, replay_check_every=replay
                        ),
                        progress="off",
                    ),
                    train_loop_config={
                        "out": os.path.join(tmp, "out.pt"),
                        "epochs": epochs,
                        "inject": {"rank": rank, "where": where, "step": step, "every": every},
                    },
                )
                try:
                    trainer.fit()
                except rt.TrainingFailedError:
                    if not every:
                        raise
                run_dir = os.path.join(tmp, "runs", "det")
                hits = [e for e in _events(run_dir) if e["type"] == "replica_mismatch"]
                if hits:
                    caught += 1
                    flipped = step + 1 if where == "gradient" else step
                    delays.append(hits[0]["step"] - flipped)
            print(f"{name} trial {trial} rank {rank} step {step}: {'caught' if hits else 'missed'}")
        key = f"{name} (replica {replica}, replay {replay})"
        out[key] = {"caught": caught, "trials": args.trials, "delays": delays}
        print(f"{key}: caught {caught}/{args.trials}, steps to detection {delays}")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("cost")
    c.add_argument("--runs", type=int, default=3)
    c.add_argument("--steps", type=int, default=300)
    c.add_argument("--skip", type=int, default=20)
    f = sub.add_parser("false")
    f.add_argument("--steps", type=int, default=2000, help="steps per configuration (at least)")
    f.add_argument("--workers", type=int, default=2)
    d = sub.add_parser("detect")
    d.add_argument("--trials", type=int, default=10)
    d.add_argument("--workers", type=int, default=3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--replica-every", type=int, default=3)
    d.add_argument(
        "--replay-every", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4]
    )
    d.add_argument(
        "--cases",
        type=lambda s: s.split(","),
        default=["param", "optimizer", "gradient", "faulty"],
        help="comma-separated: param, optimizer, gradient (transient), faulty (every step)",
    )
    for p in (c, f, d):
        p.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = {"cost": cost, "false": false_positives, "detect": detect}[args.what](args)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "results": results}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
