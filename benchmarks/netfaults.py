"""A randomized network-fault campaign: W=3 Ray jobs on three hosts made of network namespaces
(``ringtrain.testing.netbed``, one Ray node each, token authentication on), each hit by one fault
drawn at random (a lost host, a partition left down, a flap shorter than the heartbeat timeout,
a brown-out to 1 Mbit/s) on a random worker host other than the driver's, at a random moment
(after checkpoint round 1-8 is published, plus 0-1.5 s). Needs root (namespaces).

    python benchmarks/netfaults.py --runs 20 --seed 1 --json /tmp/netfaults.json

Each run is compared bit for bit with the same job on three local processes, uninterrupted
(``tests/multihost/faults.py`` runs it and reads the outcome). Reported: the share of runs that
end bit-exact, orphans (ringtrain processes on any host after the run ended and the link
healed), hangs (a run that did not end within ``--limit-s``), split-brain writes (a cut-off
worker's checkpoint try after the controller decided to replace it that was not refused, a
published checkpoint that does not verify, a staging directory left behind), and per fault the
time from the fault to the first failure event (detection), to the failure policy's decision
(written once the lost group is torn down) and to the first report of the replacing attempt
(training again), medians and maxima. Every run's seed is printed: ``--seed S
--runs 1`` repeats run S.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "multihost"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"median {statistics.median(values):.1f} s, max {max(values):.1f} s (n={len(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs (one fault each)")
    parser.add_argument("--seed", type=int, default=1, help="run i uses seed SEED + i")
    parser.add_argument("--faults", default="host_loss,partition,flap,brownout")
    parser.add_argument("--limit-s", type=float, default=400.0, help="a run longer hangs (s)")
    parser.add_argument("--json", help="write every run's outcome here")
    args = parser.parse_args()

    from faults import TIMEOUT_S, reference, run_with_fault
    from ringtrain.testing.netbed import NetBed, unavailable
    from ringtrain.testing.raybed import RayBed

    why = unavailable()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    faults = args.faults.split(",")
    work = Path(tempfile.mkdtemp(prefix="netfaults-"))
    ref = reference(work / "reference")
    outcomes = []
    started = time.monotonic()
    with NetBed(hosts=3) as bed, RayBed(bed, cpus=2, token_auth=True) as ray_bed:
        for i in range(args.runs):
            seed = args.seed + i
            rng = random.Random(seed)
            fault = rng.choice(faults)
            at_round, delay = rng.randint(1, 8), round(rng.uniform(0, 1.5), 2)
            victim = rng.choice(["h2", "h3"])
            workdir = work / f"run{seed}"
            workdir.mkdir()
            t0 = time.monotonic()
            outcome = run_with_fault(
                ray_bed, workdir, fault, ref, at_round=at_round,
                delay_s=delay, victim=victim, limit_s=args.limit_s, name=f"run{seed}",
            )  # fmt: skip
            row = {"seed": seed, "at_round": at_round, "delay_s": delay, **outcome.summary()}
            row["wall_s"] = round(time.monotonic() - t0, 1)
            outcomes.append(row)
            kinds = sorted({k for k, _ in outcome.failures})
            print(
                f"seed {seed}: {fault} on {outcome.victim} after round {at_round} + {delay} s: "
                f"{outcome.status}, exact={outcome.exact}, restarts={outcome.restarts}, "
                f"failures={kinds}, detect={outcome.detect_s}, training again="
                f"{outcome.recover_s}, orphans={len(outcome.orphans)}, split-brain="
                f"{len(outcome.split_brain)} ({row['wall_s']} s)",
                flush=True,
            )
            if not outcome.exact or outcome.status != "FINISHED":
                print(outcome.output[-1500:], flush=True)
            for line in outcome.orphans + outcome.split_brain:
                print("   ", line, flush=True)
    injected = [o for o in outcomes if o["victim"] is not None]
    exact = sum(o["exact"] for o in outcomes)
    minutes = (time.monotonic() - started) / 60
    print(f"\n{len(outcomes)} runs ({len(injected)} with the fault injected) in {minutes:.1f} min")
    print(f"worker_timeout_s={TIMEOUT_S:g}")
    print(f"bit-exact: {exact}/{len(outcomes)} ({100 * exact / max(1, len(outcomes)):.0f} %)")
    print(f"orphans: {sum(len(o['orphans']) for o in outcomes)}")
    print(f"hangs: {sum(o['status'] == 'HANG' for o in outcomes)}")
    print(f"split-brain writes: {sum(len(o['split_brain']) for o in outcomes)}")
    for fault in faults:
        rows = [o for o in injected if o["fault"] == fault]
        if not rows:
            continue
        restarts = sum(o["restarts"] for o in rows)
        kinds = sorted({k for o in rows for k, _ in o["failures"]})
        print(f"{fault}: {len(rows)} runs, {restarts} restarts, failure kinds {kinds}")
        detect = [o["detect_s"] for o in rows if o["detect_s"] is not None]
        print(f"    detection: {_stats(detect)}")
        decided = [o["decided_s"] for o in rows if o.get("decided_s") is not None]
        print(f"    fault -> decision (the lost group torn down): {_stats(decided)}")
        recover = [o["recover_s"] for o in rows if o["recover_s"] is not None]
        print(f"    fault -> training again: {_stats(recover)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "runs": outcomes}, f, indent=1)
    ok = exact == len(outcomes) and not any(
        o["orphans"] or o["split_brain"] or o["status"] == "HANG" for o in outcomes
    )
    print(f"work directory: {work}" if not ok else "", end="")
    if ok:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
