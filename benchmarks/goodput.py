"""Goodput under a steady rate of failures (issue 19): SIGKILLs and preemption notices.

Goodput = useful step time / wall time, where useful step time = ``N`` (the steps the run must
train) x the median step period of an undisturbed run at full world size, and wall time runs from
the first driver start to the end of the last one (automatic resumes included). Steps recomputed =
steps executed - ``N``: work lost in a failure and trained again. A step's execution is one
(group, step) pair of the workers' log (every rank logs each step after its ``optimizer.step()``,
with the group that trained it: driver, restart attempt, elastic generation), so a step counts
once per group that trained it, whichever of its ranks lived to log it.

The machine's load can change between the calibration and a mode's run (other jobs on a shared
machine), which would read as lost or won goodput. So every mode also reports its goodput at its
own step period: ``N`` x the median period between consecutive full-world steps of that very run
(``step_s_here``), and splits its wall time into start-up (first driver start -> first step),
useful time, faults (detection, re-forming, steps lost, slower steps), resumes (a later driver's
start -> its first step) and tail (last step -> last driver exit). An elastic run keeps the global
batch (``elastic_batch_policy="resize_batch"``), so a step trained by fewer workers is a whole
step of work: the time it takes beyond a full-world step counts as lost, not the step.

Workload: ``_goodput_worker.train_fn`` (an MLP 784-1024-1024-10, 1.86 M parameters, momentum SGD,
DDP on gloo, batch 64 per worker), 2 local workers, a ``TrainState`` checkpoint every ``--every``
steps written asynchronously. ``N`` is calibrated so an undisturbed run trains for about
``--duration`` seconds.

Modes (each a fresh driver process, ``python benchmarks/goodput.py --child``, as a scheduler would
start it):

- ``restart-kill``: every ``--kill-every`` s a random rank (seeded: ``--seed``) is SIGKILLed; the
  run restarts its worker group from the last checkpoint (``FailureConfig(max_failures=...)``).
- ``elastic-kill``: the same with ``ScalingConfig(num_workers=(1, 2))``: the survivor continues in
  place from its in-memory snapshot and the group grows back when capacity returns. A snapshot is
  taken every ``--snapshot-interval`` steps (default 1: a kill redoes at most the step in flight;
  each snapshot copies the model and optimizer state, ~4 ms of a ~26 ms step here:
  ``benchmarks/elastic_overhead.py``).
- ``restart-preempt``: every ``--preempt-every`` s the driver receives SIGTERM (a scheduler's
  preemption notice); the run stops at an agreed step with a checkpoint (``PREEMPTED``) and the
  benchmark starts the driver again at once, which resumes the run by its name.
- ``elastic-preempt``: every ``--preempt-every`` s one random worker receives SIGTERM (its node is
  going away); the elastic run shrinks in place at an agreed step and grows back.

Usage::

    python benchmarks/goodput.py                              # 4 modes x 600 s
    python benchmarks/goodput.py --duration 120 --modes restart-kill,elastic-kill
    python benchmarks/goodput.py --json /tmp/goodput.json
    python benchmarks/goodput.py --duration 90 --modes elastic-kill --keep /tmp/gp   # keep logs

Linux only (``/proc``). Each mode's run directory lives in a temporary directory, removed after
(``--keep DIR``: in ``DIR/<mode>``, with the workers' logs, for a timeline from ``events.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODES = ("restart-kill", "elastic-kill", "restart-preempt", "elastic-preempt")
EXIT_FINISHED, EXIT_PREEMPTED, EXIT_OTHER = 0, 3, 1


@dataclass
class ModeResult:
    """One mode's figures (seconds, steps)."""

    mode: str
    steps: int
    wall_s: float
    useful_s: float
    goodput: float
    executed: int
    recomputed: int
    injected: int
    driver_starts: int
    statuses: list[str]
    step_s_here: float
    goodput_here: float
    startup_s: float
    tail_s: float
    restarts_s: float
    faults_s: float


# ---------------------------------------------------------------------------- the child driver
def child(spec: dict) -> int:
    """Run (or resume) one run and exit with ``EXIT_FINISHED``/``EXIT_PREEMPTED``/``EXIT_OTHER``."""
    import _goodput_worker

    import ringtrain as rt

    imported = time.time()
    failure: dict[str, float] = {
        "max_failures": 10_000,
        "snapshot_interval_steps": spec.get("snapshot_interval", 1),
    }
    if "preemption_grace_s" in rt.FailureConfig.__dataclass_fields__:
        failure["preemption_grace_s"] = 30.0
    elastic = spec["mode"].startswith("elastic")
    result = rt.Trainer(
        _goodput_worker.train_fn,
        rt.ScalingConfig(
            num_workers=(1, 2) if elastic else 2,
            resources_per_worker={"CPU": 1},
            **({"elastic_grow_after_s": 2.0} if elastic else {}),
        ),
        rt.RunConfig(
            name=spec["mode"],
            storage_path=spec["storage"],
            failure_config=rt.FailureConfig(**failure),
            checkpoint_config=rt.CheckpointConfig(num_to_keep=2, async_save=True),
            progress="off",
        ),
        train_loop_config=spec["config"],
    ).fit()
    status = getattr(result, "status", "FINISHED" if result.error is None else "ERRORED")
    with open(os.path.join(spec["config"]["log"], "status.jsonl"), "a") as f:
        # imported: after Python, torch and ringtrain loaded; fit_end: fit() returned (Unix s).
        f.write(json.dumps({"status": status, "imported": imported, "fit_end": time.time()}))
        f.write("\n")
    if status == "FINISHED":
        return EXIT_FINISHED
    return EXIT_PREEMPTED if status == "PREEMPTED" else EXIT_OTHER


# ---------------------------------------------------------------------------- the parent
@dataclass
class Timeline:
    """Where one mode's wall time went (seconds): ``startup_s`` from the first driver start to
    the first completed step; ``tail_s`` from the last completed step to the last driver's exit;
    ``restarts_s`` from each later driver's start to its first step (preempt modes); the rest,
    less the useful time, is ``faults_s`` (detection, re-forming, steps lost or slower)."""

    step_s_here: float
    startup_s: float
    tail_s: float
    restarts_s: float
    faults_s: float


def timeline(
    steps_log: str, wall: tuple[float, float], drivers: list[float], useful_steps: int
) -> Timeline:
    """``steps_log``: the workers' ``steps.jsonl``; ``wall``: (first driver start, last exit),
    Unix seconds; ``drivers``: each driver's start; ``useful_steps``: N.

    ``step_s_here`` is the median step period at the full world size in this very run (between
    two consecutive steps of one world-2 stretch), so a machine whose load changed since the
    calibration does not read as lost (or won) goodput."""
    steps = _read_steps(steps_log)
    times = sorted(s["time"] for s in steps)
    rank0 = [s for s in steps if s.get("rank", 0) == 0]
    periods = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(rank0)
        if a["world"] == b["world"] == 2 and a["pid"] == b["pid"] and b["step"] == a["step"] + 1
    ]
    step_s = statistics.median(periods)
    restarts = 0.0
    for start in drivers[1:]:
        after = [t for t in times if t >= start]
        if after:
            restarts += after[0] - start
    startup, tail = times[0] - wall[0], wall[1] - times[-1]
    faults = (wall[1] - wall[0]) - startup - tail - restarts - useful_steps * step_s
    return Timeline(step_s, startup, tail, restarts, faults)


def _read_steps(steps_log: str) -> list[dict]:
    """The workers' step lines (``_goodput_worker``), in the order written."""
    with open(steps_log) as f:
        return [json.loads(line) for line in f]


def executed_steps(steps: list[dict]) -> int:
    """Step executions: distinct (group, step) pairs (a line without ``group``, from an older
    worker, counts as its own execution)."""
    seen = set()
    for i, s in enumerate(steps):
        group = tuple(s["group"]) if "group" in s else ("line", i)
        seen.add((group, s["step"]))
    return len(seen)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _rank_pids(log: str) -> list[int]:
    pids = []
    for name in sorted(os.listdir(log)):
        if name.startswith("rank") and name.endswith(".pid"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(log, name)) as f:
                pids.append(int(f.read()))
    return [p for p in pids if _alive(p)]


class Injector(threading.Thread):
    """Every ``every_s`` seconds: SIGKILL a random live rank (``kill``), SIGTERM the driver
    (``preempt-driver``) or SIGTERM a random live rank (``preempt-worker``)."""

    def __init__(self, kind: str, every_s: float, log: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.kind, self.every_s, self.log = kind, every_s, log
        self.rng = random.Random(seed)
        self.driver_pid: int | None = None
        self.injected = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            if self.kind == "preempt-driver":
                if self.driver_pid is not None and _alive(self.driver_pid):
                    os.kill(self.driver_pid, signal.SIGTERM)
                    self.injected += 1
                continue
            pids = _rank_pids(self.log)
            if not pids:
                continue
            victim = self.rng.choice(pids)
            sig = signal.SIGKILL if self.kind == "kill" else signal.SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, sig)
                self.injected += 1


def _statuses(log: str) -> list[str]:
    """The statuses the drivers wrote (one line each time fit() returned)."""
    with contextlib.suppress(OSError), open(os.path.join(log, "status.jsonl")) as f:
        return [json.loads(line)["status"] for line in f]
    return []


def _start(spec: dict) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(spec["config"]["log"], "driver.err"), "ab"),
    )


def run_mode(mode: str, steps: int, step_s: float, args: argparse.Namespace) -> ModeResult:
    """Run ``mode`` to ``steps`` steps under its fault injector; resume after each preemption."""
    with contextlib.ExitStack() as stack:
        if args.keep:
            tmp = os.path.join(args.keep, mode)
            os.makedirs(tmp)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="rt_goodput_"))
        log = os.path.join(tmp, "log")
        os.mkdir(log)
        spec = {
            "mode": mode,
            "snapshot_interval": args.snapshot_interval,
            "storage": os.path.join(tmp, "runs"),
            "config": {"steps": steps, "every": args.every, "batch": 64, "log": log},
        }
        kind = {
            "restart-kill": "kill",
            "elastic-kill": "kill",
            "restart-preempt": "preempt-driver",
            "elastic-preempt": "preempt-worker",
        }[mode]
        every = args.kill_every if kind == "kill" else args.preempt_every
        injector = Injector(kind, every, log, args.seed)
        start, first = time.monotonic(), time.time()
        injector.start()
        starts, code = 0, EXIT_PREEMPTED
        drivers: list[float] = []
        while code == EXIT_PREEMPTED and starts < args.max_starts:
            drivers.append(time.time())
            written = len(_statuses(log))
            proc = _start(spec)
            injector.driver_pid = proc.pid
            starts += 1
            code = proc.wait()
            if code == -signal.SIGTERM:
                # The notice reached the driver before fit() installed its handler (during
                # Python's start-up) or after fit() returned: nothing to save, the scheduler
                # requeues the job all the same, unless fit() had finished the run (its status
                # line is written): then the job is done.
                code = EXIT_FINISHED if _statuses(log)[written:] == ["FINISHED"] else EXIT_PREEMPTED
        wall = time.monotonic() - start
        last = time.time()
        injector.done.set()
        injector.join()
        executed = executed_steps(_read_steps(os.path.join(log, "steps.jsonl")))
        statuses = _statuses(log)
        if code != EXIT_FINISHED:
            with open(os.path.join(log, "driver.err"), errors="replace") as f:
                sys.stderr.write(f.read()[-4000:])
            raise SystemExit(f"{mode}: the run did not finish (exit {code}, statuses {statuses})")
        useful = steps * step_s
        where = timeline(os.path.join(log, "steps.jsonl"), (first, last), drivers, steps)
        return ModeResult(
            mode=mode,
            steps=steps,
            wall_s=round(wall, 2),
            useful_s=round(useful, 2),
            goodput=round(useful / wall, 4),
            executed=executed,
            recomputed=executed - steps,
            injected=injector.injected,
            driver_starts=starts,
            statuses=statuses,
            step_s_here=round(where.step_s_here, 5),
            goodput_here=round(steps * where.step_s_here / wall, 4),
            startup_s=round(where.startup_s, 2),
            tail_s=round(where.tail_s, 2),
            restarts_s=round(where.restarts_s, 2),
            faults_s=round(where.faults_s, 2),
        )


def calibrate(args: argparse.Namespace) -> tuple[float, float]:
    """An undisturbed run of ``--calibration-steps``: (median step period s, wall s)."""
    with tempfile.TemporaryDirectory(prefix="rt_goodput_cal_") as tmp:
        log = os.path.join(tmp, "log")
        os.mkdir(log)
        spec = {
            "mode": "calibration",
            "storage": os.path.join(tmp, "runs"),
            "config": {
                "steps": args.calibration_steps,
                "every": args.every,
                "batch": 64,
                "log": log,
            },
        }
        start = time.monotonic()
        if _start(spec).wait() != EXIT_FINISHED:
            raise SystemExit("the calibration run failed")
        wall = time.monotonic() - start
        steps = _read_steps(os.path.join(log, "steps.jsonl"))
        times = [s["time"] for s in steps if s["rank"] == 0]
        periods = [b - a for a, b in itertools.pairwise(times)]
        return statistics.median(periods), wall


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of useful work")
    parser.add_argument("--kill-every", type=float, default=30.0)
    parser.add_argument("--preempt-every", type=float, default=60.0)
    parser.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--snapshot-interval",
        type=int,
        default=1,
        help="FailureConfig.snapshot_interval_steps of the elastic modes (a kill redoes up to "
        "this many steps; each snapshot copies the model and optimizer state)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--calibration-steps", type=int, default=300)
    parser.add_argument("--max-starts", type=int, default=100, help="driver starts per mode")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument(
        "--keep", help="keep each mode's run directory and logs in KEEP/<mode> (a new folder)"
    )
    args = parser.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    step_s, cal_wall = calibrate(args)
    steps = max(1, int(args.duration / step_s))
    print(
        f"calibration: median step period {step_s * 1000:.1f} ms at 2 workers, "
        f"{args.calibration_steps} steps in {cal_wall:.1f} s (start-up included); "
        f"N = {steps} steps (~{args.duration:.0f} s of useful work)",
        flush=True,
    )
    results = []
    for mode in modes:
        r = run_mode(mode, steps, step_s, args)
        results.append(r)
        print(
            f"{r.mode:16s} goodput {r.goodput * 100:5.1f} %  wall {r.wall_s:7.1f} s  "
            f"useful {r.useful_s:7.1f} s  injected {r.injected:3d}  "
            f"recomputed {r.recomputed:5d} steps  driver starts {r.driver_starts}",
            flush=True,
        )
        print(
            f"{'':16s} goodput at this run's own step period ({r.step_s_here * 1000:.1f} ms) "
            f"{r.goodput_here * 100:5.1f} %; wall = start-up {r.startup_s:.1f} s + useful "
            f"{r.steps * r.step_s_here:.1f} s + faults {r.faults_s:.1f} s + resumes "
            f"{r.restarts_s:.1f} s + tail {r.tail_s:.1f} s",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "step_s": step_s,
                    "calibration_wall_s": cal_wall,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
