"""Recovery from a killed worker, and the training stall of a checkpoint save (issue 3).

Every run is ``rt.Trainer(_recovery_worker.train_fn, ScalingConfig(num_workers=2,
resources_per_worker={"CPU": 1}), RunConfig(storage_path=<temp dir>, progress="off",
checkpoint_config=CheckpointConfig(num_to_keep=1, async_save=...),
failure_config=FailureConfig(max_failures=1))).fit()``, started as a fresh command (this script with
``--child``). The train function (``_recovery_worker.py``) uses only the public API:
``rt.prepare_model`` (DDP on gloo), ``rt.prepare_data_loader``, one ``rt.TrainState`` (model,
SGD-with-momentum optimizer, data loader) restored at start, and
``rt.report(..., checkpoint=state)`` every ``every`` steps.

A. Recovery, small model (the overhead benchmark's MLP, 1.86 M parameters, batch 64 per worker):
   checkpoints every 20 steps; on attempt 0 rank 1 SIGKILLs itself right after step 50 (10 steps
   after the checkpoint of step 40); 60 steps in all.
B. The same with a 100 M parameter model (6 x ``nn.Linear(4096, 4096)``, 403 MB of fp32 parameters,
   806 MB of checkpointed state with the momentum buffers; batch 4 per worker): checkpoints every 3
   steps, kill right after step 5, 6 steps in all.

   For A and B the killing rank first waits, without training, until the checkpoint it last
   reported is published (its background write has finished): the kill lands between checkpoints,
   never inside a write. It writes ``time.time()`` to a file right before ``os.kill``; after the
   restart every rank records wall-clock time stamps (process created, train function unpickled,
   train function called, model built, model wrapped, state restored, first step done), and the
   driver's ``events.jsonl`` gives the failure, the restart decision and the new attempt's start.
   Recovery time = (first training step of attempt 1 completed on both ranks) - (kill).
   Steps recomputed = (step at the kill) - (step restored), against the steps since the last
   checkpoint.

C. The stall of one checkpoint save of the 100 M model, synchronous (``async_save=False``: the time
   ``report(..., checkpoint=state)`` takes, files written and fsynced) against asynchronous
   (``async_save=True``: the time ``report`` takes to stage the state into host memory), one run
   each with ``--saves`` saves; and, in the asynchronous run, the step time of rank 0 while a
   background write is in progress (from the ``report`` return to the ``checkpoint`` event in
   ``events.jsonl``) against its step time with no write in progress.

Usage::

    python benchmarks/recovery.py                      # A: 5 runs, B: 3 runs, C: 4 saves each
    python benchmarks/recovery.py --quick              # smoke run, ~1 min (B and C: 25 M model)
    python benchmarks/recovery.py --json /tmp/recovery.json

One untimed warm-up run of A comes first (``--warmup-runs``). As in ``overhead.py``, the benchmark
waits before each run until the machine is quiet, measures the CPU time other processes used during
the run, and runs a run again when that exceeded ``--noise-limit`` of the machine (up to
``--retries`` times); recovery medians leave out runs still noisy after the retries. ``--json PATH``
writes the configuration (with a SHA-256 of ringtrain's source), the summary and every run.

Every run lives in its own temporary directory (removed afterwards); its processes carry a unique
environment tag, and any still alive after the run are killed and reported.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import overhead as ov  # noqa: E402  (process and machine-load helpers)

RECOVERY_TARGET_S = 3.0
STALL_RATIO_TARGET = 0.10
WARMUP_STEPS = 2  # the first steps of a run (allocation) are left out of step-time medians

SMALL: dict[str, Any] = {
    "model": "small",
    "batch": 64,
    "samples": 2048,
    "steps": 60,
    "every": 20,
    "kill_step": 50,
    "wait_published": True,
}
LARGE: dict[str, Any] = {"model": "large", "width": 4096, "layers": 6, "batch": 4, "samples": 64}
LARGE_QUICK = {**LARGE, "width": 2048}

# Recovery phases: (key, label); each ends at a boundary of ``boundaries()``.
PHASES = (
    ("detect", "kill -> driver sees the failure"),
    ("stop", "-> group stopped, restart decided"),
    ("verify", "-> latest checkpoint verified, attempt 1 launched"),
    ("spawn", "-> worker processes created"),
    ("imports", "-> Python, ringtrain, torch imported, train fn unpickled"),
    ("pg_init", "-> process group initialised"),
    ("build", "-> model built"),
    ("wrap", "-> model wrapped (prepare_model: DDP)"),
    ("restore", "-> TrainState.restore() done"),
    ("first_step", "-> first step done"),
)


# ----------------------------------------------------------------------------- child (driver)


def child(spec_path: str) -> int:
    """One ``Trainer.fit()`` (run in a fresh process by :func:`run_once`)."""
    spec = json.loads(Path(spec_path).read_text())
    import _recovery_worker as worker

    import ringtrain as rt

    t_fit = time.time()
    result = rt.Trainer(
        worker.train_fn,
        rt.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        rt.RunConfig(
            name="run",
            storage_path=spec["storage"],
            progress="off",
            checkpoint_config=rt.CheckpointConfig(num_to_keep=1, async_save=spec["async_save"]),
            failure_config=rt.FailureConfig(max_failures=spec["max_failures"]),
        ),
        train_loop_config=spec["config"],
    ).fit()
    record = {
        "t_fit_start": t_fit,
        "t_fit_end": time.time(),
        "failures": [f.to_dict() for f in result.failures],
        "checkpoint": result.checkpoint.uri if result.checkpoint else None,
        "metrics": result.metrics,
    }
    Path(spec["config"]["out"], "driver.json").write_text(json.dumps(record, default=repr))
    return 0


# ----------------------------------------------------------------------------- one run


def run_once(
    config: dict[str, Any], *, async_save: bool, max_failures: int, timeout_s: float
) -> dict[str, Any]:
    """Start one fit as a fresh command; return every file it left (timings, events, manifest)."""
    workdir = tempfile.mkdtemp(prefix="ringtrain-recovery-")
    tag = uuid.uuid4().hex
    try:
        out = os.path.join(workdir, "out")
        os.makedirs(out)
        storage = os.path.join(workdir, "runs")
        spec = {
            "storage": storage,
            "async_save": async_save,
            "max_failures": max_failures,
            "config": {**config, "out": out},
        }
        spec_path = os.path.join(workdir, "spec.json")
        Path(spec_path).write_text(json.dumps(spec))
        env = dict(os.environ, **{ov.TAG_VAR: tag, "TMPDIR": workdir})
        log_path = os.path.join(workdir, "log.txt")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", spec_path]
        with open(log_path, "wb") as log:
            jiffies_before, children_before = ov.cpu_jiffies(), ov.children_cpu_s()
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
            except BaseException:
                ov.kill_group(proc)
                ov.reap_leftovers(tag, grace_s=0)
                raise
            t_end = time.time()
            jiffies_after, children_after = ov.cpu_jiffies(), ov.children_cpu_s()
        leftovers = ov.reap_leftovers(tag)
        foreign = None
        if jiffies_before is not None and jiffies_after is not None:
            tick = os.sysconf("SC_CLK_TCK")
            busy_s = (jiffies_after[0] - jiffies_before[0]) / tick
            total_s = (jiffies_after[1] - jiffies_before[1]) / tick
            own_s = children_after - children_before
            foreign = max(0.0, busy_s - own_s) / total_s if total_s > 0 else None
        files: dict[str, Any] = {}
        for path in Path(out).glob("*.json"):
            files[path.stem] = json.loads(path.read_text())
        events_path = Path(storage, "run", "events.jsonl")
        events = (
            [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
            if events_path.exists()
            else []
        )
        manifest = None
        ckpt = (files.get("driver") or {}).get("checkpoint")
        if ckpt and Path(ckpt, "manifest.json").exists():
            manifest = json.loads(Path(ckpt, "manifest.json").read_text())
        log_text = Path(log_path).read_text(errors="replace")
        if returncode != 0 or "driver" not in files:
            raise RuntimeError(
                f"run failed (exit status {returncode}); command: {' '.join(cmd)}\n"
                "--- log tail ---\n" + "\n".join(log_text.splitlines()[-40:])
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "files": files,
        "events": events,
        "manifest": manifest,
        "wall_s": t_end - t0,
        "foreign_cpu_share": foreign,
        "leftover_pids": leftovers,
    }


# ----------------------------------------------------------------------------- analysis


def boundaries(run: dict[str, Any]) -> list[float]:
    """The time stamps that end each phase of PHASES (wall clock). Worker boundaries are the
    latest over the ranks: the group moves on only when its slowest rank does."""
    files, events = run["files"], run["events"]
    a1 = [files[f"a1_r{r}"] for r in (0, 1)]
    failures = [e for e in events if e["type"] == "failure" and e.get("attempt") == 0]
    decision = next(e for e in events if e["type"] == "decision")
    start1 = next(e for e in events if e["type"] == "run_start" and e.get("attempt") == 1)

    def latest(key: str) -> float:
        return max(float(r[key]) for r in a1)

    return [
        min(e["time"] for e in failures),
        decision["time"],
        start1["time"],
        latest("proc_start"),
        latest("t_import"),
        latest("t_entry"),
        latest("t_built"),
        latest("t_model"),
        latest("t_restored"),
        latest("first_step_wall"),
    ]


def analyse_recovery(run: dict[str, Any], every: int) -> dict[str, Any]:
    files = run["files"]
    kill = files["kill"]
    t_kill = kill["t_kill"]
    stamps = boundaries(run)
    phases = {}
    previous = t_kill
    for (key, _), stamp in zip(PHASES, stamps, strict=True):
        phases[key] = stamp - previous
        previous = stamp
    restored = [files[f"a1_r{r}"]["restored_step"] for r in (0, 1)]
    step = kill["step"]
    failures = [
        {"rank": e["rank"], "kind": e["kind"], "after_kill_s": e["time"] - t_kill}
        for e in run["events"]
        if e["type"] == "failure"
    ]
    return {
        "recovery_s": stamps[-1] - t_kill,
        "phases_s": phases,
        "kill_step": step,
        "restored_step": restored[0],
        "restored_steps_agree": len(set(restored)) == 1,
        "steps_recomputed": step - restored[0],
        "steps_since_last_checkpoint": step - (step // every) * every,
        "published_at_kill": kill["published"],
        "waited_for_publish_s": kill["waited_for_publish_s"],
        "failures": failures,
        "parameters": files["a1_r0"].get("parameters"),
        "wall_s": run["wall_s"],
        "foreign_cpu_share": run["foreign_cpu_share"],
        "noisy": run["noisy"],
        "leftover_pids": run["leftover_pids"],
    }


def analyse_saves(run: dict[str, Any]) -> dict[str, Any]:
    """Report times of the checkpoint saves and, for background writes, the step times of
    rank 0 while a write is in progress vs not."""
    files, events = run["files"], run["events"]
    r0, r1 = files["a0_r0"], files["a0_r1"]
    stalls0 = [rep[2] for rep in r0["reports"] if rep[1]]
    stalls1 = [rep[2] for rep in r1["reports"] if rep[1]]
    published = {
        e["metrics"]["step"]: e["time"]
        for e in events
        if e["type"] == "checkpoint" and isinstance(e.get("metrics"), dict)
    }
    windows = []  # (step, report start, report return, checkpoint published)
    for rep in r0["reports"]:
        if rep[1] and rep[0] in published:
            windows.append((rep[0], rep[3], rep[4], published[rep[0]]))
    during: list[float] = []
    outside: list[float] = []
    for step, w0, w1, duration in r0["steps"]:
        if step <= WARMUP_STEPS:
            continue
        busy = any(w0 < end and w1 > ret for _, _, ret, end in windows)
        (during if busy else outside).append(duration)
    # A save that began while the previous one was still being written waited for it.
    waited = [cur[0] for prev, cur in itertools.pairwise(windows) if cur[1] < prev[3]]
    sizes = sum(f["size"] for f in (run["manifest"] or {}).get("files", {}).values())
    return {
        "saves": len(stalls0),
        "stall_rank0_s": stalls0,
        "stall_rank1_s": stalls1,
        "write_after_return_s": [end - ret for _, _, ret, end in windows],
        "saves_that_waited_for_previous": waited,
        "step_s_no_write": statistics.median(outside) if outside else None,
        "step_s_during_write": statistics.median(during) if during else None,
        "steps_no_write": len(outside),
        "steps_during_write": len(during),
        "checkpoint_bytes": sizes,
        "parameters": r0.get("parameters"),
        "wall_s": run["wall_s"],
        "foreign_cpu_share": run["foreign_cpu_share"],
        "noisy": run["noisy"],
        "leftover_pids": run["leftover_pids"],
    }


def stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_recovery(all_runs: list[dict[str, Any]], target_s: float | None) -> dict[str, Any]:
    """Medians over the runs; runs marked noisy (other processes were busy, and the retries ran
    out) are left out as long as at least one clean run is left. Steps recomputed are checked on
    every run."""
    runs = [r for r in all_runs if not r["noisy"]] or all_runs
    median = statistics.median(r["recovery_s"] for r in runs)
    return {
        "runs": len(runs),
        "noisy_runs_left_out": len(all_runs) - len(runs),
        "noisy_runs_used": sum(1 for r in runs if r["noisy"]),
        "parameters": runs[0]["parameters"],
        "recovery_s": stats([r["recovery_s"] for r in runs]),
        "phases_s": {k: stats([r["phases_s"][k] for r in runs]) for k, _ in PHASES},
        "steps_recomputed": [r["steps_recomputed"] for r in all_runs],
        "steps_since_last_checkpoint": [r["steps_since_last_checkpoint"] for r in all_runs],
        "recomputed_equals_since_checkpoint": all(
            r["steps_recomputed"] == r["steps_since_last_checkpoint"] for r in all_runs
        ),
        "waited_for_publish_s": stats([r["waited_for_publish_s"] for r in all_runs]),
        "recovery_target_s": target_s,
        "recovery_target_met": None if target_s is None else median < target_s,
    }


# ----------------------------------------------------------------------------- output


def noise_note(res: dict[str, Any]) -> str:
    foreign = res["foreign_cpu_share"]
    text = "" if foreign is None else f"; other processes {foreign:.0%} CPU"
    return text + (" (NOISY, kept after the retries)" if res["noisy"] else "")


def fmt(s: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    m, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    return f"{m:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def print_recovery(summaries: dict[str, dict[str, Any]]) -> None:
    names = list(summaries)
    print()
    header = f"{'recovery, median (min-max) s':<58}" + "".join(
        f"{n + ' (' + str(summaries[n]['runs']) + ' runs)':>24}" for n in names
    )
    print(header)
    print("-" * len(header))
    print(
        f"{'kill -> first step after resume':<58}"
        + "".join(f"{fmt(summaries[n]['recovery_s']):>24}" for n in names)
    )
    for key, label in PHASES:
        print(
            f"{'  ' + label:<58}"
            + "".join(f"{fmt(summaries[n]['phases_s'][key]):>24}" for n in names)
        )
    print(
        f"{'steps recomputed (per run)':<58}"
        + "".join(f"{','.join(map(str, summaries[n]['steps_recomputed'])):>24}" for n in names)
    )
    print(
        f"{'steps since the last checkpoint (per run)':<58}"
        + "".join(
            f"{','.join(map(str, summaries[n]['steps_since_last_checkpoint'])):>24}" for n in names
        )
    )
    print("-" * len(header))
    for n in names:
        s = summaries[n]
        target = s["recovery_target_s"]
        verdict = (
            "no target"
            if target is None
            else f"target < {target:.0f} s: {'met' if s['recovery_target_met'] else 'MISSED'}"
        )
        left_out = s["noisy_runs_left_out"]
        print(
            f"{n}: recovery {s['recovery_s']['median']:.2f} s ({verdict}); steps recomputed = "
            f"steps since the last checkpoint in every run: "
            f"{'yes' if s['recomputed_equals_since_checkpoint'] else 'NO'}"
            + (f"; {left_out} noisy run(s) left out of the medians" if left_out else "")
        )


def print_saves(summary: dict[str, Any]) -> None:
    sync, asyn = summary["sync"], summary["async"]

    def cell(values: list[float] | None, scale: float = 1.0, unit: str = "s") -> str:
        if not values:
            return "-"
        return fmt(stats(values), scale, 3 if unit == "s" else 1) + f" {unit}"

    print()
    print(
        f"checkpoint save, {sync['parameters']:,} parameters, "
        f"{sync['checkpoint_bytes'] / 1e6:.0f} MB per checkpoint; median (min-max) over "
        f"{sync['saves']} / {asyn['saves']} saves"
    )
    print(f"{'':<44}{'sync':>26}{'async':>26}")
    print("-" * 96)
    print(
        f"{'report() on rank 0 (the stall)':<44}{cell(sync['stall_rank0_s']):>26}"
        f"{cell(asyn['stall_rank0_s']):>26}"
    )
    print(
        f"{'report() on rank 1':<44}{cell(sync['stall_rank1_s']):>26}"
        f"{cell(asyn['stall_rank1_s']):>26}"
    )
    print(
        f"{'background write after report() returned':<44}{'-':>26}"
        f"{cell(asyn['write_after_return_s']):>26}"
    )

    def step(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    print(
        f"{'rank 0 step time, no write in progress':<44}{step(sync['step_s_no_write']):>26}"
        f"{step(asyn['step_s_no_write']):>26}"
    )
    print(
        f"{'rank 0 step time, background write running':<44}{'-':>26}"
        f"{step(asyn['step_s_during_write']):>26}"
    )
    print("-" * 96)
    ratio = summary["stall_ratio"]
    print(
        f"async stall / sync stall (medians): {ratio:.3f} (target < {STALL_RATIO_TARGET}: "
        f"{'met' if ratio < STALL_RATIO_TARGET else 'MISSED'})"
    )
    slow = summary["step_slowdown_during_write"]
    if slow is not None:
        print(f"rank 0 steps during a background write: {slow:+.0%} vs no write in progress")
    if asyn["saves_that_waited_for_previous"]:
        print(
            f"note: saves at steps {asyn['saves_that_waited_for_previous']} began before the "
            "previous write had finished (their stall includes waiting for it)"
        )


# ----------------------------------------------------------------------------- main


def _settings(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[dict[str, Any], int, int, int, int]:
    """The model of B and C, repeats of A and B, saves of C and warm-up runs (--quick: 1 each)."""
    if args.retries is None:
        args.retries = 0 if args.quick else 2
    if args.quick:
        print("--quick: one run of each part, and a 25 M parameter model for B and C (smoke test)")
        return LARGE_QUICK, 1, 1, 2, 0
    if min(args.repeats, args.repeats_large, args.saves) < 1:
        parser.error("--repeats, --repeats-large and --saves must be >= 1")
    return LARGE, args.repeats, args.repeats_large, args.saves, args.warmup_runs


def _source_digest(src: Path) -> Any:
    """SHA-256 over ringtrain's source files (names and bytes), to tie results to the code."""
    digest = hashlib.sha256()
    for path in sorted(src.rglob("*.py")):
        digest.update(path.relative_to(src).as_posix().encode() + b"\0" + path.read_bytes())
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of A (small model)")
    parser.add_argument("--repeats-large", type=int, default=3, help="runs of B (100 M model)")
    parser.add_argument("--saves", type=int, default=4, help="checkpoint saves per mode in C")
    parser.add_argument(
        "--warmup-runs", type=int, default=1, help="untimed runs of A first (0 with --quick)"
    )
    parser.add_argument("--parts", default="ABC", help="which parts to run (default ABC)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 run each, 25 M model")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per run")
    parser.add_argument(
        "--quiet-threshold",
        type=float,
        default=0.15,
        help="before each run, wait (at most --max-wait s) until other processes use less than "
        "this share of all CPUs",
    )
    parser.add_argument(
        "--max-wait", type=float, default=30.0, help="most seconds to wait for a quiet machine"
    )
    parser.add_argument(
        "--noise-limit",
        type=float,
        default=0.10,
        help="a run during which other processes used more than this share of all CPUs is "
        "discarded and run again (at most --retries times; the last one is kept, marked noisy)",
    )
    parser.add_argument(
        "--retries", type=int, default=None, help="re-runs of a noisy run (default 2; 0 --quick)"
    )
    parser.add_argument("--json", metavar="PATH", help="write the summary and every run here")
    parser.add_argument("--child", metavar="SPEC", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child)
    parts = set(args.parts.upper())
    large, repeats, repeats_large, saves, warmup_runs = _settings(args, parser)

    import torch

    import ringtrain

    digest = _source_digest(Path(ringtrain.__file__).resolve().parent)
    config: dict[str, Any] = {
        "workers": 2,
        "threads_per_worker": 1,
        "small": SMALL,
        "large": {**large, "steps": 6, "every": 3, "kill_step": 5, "wait_published": True},
        "repeats": repeats,
        "repeats_large": repeats_large,
        "saves": saves,
        "warmup_runs": warmup_runs,
        "quick": args.quick,
        "torch": torch.__version__,
        "ringtrain": ringtrain.__version__,
        "ringtrain_source_sha256": digest.hexdigest(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    print(
        f"ringtrain {ringtrain.__version__}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"2 workers x 1 thread, DDP/gloo, TrainState checkpoints (num_to_keep=1)"
    )
    t_start = time.monotonic()
    report: dict[str, Any] = {"config": config, "summary": {}, "runs": {}}
    discarded: list[dict[str, Any]] = []

    def one(cfg: dict[str, Any], label: str, **kw: Any) -> dict[str, Any]:
        """One run; run again (at most --retries times) when other processes were busy."""
        for attempt in range(args.retries + 1):
            ov.wait_for_quiet(args.quiet_threshold, args.max_wait)
            run = run_once(cfg, timeout_s=args.timeout, **kw)
            if run["leftover_pids"]:
                print(f"  ({label}: killed leftover processes {run['leftover_pids']})")
            foreign = run["foreign_cpu_share"]
            run["noisy"] = foreign is not None and foreign > args.noise_limit
            if not run["noisy"] or attempt == args.retries:
                return run
            discarded.append(run)
            print(
                f"  ({label}: other processes used {foreign:.0%} of the CPUs during the run; "
                "discarded, again)"
            )
        raise AssertionError("unreachable")

    recovery: dict[str, dict[str, Any]] = {}
    if "A" in parts:
        for i in range(warmup_runs):
            res = analyse_recovery(
                one(SMALL, "warm-up", async_save=True, max_failures=1), SMALL["every"]
            )
            print(f"warm-up {i + 1} small model: recovery {res['recovery_s']:.2f} s (not counted)")
        runs = []
        for i in range(repeats):
            res = analyse_recovery(one(SMALL, "A", async_save=True, max_failures=1), SMALL["every"])
            runs.append(res)
            print(
                f"A {i + 1}/{repeats} small model: recovery {res['recovery_s']:.2f} s, "
                f"steps recomputed {res['steps_recomputed']} (since last checkpoint "
                f"{res['steps_since_last_checkpoint']}), wall {res['wall_s']:.1f} s"
                + noise_note(res)
            )
        report["runs"]["A"] = runs
        recovery["small model"] = summarize_recovery(runs, RECOVERY_TARGET_S)
    if "B" in parts:
        cfg = config["large"]
        runs = []
        for i in range(repeats_large):
            res = analyse_recovery(one(cfg, "B", async_save=True, max_failures=1), cfg["every"])
            runs.append(res)
            print(
                f"B {i + 1}/{repeats_large} {res['parameters'] / 1e6:.0f} M model: recovery "
                f"{res['recovery_s']:.2f} s, steps recomputed {res['steps_recomputed']} (since "
                f"last checkpoint {res['steps_since_last_checkpoint']}), waited "
                f"{res['waited_for_publish_s']:.1f} s for the publish, wall {res['wall_s']:.1f} s"
                + noise_note(res)
            )
        report["runs"]["B"] = runs
        recovery[f"{runs[0]['parameters'] / 1e6:.0f}M model"] = summarize_recovery(runs, None)
    if recovery:
        report["summary"]["recovery"] = recovery
        print_recovery(recovery)
    if "C" in parts:
        saves_runs = {}
        # sync: a save every 2 steps; async: every 6 (rank 0's background write of the 100 M
        # model takes ~4 steps on 2 shared cores), so no save waits for the previous one.
        for mode, every in (("sync", 2), ("async", 6)):
            cfg = {**large, "steps": saves * every + min(3, every - 1), "every": every}
            res = analyse_saves(one(cfg, "C", async_save=mode == "async", max_failures=0))
            saves_runs[mode] = res
            print(
                f"C {mode:<5}: report() on rank 0 "
                + ", ".join(f"{s:.3f}" for s in res["stall_rank0_s"])
                + f" s; wall {res['wall_s']:.1f} s"
                + noise_note(res)
            )
        sync_stall = statistics.median(saves_runs["sync"]["stall_rank0_s"])
        async_stall = statistics.median(saves_runs["async"]["stall_rank0_s"])
        a = saves_runs["async"]
        slowdown = (
            a["step_s_during_write"] / a["step_s_no_write"] - 1
            if a["step_s_during_write"] and a["step_s_no_write"]
            else None
        )
        summary = {
            "sync": saves_runs["sync"],
            "async": a,
            "stall_ratio": async_stall / sync_stall,
            "stall_ratio_target": STALL_RATIO_TARGET,
            "stall_ratio_met": async_stall / sync_stall < STALL_RATIO_TARGET,
            "step_slowdown_during_write": slowdown,
        }
        report["summary"]["saves"] = summary
        print_saves(summary)
    elapsed = time.monotonic() - t_start
    report["elapsed_s"] = elapsed
    report["discarded_noisy_runs"] = len(discarded)
    print(f"\ntotal time {elapsed:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
