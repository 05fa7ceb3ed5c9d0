"""Hot spares (issue 42): time from a worker's SIGKILL to the group's next completed step at full
size, with ``ScalingConfig(num_workers=W, spares=1)``; and the goodput of a run that loses a
random worker every ``--kill-every`` seconds, against a paired no-failure calibration.

The train function is ``_goodput_worker.train_fn`` (the 1.86 M-parameter MLP 784-1024-1024-10,
DDP, momentum SGD, a TrainState checkpointed every ``--every`` steps); every rank logs each
completed step with its time, rank and group (driver pid, attempt, elastic generation), and
writes its pid to ``rank{R}.pid`` when it enters the train function.

- ``recovery``: one run at W workers and one spare, ``FailureConfig(snapshot_interval_steps=1)``.
  An injector thread in the driver SIGKILLs a random member (read from its pid file) once the
  group trains at full size, a spare is ready and ``--gap-s`` seconds passed since the last
  hand-over resumed; ``--kills`` times. Recovery of one kill = (the time the last rank of the
  new generation completed its first step) - (the ``time.time()`` just before ``os.kill``). The
  ``resize`` event's ``resume_s`` (the driver's own figure, from the death it observed) is
  printed beside it.
- ``goodput`` (``--goodput-s``): a calibration run without failures (``--calibration-steps``),
  a run of ``--goodput-s`` seconds of useful work with a kill every ``--kill-every`` s, then the
  calibration again. Calibrated step period ``p``: the median of the two calibrations' median
  step periods (rank 0's steps after the first 10). Goodput = useful steps x ``p`` / wall time
  (first step start to last step end: the driver's and workers' start-up is left out; useful
  steps: the run's final step count). Also printed: the same with the failure run's own median
  step period (``goodput_own_period``), which cancels the machine's drift between the runs but
  not a steady-state cost of the spare.

Usage::

    python benchmarks/spares.py recovery --workers 3 --kills 10
    python benchmarks/spares.py goodput --workers 3 --goodput-s 180 --kill-every 30
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringtrain as rt


def _read_jsonl(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue  # a line still being written
    except FileNotFoundError:
        pass
    return out


class Injector(threading.Thread):
    """SIGKILLs a random member when a spare is ready and the last hand-over resumed."""

    def __init__(
        self, run_dir: str, log: str, workers: int, kills: int, gap_s: float, seed: int
    ) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.log, self.workers = run_dir, log, workers
        self.kills, self.gap_s = kills, gap_s
        self.rng = random.Random(seed)
        self.done: list[tuple[float, int]] = []  # (kill time, rank)
        self.stop = threading.Event()

    def _ready(self) -> bool:
        events = _read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
        spares = [e for e in events if e.get("type") == "spare"]
        ready = {e["spare"] for e in spares if e["action"] == "ready"}
        used = {e["spare"] for e in spares if e["action"] in ("promoted", "lost")}
        resumed = [e for e in events if e.get("type") == "resize"]
        trained = os.path.exists(os.path.join(self.log, "steps.jsonl"))
        return bool(ready - used) and len(resumed) == len(self.done) and trained

    def run(self) -> None:
        last = time.time()
        while len(self.done) < self.kills and not self.stop.wait(0.05):
            if time.time() - last < self.gap_s or not self._ready():
                continue
            rank = self.rng.randrange(self.workers)
            with open(os.path.join(self.log, f"rank{rank}.pid")) as f:
                pid = int(f.read())
            at = time.time()
            os.kill(pid, signal.SIGKILL)
            self.done.append((at, rank))
            last = at
            while not self.stop.is_set():  # the next gap counts from the hand-over's resume
                events = _read_jsonl(os.path.join(self.run_dir, "events.jsonl"))
                if len([e for e in events if e.get("type") == "resize"]) == len(self.done):
                    last = time.time()
                    break
                time.sleep(0.05)


def _fit(tmp: str, name: str, workers: int, spares: int, steps: int, every: int) -> rt.Result:
    import _goodput_worker

    log = os.path.join(tmp, name)
    os.makedirs(log)
    return rt.Trainer(
        _goodput_worker.train_fn,
        rt.ScalingConfig(num_workers=workers, spares=spares, resources_per_worker={"CPU": 1}),
        rt.RunConfig(
            name=name,
            storage_path=os.path.join(tmp, "runs"),
            failure_config=rt.FailureConfig(max_failures=-1, snapshot_interval_steps=1),
            progress="off",
        ),
        train_loop_config={"batch": 32, "steps": steps, "every": every, "log": log},
    )


def _recoveries(log: str, kills: list[tuple[float, int]], workers: int) -> list[float]:
    """Per kill: the last rank's first completed step in the next generation - the kill."""
    steps = _read_jsonl(os.path.join(log, "steps.jsonl"))
    firsts: dict[tuple, dict[int, float]] = defaultdict(dict)
    for s in steps:
        key = tuple(s["group"])
        firsts[key].setdefault(s["rank"], s["time"])
    out = []
    for at, _rank in kills:
        later = [
            max(ranks.values())
            for ranks in firsts.values()
            if len(ranks) == workers and min(ranks.values()) > at
        ]
        out.append(min(later) - at if later else float("nan"))
    return out


def recovery(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="rt_spares_bench_") as tmp:
        name = "recovery"
        trainer = _fit(tmp, name, args.workers, 1, args.steps, args.every)
        log = os.path.join(tmp, name)
        injector = Injector(
            os.path.join(tmp, "runs", name), log, args.workers, args.kills, args.gap_s, args.seed
        )
        injector.start()
        result = trainer.fit()
        injector.stop.set()
        injector.join()
        if len(injector.done) < args.kills:
            print(f"only {len(injector.done)} kills before the run ended: raise --steps")
        events = _read_jsonl(os.path.join(result.path, "events.jsonl"))
        resizes = [e for e in events if e.get("type") == "resize"]
        fallbacks = [e for e in events if e.get("type") == "resize_fallback"]
        measured = _recoveries(log, injector.done, args.workers)
        period = _period(log)
    figures = {
        "workers": args.workers,
        "kills": len(injector.done),
        "recovery_s": [round(x, 3) for x in measured],
        "recovery_median_s": round(statistics.median(measured), 3) if measured else None,
        "recovery_max_s": round(max(measured), 3) if measured else None,
        "step_period_s": round(period, 4),
        "resume_s": [e.get("resume_s") for e in resizes],
        "spare_resizes": sum(1 for e in resizes if e.get("spare_ranks")),
        "fallbacks": len(fallbacks),
        "error": result.error and str(result.error),
    }
    return figures


def _period(log: str) -> float:
    steps = sorted(
        (s for s in _read_jsonl(os.path.join(log, "steps.jsonl")) if s["rank"] == 0),
        key=lambda s: s["step"],
    )[10:]
    return statistics.median(b["time"] - a["time"] for a, b in itertools.pairwise(steps))


def goodput(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="rt_spares_goodput_") as tmp:
        periods = []
        _fit(tmp, "cal0", args.workers, 0, args.calibration_steps, args.every).fit()
        periods.append(_period(os.path.join(tmp, "cal0")))
        steps = int(args.goodput_s / periods[0])
        name = "kills"
        trainer = _fit(tmp, name, args.workers, 1, steps, args.every)
        log = os.path.join(tmp, name)
        kills = 10**6  # until the run ends
        injector = Injector(
            os.path.join(tmp, "runs", name), log, args.workers, kills, args.kill_every, args.seed
        )
        injector.start()
        result = trainer.fit()
        injector.stop.set()
        injector.join()
        done = _read_jsonl(os.path.join(log, "steps.jsonl"))
        own = _period(log)
        recoveries = _recoveries(log, injector.done, args.workers)
        _fit(tmp, "cal1", args.workers, 0, args.calibration_steps, args.every).fit()
        periods.append(_period(os.path.join(tmp, "cal1")))
    period = statistics.median(periods)
    first = min(s["time"] for s in done) - period  # the first step's start
    wall = max(s["time"] for s in done) - first
    useful = max(s["step"] for s in done)
    executions = len({(tuple(s["group"]), s["step"]) for s in done})
    return {
        "workers": args.workers,
        "kills": len(injector.done),
        "useful_steps": useful,
        "steps_recomputed": executions - useful,
        "calibrated_period_s": [round(p, 4) for p in periods],
        "own_period_s": round(own, 4),
        "wall_s": round(wall, 1),
        "goodput": round(useful * period / wall, 4),
        "goodput_own_period": round(useful * own / wall, 4),
        "recovery_s": [round(x, 3) for x in recoveries],
        "error": result.error and str(result.error),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("recovery", "goodput"))
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--gap-s", type=float, default=3.0, help="seconds between kills")
    parser.add_argument("--steps", type=int, default=1500, help="recovery: the run's steps")
    parser.add_argument("--every", type=int, default=50, help="checkpoint every N steps")
    parser.add_argument("--goodput-s", type=float, default=180.0)
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--calibration-steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    figures = recovery(args) if args.what == "recovery" else goodput(args)
    print(json.dumps(figures, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
