"""ringtrain's overhead against hand-written DDP launched by torchrun.

The same workload (``_workload.py``: an MLP 784 -> 1024 -> 1024 -> 10 of 1,863,690 parameters,
one synthetic batch of 64 per worker, SGD with momentum, DDP on gloo, one torch thread per worker)
runs as 2 workers in two ways, each started as a fresh command:

* ``torchrun``: ``OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 _ddp_worker.py``, a
  hand-written ``init_process_group("gloo")`` + ``DistributedDataParallel`` loop;
* ``ringtrain``: ``python _ringtrain_driver.py``, the same loop as a train function run by
  ``rt.Trainer(..., ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
  RunConfig(progress="off", storage_path=<temp dir>)).fit()`` with ``rt.prepare_model`` and an
  ``rt.report()`` every 50 steps and after the last step (no checkpoints).

For each run the benchmark takes ``t0 = time.time()`` right before starting the command. Rank 0
records the wall-clock time its first training step completed and the duration of every step
(``time.perf_counter`` around zero_grad + forward + backward + optimizer step).

* time to first step = first_step_wall - t0
* median step time = median of the step durations of steps 10.. (the first 10 are warm-up)

Runs are interleaved (torchrun, ringtrain, torchrun, ringtrain, ...) after one untimed warm-up run
of each; the summary is the median over the repetitions. Targets: median step time ratio
ringtrain/torchrun <= 1.02, and time to first step at most 1.0 s above torchrun's.

Usage::

    python benchmarks/overhead.py                      # full: 200 steps, 5 repetitions
    python benchmarks/overhead.py --steps 30 --repeats 1   # smoke run
    python benchmarks/overhead.py --json overhead.json

Noise: on a small shared machine other processes distort the timings. Before each run the benchmark
waits (up to ``--max-wait`` s) until the machine is less busy than ``--quiet-threshold``; during the
run it measures the CPU time the rest of the machine used (``/proc/stat`` minus the command's own
CPU time). A run during which other processes used more than ``--noise-limit`` of all CPUs is run
again (up to ``--retries`` times); one still noisy is kept but left out of the medians when its
variant has clean runs.

Every run lives in its own temporary directory (timings, log, ringtrain's run directory, torchrun's
``torchelastic_*`` log directory via ``TMPDIR``), removed after the run. Every process a run starts
carries a unique environment tag; after the command exits the benchmark looks for tagged processes
still alive (Linux ``/proc``), kills them and reports them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VARIANTS = ("torchrun", "ringtrain")
WARMUP_STEPS = 10  # steps 0..9 of each run are excluded from the median step time
TAG_VAR = "RINGTRAIN_BENCH_TAG"
STEP_RATIO_TARGET = 1.02
FIRST_STEP_DIFF_TARGET_S = 1.0

# Start-up phases, from the rank-0 time stamps (seconds after t0 of each boundary).
PHASES = (
    ("launch", "t0 -> rank 0 process created"),
    ("to_pg", "-> process group initialised"),
    ("setup", "-> model (DDP) + data ready"),
    ("first_step", "-> first step done"),
)


# ----------------------------------------------------------------------------- commands


def torchrun_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "torch.distributed.run"]


def command(variant: str, steps: int, out: str, storage: str) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if variant == "torchrun":
        env["OMP_NUM_THREADS"] = "1"
        cmd = [
            *torchrun_cmd(),
            "--standalone",
            "--nproc-per-node",
            "2",
            str(HERE / "_ddp_worker.py"),
            "--steps",
            str(steps),
            "--out",
            out,
        ]
    else:
        cmd = [
            sys.executable,
            str(HERE / "_ringtrain_driver.py"),
            "--steps",
            str(steps),
            "--out",
            out,
            "--storage-path",
            storage,
        ]
    return cmd, env


# ----------------------------------------------------------------------------- processes


def tagged_pids(tag: str) -> list[int]:
    """Live processes (other than this one) whose environment carries ``TAG_VAR=tag``."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    needle = f"{TAG_VAR}={tag}".encode()
    pids = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone, or not ours
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def reap_leftovers(tag: str, grace_s: float = 5.0) -> list[int]:
    """Wait up to ``grace_s`` for the tagged processes of a finished command to exit, then SIGKILL
    the rest. Returns the pids that had to be killed."""
    deadline = time.monotonic() + grace_s
    while True:
        pids = tagged_pids(tag)
        if not pids or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


# ----------------------------------------------------------------------------- machine load


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (Linux /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal
    return total - values[3] - values[4], total


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def busy_fraction(interval_s: float = 1.0) -> float | None:
    """Share of the machine's CPU time spent busy over the next ``interval_s`` (0..1)."""
    a = cpu_jiffies()
    time.sleep(interval_s)
    b = cpu_jiffies()
    if a is None or b is None or b[1] == a[1]:
        return None
    return (b[0] - a[0]) / (b[1] - a[1])


def wait_for_quiet(threshold: float, max_wait_s: float) -> float | None:
    """Before a run: wait (up to ``max_wait_s``) until other processes keep the machine busy less
    than ``threshold`` (fraction of all CPUs); returns the last busy fraction measured."""
    deadline = time.monotonic() + max_wait_s
    busy = busy_fraction()
    while busy is not None and busy > threshold and time.monotonic() < deadline:
        busy = busy_fraction()
    return busy


# ----------------------------------------------------------------------------- one run


def run_once(variant: str, steps: int, timeout_s: float, tmp_root: str) -> dict[str, Any]:
    """Start one variant as a fresh command, wait for it, and return its measurements."""
    workdir = tempfile.mkdtemp(prefix=f"{variant}-", dir=tmp_root)
    tag = uuid.uuid4().hex
    try:
        out = os.path.join(workdir, "timings")
        cmd, env = command(variant, steps, out, os.path.join(workdir, "runs"))
        env[TAG_VAR] = tag
        env["TMPDIR"] = workdir  # torchrun's torchelastic_* log directory goes here too
        log_path = os.path.join(workdir, "log.txt")
        with open(log_path, "wb") as log:
            jiffies_before, children_before = cpu_jiffies(), children_cpu_s()
            t0 = time.time()
            proc = subprocess.Popen(
                cmd,
                cwd=HERE,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                returncode = proc.wait(timeout=timeout_s)
            except BaseException:  # timeout or Ctrl-C: take the whole command down
                kill_group(proc)
                reap_leftovers(tag, grace_s=0)
                raise
            t_end = time.time()
            jiffies_after, children_after = cpu_jiffies(), children_cpu_s()
        leftovers = reap_leftovers(tag)
        # CPU time other processes of the machine used during the run, as a share of all CPUs.
        foreign = None
        if jiffies_before is not None and jiffies_after is not None:
            tick = os.sysconf("SC_CLK_TCK")
            busy_s = (jiffies_after[0] - jiffies_before[0]) / tick
            total_s = (jiffies_after[1] - jiffies_before[1]) / tick
            own_s = children_after - children_before
            foreign = max(0.0, busy_s - own_s) / total_s if total_s > 0 else None
        log_text = Path(log_path).read_text(errors="replace")
        ranks = {}
        for rank in (0, 1):
            path = Path(f"{out}.rank{rank}.json")
            if path.exists():
                ranks[rank] = json.loads(path.read_text())
        if returncode != 0 or 0 not in ranks:
            raise RuntimeError(
                f"{variant} run failed (exit status {returncode}, ranks with timings: "
                f"{sorted(ranks)}); command: {' '.join(cmd)}\n--- log tail ---\n"
                + "\n".join(log_text.splitlines()[-40:])
            )
        runs_dir = Path(workdir, "runs")
        storage_entries = sorted(p.name for p in runs_dir.iterdir()) if runs_dir.exists() else []
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    res = measure(variant, ranks, t0, t_end, returncode, leftovers, storage_entries)
    res["command_cpu_s"] = children_after - children_before
    res["foreign_cpu_share"] = foreign
    return res


def measure(
    variant: str,
    ranks: dict[int, dict[str, Any]],
    t0: float,
    t_end: float,
    returncode: int,
    leftovers: list[int],
    storage_entries: list[str],
) -> dict[str, Any]:
    r0 = ranks[0]
    durations = r0["step_durations"]
    timed = durations[WARMUP_STEPS:] if len(durations) > WARMUP_STEPS else durations[1:]
    boundaries = [r0["proc_start"], r0["t_pg"], r0["t_ready"], r0["first_step_wall"]]
    phases: dict[str, float | None] = {}
    previous: float | None = t0
    for (name, _), stamp in zip(PHASES, boundaries, strict=True):
        phases[name] = None if stamp is None or previous is None else stamp - previous
        previous = stamp
    return {
        "variant": variant,
        "returncode": returncode,
        "time_to_first_step_s": r0["first_step_wall"] - t0,
        "median_step_s": statistics.median(timed),
        "median_step_s_per_rank": {
            str(rank): statistics.median(r["step_durations"][WARMUP_STEPS:] or [float("nan")])
            for rank, r in sorted(ranks.items())
        },
        "first_step_duration_s": durations[0],
        "loop_s": r0["loop_s"],
        "wall_s": t_end - t0,
        "after_loop_s": t_end - max(r["loop_end_wall"] for r in ranks.values()),
        "phases_s": phases,
        "threads": {str(rank): r["threads"] for rank, r in sorted(ranks.items())},
        "final_loss": r0["losses"][-1][1] if r0["losses"] else None,
        "leftover_pids": leftovers,
        "storage_entries": storage_entries,
    }


# ----------------------------------------------------------------------------- summary


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repetitions. Runs marked noisy (other processes were busy, and the retries
    ran out) are left out of a variant's medians as long as it has at least one clean run."""
    by: dict[str, list[dict[str, Any]]] = {}
    for v in VARIANTS:
        all_runs = [r for r in runs if r["variant"] == v]
        by[v] = [r for r in all_runs if not r["noisy"]] or all_runs
    per_variant: dict[str, dict[str, Any]] = {}
    for variant, rs in by.items():
        per_variant[variant] = {
            "runs": len(rs),
            "noisy_runs_left_out": sum(1 for r in runs if r["variant"] == variant and r not in rs),
            "noisy_runs_used": sum(1 for r in rs if r["noisy"]),
            "time_to_first_step_s": median_of(rs, "time_to_first_step_s"),
            "time_to_first_step_s_range": [
                min(r["time_to_first_step_s"] for r in rs),
                max(r["time_to_first_step_s"] for r in rs),
            ],
            "median_step_s": median_of(rs, "median_step_s"),
            "median_step_s_range": [
                min(r["median_step_s"] for r in rs),
                max(r["median_step_s"] for r in rs),
            ],
            "wall_s": median_of(rs, "wall_s"),
            "after_loop_s": median_of(rs, "after_loop_s"),
            "phases_s": {
                name: statistics.median(
                    r["phases_s"][name] for r in rs if r["phases_s"][name] is not None
                )
                if any(r["phases_s"][name] is not None for r in rs)
                else None
                for name, _ in PHASES
            },
        }
    t, r = per_variant["torchrun"], per_variant["ringtrain"]
    ratio = r["median_step_s"] / t["median_step_s"]
    # Per repetition (both runs of the pair used), ringtrain / torchrun.
    used = {id(x) for rs in by.values() for x in rs}
    pairs: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        if id(run) in used:
            pairs.setdefault(run["repeat"], {})[run["variant"]] = run
    paired = [
        p["ringtrain"]["median_step_s"] / p["torchrun"]["median_step_s"]
        for _, p in sorted(pairs.items())
        if len(p) == 2
    ]
    diff = r["time_to_first_step_s"] - t["time_to_first_step_s"]
    losses = {run["final_loss"] for run in runs}
    return {
        "per_variant": per_variant,
        "median_step_ratio": ratio,
        "median_step_ratio_paired": paired,
        "time_to_first_step_diff_s": diff,
        "targets": {
            "median_step_ratio_max": STEP_RATIO_TARGET,
            "median_step_ratio_met": ratio <= STEP_RATIO_TARGET,
            "time_to_first_step_diff_max_s": FIRST_STEP_DIFF_TARGET_S,
            "time_to_first_step_diff_met": diff <= FIRST_STEP_DIFF_TARGET_S,
        },
        "same_final_loss": len(losses) == 1,
        "leftover_processes": sum(len(run["leftover_pids"]) for run in runs),
        "max_foreign_cpu_share": max(
            (
                run["foreign_cpu_share"]
                for rs in by.values()
                for run in rs
                if run["foreign_cpu_share"] is not None
            ),
            default=None,
        ),
    }


def print_table(summary: dict[str, Any]) -> None:
    t = summary["per_variant"]["torchrun"]
    r = summary["per_variant"]["ringtrain"]

    def row(label: str, a: float | None, b: float | None, scale: float, unit: str) -> str:
        if a is None or b is None:
            return f"{label:<34} {'-':>10} {'-':>10} {'-':>11}"
        return (
            f"{label:<34} {a * scale:>10.3f} {b * scale:>10.3f} {(b - a) * scale:>+11.3f}  {unit}"
        )

    print()
    print(
        f"runs used: torchrun {t['runs']}, ringtrain {r['runs']} (noisy runs left out: "
        f"{t['noisy_runs_left_out']}, {r['noisy_runs_left_out']}; noisy runs used: "
        f"{t['noisy_runs_used']}, {r['noisy_runs_used']})"
    )
    print(f"{'median over repetitions':<34} {'torchrun':>10} {'ringtrain':>10} {'difference':>11}")
    print("-" * 72)
    print(row("time to first step", t["time_to_first_step_s"], r["time_to_first_step_s"], 1, "s"))
    for name, label in PHASES:
        print(row(f"  {label}", t["phases_s"][name], r["phases_s"][name], 1, "s"))
    print(row("median step time (steps 10..)", t["median_step_s"], r["median_step_s"], 1e3, "ms"))
    print(row("end-to-end wall time", t["wall_s"], r["wall_s"], 1, "s"))
    print(row("  last step -> command exited", t["after_loop_s"], r["after_loop_s"], 1, "s"))
    print("-" * 72)
    targets = summary["targets"]
    paired = ", ".join(f"{x:.3f}" for x in summary["median_step_ratio_paired"])
    print(
        f"median step time ratio ringtrain/torchrun: {summary['median_step_ratio']:.3f} "
        f"(target <= {STEP_RATIO_TARGET}: "
        f"{'met' if targets['median_step_ratio_met'] else 'MISSED'}); per repetition: {paired}"
    )
    print(
        f"time to first step, ringtrain - torchrun: {summary['time_to_first_step_diff_s']:+.3f} s "
        f"(target <= {FIRST_STEP_DIFF_TARGET_S:.1f} s: "
        f"{'met' if targets['time_to_first_step_diff_met'] else 'MISSED'})"
    )
    if not summary["same_final_loss"]:
        print("warning: the runs did not all end with the same loss")
    foreign = summary["max_foreign_cpu_share"]
    if foreign is not None and foreign > 0.05:
        print(
            f"warning: other processes used up to {foreign:.0%} of the machine's CPU during a "
            "run used above; its timings are distorted (run again on a quiet machine)"
        )
    if summary["leftover_processes"]:
        print(f"warning: {summary['leftover_processes']} leftover process(es) had to be killed")


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each variant")
    parser.add_argument(
        "--warmup-runs", type=int, default=1, help="untimed runs of each variant first"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.15,
        help="before each run, wait until the machine is busier than this share of all CPUs "
        "no longer (other processes distort the timings); 1 disables the wait",
    )
    parser.add_argument(
        "--max-wait", type=float, default=30.0, help="most seconds to wait for a quiet machine"
    )
    parser.add_argument(
        "--noise-limit",
        type=float,
        default=0.10,
        help="a run during which other processes used more than this share of all CPUs is "
        "discarded and run again (at most --retries times)",
    )
    parser.add_argument("--retries", type=int, default=2, help="re-runs of a noisy run")
    parser.add_argument("--json", metavar="PATH", help="write the summary and every run here")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be > {WARMUP_STEPS} (steps 0..{WARMUP_STEPS - 1} are warm-up)")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    sys.path.insert(0, str(HERE))
    import _workload as wl
    import torch

    import ringtrain

    params = wl.num_parameters()
    config = {
        "steps": args.steps,
        "repeats": args.repeats,
        "warmup_runs": args.warmup_runs,
        "workers": 2,
        "threads_per_worker": 1,
        "batch_per_worker": wl.BATCH_PER_WORKER,
        "model": f"MLP {wl.IN_FEATURES}-{wl.HIDDEN}-{wl.HIDDEN}-{wl.CLASSES}",
        "parameters": params,
        "optimizer": f"SGD(lr={wl.LR}, momentum=0.9)",
        "report_every": wl.REPORT_EVERY,
        "median_steps": f"{WARMUP_STEPS}..{args.steps - 1}",
        "torch": torch.__version__,
        "ringtrain": ringtrain.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    print(
        f"workload: {config['model']} ({params:,} parameters), batch {wl.BATCH_PER_WORKER}/worker, "
        f"2 workers x 1 thread, {config['optimizer']}, DDP/gloo, {args.steps} steps; "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs"
    )
    print(f"torchrun:  OMP_NUM_THREADS=1 {' '.join(command('torchrun', args.steps, 'OUT', '')[0])}")
    print(f"ringtrain: {' '.join(command('ringtrain', args.steps, 'OUT', 'RUNS')[0])}")

    runs: list[dict[str, Any]] = []
    discarded: list[dict[str, Any]] = []
    tmp_root = tempfile.mkdtemp(prefix="ringtrain-overhead-")
    try:
        for i in range(args.warmup_runs):
            for variant in VARIANTS:
                wait_for_quiet(args.quiet_threshold, args.max_wait)
                res = run_once(variant, min(args.steps, 2 * WARMUP_STEPS), args.timeout, tmp_root)
                print(f"warm-up {i + 1} {variant:<9} wall {res['wall_s']:6.2f} s (not counted)")
        for i in range(args.repeats):
            for variant in VARIANTS:
                for retry in range(args.retries + 1):
                    busy = wait_for_quiet(args.quiet_threshold, args.max_wait)
                    res = run_once(variant, args.steps, args.timeout, tmp_root)
                    res["busy_before_run"] = busy
                    res["repeat"] = i
                    foreign = res["foreign_cpu_share"]
                    res["noisy"] = foreign is not None and foreign > args.noise_limit
                    killed = res["leftover_pids"]
                    print(
                        f"run {i + 1}/{args.repeats} {variant:<9} "
                        f"first step {res['time_to_first_step_s']:6.3f} s  "
                        f"median step {res['median_step_s'] * 1e3:7.3f} ms  "
                        f"wall {res['wall_s']:6.2f} s  "
                        f"other processes {'?' if foreign is None else f'{foreign:4.0%}'} CPU"
                        + (f"  (killed leftover processes {killed})" if killed else "")
                    )
                    if not res["noisy"] or retry == args.retries:
                        runs.append(res)
                        break
                    discarded.append(res)
                    print("  ^ discarded (other processes were busy during the run); again")
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)

    summary = summarize(runs)
    print_table(summary)
    summary["discarded_runs"] = len(discarded)
    report = {"config": config, "summary": summary, "runs": runs, "discarded_runs": discarded}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
