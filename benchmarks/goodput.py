"""Goodput under a steady rate of failures (issue 19): SIGKILLs and preemption notices.

Goodput = useful step time / wall time, where useful step time = ``N`` (the steps the run must
train) x the step period of an undisturbed run at full world size, and wall time runs from the
first driver start to the end of the last one (automatic resumes included). Steps recomputed =
steps executed - ``N``: work lost in a failure and trained again. A step's execution is one
(group, step) pair of the workers' log (every rank logs each step after its ``optimizer.step()``,
with the group that trained it: driver, restart attempt, elastic generation), so a step counts
once per group that trained it, whichever of its ranks lived to log it.

The undisturbed step period is measured by a calibration run (a plain run of the same workload and
checkpoint cadence, no fault) **right before and right after each mode**, and is its mean period
in steady state: (last step's time - first step's time) / (steps - 1), so the periodic
checkpoints, which an undisturbed run pays as well, count as useful time, not as lost time; the
mode's figure uses the mean of the two calibrations, so a machine whose speed drifts during a
10-minute run does not read as lost (or won) goodput. (Until 2026-11-24 the script calibrated
once, before all modes, with the *median* step period, which left the checkpoints' cost out of the
useful time: every mode, and a run with no fault at all, then lost 5-12 % to the checkpoint
cadence, and a calibration taken on a slower or faster machine than the mode's run read as
+-10-20 % of goodput. The median-based figure is still printed, as ``goodput_median``.)

**Goodput paired in time** (``goodput_local``, added 2026-11-25): the calibrations bracket a
10-minute mode, but this machine's step period moves by 10-30 % within it, so the calibration
figure is uncertain by that much. ``local_useful`` values each useful step at the steady
full-world period of the mode's own run **in the same minute** (the steps of that minute that no
fault touched), so drift cancels; the cost a mode adds to *every* step (an elastic run's
snapshot) is then divided out by ``snapshot_ratio``, undisturbed elastic runs over plain runs,
alternated ABBA right before and right after the mode (``paired_ratio``; a single pair read
anything from 1.03 to 1.13 on this machine). ``goodput_local_equal`` also charges
back what a shrunk group's steps won against full-world steps on this 2-core machine (one worker
with the whole batch is faster here than two sharing the cores; on a cluster with a device per
worker it is the reverse). Mode ``none`` (no fault, ``--modes none``) is the control: every
figure should read ~100 % less start-up and tail.

Every mode also reports its goodput at its own step period: ``N`` x the mean period between
consecutive full-world steps of that very run (``step_s_here``), and splits its wall time into
start-up (first driver start -> first step), useful time, faults (detection, re-forming, steps
lost, slower steps), resumes (a later driver's start -> its first step), exits (``fit()``
returned -> the driver process ended, each driver but the last) and tail (last step -> last driver
exit). An elastic run keeps the global batch (``elastic_batch_policy="resize_batch"``), so a step
trained by fewer workers is a whole step of work: the time it takes beyond a full-world step
counts as lost, not the step.

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
    python benchmarks/goodput.py --duration 120 --modes none,elastic-kill   # with the control

Linux only (``/proc``). Each mode's run directory lives in a temporary directory, removed after
(``--keep DIR``: in ``DIR/<mode>``, with the workers' logs, for a timeline from ``events.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
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
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODES = ("restart-kill", "elastic-kill", "restart-preempt", "elastic-preempt")
STEADY_SKIP = 20  # a run's first steps (allocator, caches) left out of its steady period
CONTROL = "none"  # no fault: the measurement's control (goodput ~100 % less start-up and tail)
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
    exits_s: float
    calibration_s: tuple[float, float]
    goodput_median: float
    goodput_local: float
    goodput_local_equal: float
    snapshot_ratio: float
    shrunk_gain_s: float
    local_periods_s: tuple[float, float]


@dataclass
class Calibration:
    """An undisturbed run's step period (seconds): ``period_s`` the mean in steady state (first
    to last step, checkpoints included), ``median_s`` the median step; ``wall_s`` its wall time
    (start-up included); ``steady_s`` the mean after its first ``STEADY_SKIP`` steps."""

    period_s: float
    median_s: float
    wall_s: float
    steady_s: float = 0.0


def paired_ratio(args: argparse.Namespace, pairs: int = 2) -> float:
    """What an undisturbed elastic run's step costs over a plain run's: runs alternate plain,
    elastic, elastic, plain, ... (``pairs`` of each, ABBA, so a drift of the machine's speed
    hits both alike), each run's ``steady_s`` (mean period after its first
    ``STEADY_SKIP`` steps, snapshots and checkpoints included); the ratio of the two means."""
    plain: list[float] = []
    elastic: list[float] = []
    for i in range(pairs):
        order = (False, True) if i % 2 == 0 else (True, False)
        for is_elastic in order:
            (elastic if is_elastic else plain).append(calibrate(args, is_elastic).steady_s)
    return statistics.fmean(elastic) / statistics.fmean(plain)


# ---------------------------------------------------------------------------- the child driver
def child(spec: dict) -> int:
    """Run (or resume) one run and exit with ``EXIT_FINISHED``/``EXIT_PREEMPTED``/``EXIT_OTHER``.

    As a preemptible job's driver should (docs/fault-tolerance.md, "Resuming fast"), it opens
    ``rt.warm_pool(start=True)`` before it imports torch and the train function's module, so the
    zygote's ``import torch`` overlaps the driver's own (``--no-early-pool``: at ``fit()``), and
    it freezes the garbage collector before it exits (``--slow-exit``: not)."""
    import ringtrain as rt  # no torch yet

    with rt.warm_pool(start=spec.get("early_pool", True)):
        import _goodput_worker

        imported = time.time()
        code = _fit(rt, _goodput_worker.train_fn, spec, imported)
    if not spec.get("slow_exit", False):
        gc.freeze()  # the interpreter's shutdown then skips torch's objects (the docs' advice)
    return code


def _fit(rt: Any, train_fn: Any, spec: dict, imported: float) -> int:
    failure: dict[str, float] = {
        "max_failures": 10_000,
        "snapshot_interval_steps": spec.get("snapshot_interval", 1),
    }
    if "preemption_grace_s" in rt.FailureConfig.__dataclass_fields__:
        failure["preemption_grace_s"] = 30.0
    elastic = spec.get("elastic", spec["mode"].startswith("elastic"))
    result = rt.Trainer(
        train_fn,
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
    exits_s: float


def timeline(
    steps: list[dict],
    wall: tuple[float, float],
    drivers: list[tuple[float, float]],
    fit_ends: list[float],
    useful_steps: int,
) -> Timeline:
    """``steps``: the workers' ``steps.jsonl`` lines (``_read_steps``); ``wall``: (first
    driver start, last exit), Unix seconds; ``drivers``: each driver's (start, exit);
    ``fit_ends``: when each driver's ``fit()`` returned; ``useful_steps``: N.

    ``step_s_here`` is the mean step period at the full world size in this very run (between
    two consecutive steps of one world-2 stretch, checkpoints included), so a machine whose
    load changed since the calibration does not read as lost (or won) goodput."""
    times = sorted(s["time"] for s in steps)
    rank0 = [s for s in steps if s.get("rank", 0) == 0]
    periods = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(rank0)
        if a["world"] == b["world"] == 2 and a["pid"] == b["pid"] and b["step"] == a["step"] + 1
    ]
    step_s = statistics.fmean(periods)
    restarts = 0.0
    for start, _ in drivers[1:]:
        after = [t for t in times if t >= start]
        if after:
            restarts += after[0] - start
    # fit() returned -> the process ended, for each driver a later one waited for (a driver
    # stopped before its fit() returned wrote no line).
    exits = 0.0
    for start, end in drivers[:-1]:
        exits += sum(end - t for t in fit_ends if start <= t <= end)
    startup, tail = times[0] - wall[0], wall[1] - times[-1]
    faults = (wall[1] - wall[0]) - startup - tail - restarts - exits - useful_steps * step_s
    return Timeline(step_s, startup, tail, restarts, faults, exits)


@dataclass
class LocalUseful:
    """``local_useful``'s answer (seconds): ``useful_s`` the useful step time; ``shrunk_gain_s``
    what the steps of a smaller world size saved against the full world's period at the same
    time (negative: they cost more); ``periods_s`` each time bin's steady period."""

    useful_s: float
    shrunk_gain_s: float
    periods_s: list[float]


def local_useful(
    steps: list[dict], useful_steps: int, world: int = 2, bin_s: float = 60.0, warmup: int = 20
) -> LocalUseful:
    """Useful step time measured against the run's own undisturbed steps *at the same time*, so
    that a machine whose speed drifts over minutes is paired with itself.

    The run's steady steps: the periods between consecutive rank-0 steps of one process at the
    full world size ``world`` (same pid and world, step + 1), less the first ``warmup`` steps
    after each start, re-form or grow (a group's first steps are slower: allocator, caches;
    those costs are the fault's, so they stay lost time). They are binned by time (``bin_s``
    seconds from the first step); a bin's period is their mean, so the periodic checkpoints
    inside it count as useful, as in an undisturbed run. Each useful step ``s`` in
    ``1..useful_steps`` is then worth the period of the bin holding its **last** execution (the
    one that stayed; earlier executions are recomputation, lost); a bin without steady steps
    (all of it spent in a fault or at a smaller world size) borrows its nearest bin's period.

    A smaller group's steps (an elastic run shrunk after a fault) are worth the full world's
    period like any other; ``shrunk_gain_s`` says how much faster (or slower) they ran, since
    on this 2-core machine one worker training the whole global batch beats two sharing the
    cores (25 vs 35 ms a step), which a cluster with a device per worker would not see.

    Limits: a slowdown that lasts for minutes and is caused by the mode itself (e.g. an elastic
    run's per-step snapshot) counts as useful here; ``run_mode`` divides it out with a paired
    ratio (``Calibration``, elastic modes) and reports the calibration-based figure beside it.

    Raises ``ValueError`` if the log holds no steady step or misses a useful step."""
    rank0 = [s for s in steps if s.get("rank", 0) == 0]
    if not rank0:
        raise ValueError("no step of rank 0 in the log")
    t0 = min(s["time"] for s in steps)
    sums: dict[int, float] = {}
    counts: dict[int, int] = {}
    run = 0
    for a, b in itertools.pairwise(rank0):
        steady = a["world"] == b["world"] == world and a["pid"] == b["pid"]
        if not (steady and b["step"] == a["step"] + 1):
            run = 0
            continue
        run += 1
        if run <= warmup:
            continue
        k = int((b["time"] - t0) // bin_s)
        sums[k] = sums.get(k, 0.0) + (b["time"] - a["time"])
        counts[k] = counts.get(k, 0) + 1
    if not counts:
        raise ValueError(f"no steady step at world size {world} in the log")
    period = {k: sums[k] / counts[k] for k in counts}
    last: dict[int, float] = {}
    for s in steps:
        if s["time"] > last.get(s["step"], -1.0):
            last[s["step"]] = s["time"]
    missing = [s for s in range(1, useful_steps + 1) if s not in last]
    if missing:
        raise ValueError(f"{len(missing)} useful steps never logged (first: {missing[0]})")
    known = sorted(period)

    def at(t: float) -> float:
        k = int((t - t0) // bin_s)
        return period[k] if k in period else period[min(known, key=lambda j: (abs(j - k), j))]

    useful = sum(at(last[s]) for s in range(1, useful_steps + 1))
    # Time a smaller group won (or lost) against a full one, step for step, inside a stretch.
    shrunk = sum(
        at(b["time"]) - (b["time"] - a["time"])
        for a, b in itertools.pairwise(rank0)
        if a["pid"] == b["pid"] and a["world"] == b["world"] < world and b["step"] == a["step"] + 1
    )
    return LocalUseful(useful, shrunk, [period[k] for k in known])


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
            if self.kind == "none":
                continue
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


def _status_lines(log: str) -> list[dict]:
    """The lines the drivers wrote to ``status.jsonl`` (one each time ``fit()`` returned:
    ``status``, ``imported``, ``fit_end``), in order."""
    with contextlib.suppress(OSError), open(os.path.join(log, "status.jsonl")) as f:
        return [json.loads(line) for line in f]
    return []


def _statuses(log: str) -> list[str]:
    """The statuses the drivers wrote."""
    return [line["status"] for line in _status_lines(log)]


def _fit_ends(log: str) -> list[float]:
    """When each driver's ``fit()`` returned (Unix seconds), in order."""
    return [line["fit_end"] for line in _status_lines(log)]


def _start(spec: dict) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(spec["config"]["log"], "driver.err"), "ab"),
    )


def run_mode(
    mode: str, steps: int, before: Calibration, args: argparse.Namespace
) -> tuple[ModeResult, Calibration]:
    """Run ``mode`` to ``steps`` steps under its fault injector; resume after each preemption;
    then calibrate again (``before``: the calibration run just before this mode; the one after
    is returned, the next mode's ``before``)."""
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
            "early_pool": not args.no_early_pool,
            "slow_exit": args.slow_exit,
            "storage": os.path.join(tmp, "runs"),
            "config": {"steps": steps, "every": args.every, "batch": 64, "log": log},
        }
        kind = {
            "restart-kill": "kill",
            "elastic-kill": "kill",
            "restart-preempt": "preempt-driver",
            "elastic-preempt": "preempt-worker",
            CONTROL: "none",
        }[mode]
        every = args.kill_every if kind == "kill" else args.preempt_every
        elastic = mode.startswith("elastic")
        # An elastic mode's step carries its snapshot: its cost over a plain step is measured
        # right before and right after the mode (undisturbed runs, ABBA).
        ratio_before = paired_ratio(args) if elastic else 1.0
        injector = Injector(kind, every, log, args.seed)
        start, first = time.monotonic(), time.time()
        injector.start()
        starts, code = 0, EXIT_PREEMPTED
        drivers: list[tuple[float, float]] = []
        while code == EXIT_PREEMPTED and starts < args.max_starts:
            started = time.time()
            written = len(_statuses(log))
            proc = _start(spec)
            injector.driver_pid = proc.pid
            starts += 1
            code = proc.wait()
            drivers.append((started, time.time()))
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
        lines = _read_steps(os.path.join(log, "steps.jsonl"))  # read once, used thrice
        executed = executed_steps(lines)
        statuses = _statuses(log)
        if code != EXIT_FINISHED:
            with open(os.path.join(log, "driver.err"), errors="replace") as f:
                sys.stderr.write(f.read()[-4000:])
            raise SystemExit(f"{mode}: the run did not finish (exit {code}, statuses {statuses})")
        where = timeline(lines, (first, last), drivers, _fit_ends(log), steps)
        local = local_useful(lines, steps)
    ratio = (ratio_before + paired_ratio(args)) / 2 if elastic else 1.0
    after = calibrate(args)
    useful = steps * (before.period_s + after.period_s) / 2
    useful_median = steps * (before.median_s + after.median_s) / 2
    result = ModeResult(
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
        exits_s=round(where.exits_s, 2),
        calibration_s=(round(before.period_s, 5), round(after.period_s, 5)),
        goodput_median=round(useful_median / wall, 4),
        goodput_local=round(local.useful_s / ratio / wall, 4),
        goodput_local_equal=round(local.useful_s / ratio / (wall + local.shrunk_gain_s), 4),
        snapshot_ratio=round(ratio, 4),
        shrunk_gain_s=round(local.shrunk_gain_s, 2),
        local_periods_s=(round(min(local.periods_s), 5), round(max(local.periods_s), 5)),
    )
    return result, after


def calibrate(args: argparse.Namespace, elastic: bool = False) -> Calibration:
    """An undisturbed run of ``--calibration-steps`` (same workload and checkpoint cadence);
    ``elastic``: as the elastic modes run it (``num_workers=(1, 2)``, a snapshot every
    ``--snapshot-interval`` steps), at world size 2 throughout."""
    with tempfile.TemporaryDirectory(prefix="rt_goodput_cal_") as tmp:
        log = os.path.join(tmp, "log")
        os.mkdir(log)
        spec = {
            "mode": "calibration",
            "elastic": elastic,
            "snapshot_interval": args.snapshot_interval,
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
        skip = min(STEADY_SKIP, len(times) - 2)
        return Calibration(
            period_s=(times[-1] - times[0]) / (len(times) - 1),
            median_s=statistics.median(periods),
            wall_s=wall,
            steady_s=(times[-1] - times[skip]) / (len(times) - 1 - skip),
        )


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
    parser.add_argument(
        "--no-early-pool",
        action="store_true",
        help="start each driver's warm pool at fit() instead of before its imports",
    )
    parser.add_argument(
        "--slow-exit",
        action="store_true",
        help="let each driver's interpreter collect torch's objects at exit (no gc.freeze())",
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
    unknown = sorted(set(modes) - {*MODES, CONTROL})
    if unknown:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join((*MODES, CONTROL))}")
    first = calibrate(args)
    steps = max(1, int(args.duration / first.period_s))
    print(
        f"calibration: mean step period {first.period_s * 1000:.1f} ms at 2 workers "
        f"(median {first.median_s * 1000:.1f} ms), {args.calibration_steps} steps in "
        f"{first.wall_s:.1f} s (start-up included); N = {steps} steps "
        f"(~{args.duration:.0f} s of useful work)",
        flush=True,
    )
    results = []
    before = first
    for mode in modes:
        r, before = run_mode(mode, steps, before, args)
        results.append(r)
        cal = " / ".join(f"{c * 1000:.1f}" for c in r.calibration_s)
        print(
            f"{r.mode:16s} goodput {r.goodput * 100:5.1f} %  wall {r.wall_s:7.1f} s  "
            f"useful {r.useful_s:7.1f} s  injected {r.injected:3d}  "
            f"recomputed {r.recomputed:5d} steps  driver starts {r.driver_starts}",
            flush=True,
        )
        print(
            f"{'':16s} calibration before / after: {cal} ms a step; goodput against the median "
            f"step {r.goodput_median * 100:5.1f} %",
            flush=True,
        )
        print(
            f"{'':16s} goodput at this run's own step period ({r.step_s_here * 1000:.1f} ms) "
            f"{r.goodput_here * 100:5.1f} %; wall = start-up {r.startup_s:.1f} s + useful "
            f"{r.steps * r.step_s_here:.1f} s + faults {r.faults_s:.1f} s + resumes "
            f"{r.restarts_s:.1f} s + exits {r.exits_s:.1f} s + tail {r.tail_s:.1f} s",
            flush=True,
        )
        lo, hi = (p * 1000 for p in r.local_periods_s)
        print(
            f"{'':16s} goodput paired in time {r.goodput_local * 100:5.1f} % (each step at its "
            f"minute's steady period, {lo:.1f}-{hi:.1f} ms; / snapshot ratio "
            f"{r.snapshot_ratio:.3f}); at equal step cost for a smaller world "
            f"{r.goodput_local_equal * 100:5.1f} % (it won {r.shrunk_gain_s:.1f} s)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "calibration": asdict(first),
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
