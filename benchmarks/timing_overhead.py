"""Cost of ringtrain's default step timing: median step time with it on vs off.

The 2-worker workload of ``overhead.py`` (``_workload.py``: an MLP 784 -> 1024 -> 1024 -> 10,
1,863,690 parameters, batches of 64 per worker, SGD with momentum, DDP on gloo, one torch thread
per worker), fed by a prepared data loader so that every hook of the default instrumentation runs:
the loader's step boundary, the model's forward hooks and 6 gradient hooks, DDP's timed allreduce
hook and the optimizer hooks. Each run is one ``rt.Trainer(...).fit()`` with
``MonitorConfig(timing=True)`` or ``MonitorConfig(timing=False)``; rank 0 times every step itself
(``time.perf_counter`` from one batch to the next, so the timing hooks' own cost is inside).

Two measurements, in this order:

1. **End to end** (``--repeats`` pairs of fresh runs): runs alternate (off, on, on, off, ...) after
   one untimed warm-up run of each; per run the median of steps 10.. is taken; the summary is the
   median over the runs of each variant and the median of the per-pair ratios.
2. **In process** (``_timing_ab.py`` under torchrun, ``--pairs`` pairs): both ranks hold a plain
   and an instrumented copy of the DDP model and alternate short blocks of steps between them, so
   the machine's drift cancels within a pair; wall time and CPU time per step, with
   ``comm_timing="wait"`` (the CPU default) and ``"hook"``.

Target: ratio on/off <= 1.01.

Usage::

    python benchmarks/timing_overhead.py                  # 300 steps x 7 pairs; 60 + 60 A/B pairs
    python benchmarks/timing_overhead.py --steps 60 --repeats 1 --pairs 4   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _workload as wl  # noqa: E402
import overhead as ov  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ringtrain as rt  # noqa: E402

WARMUP_STEPS = 10
TARGET_RATIO = 1.01


def train_fn(config: dict[str, Any]) -> None:
    ctx = rt.get_context()
    model = rt.prepare_model(wl.build_model())
    optimizer = wl.make_optimizer(model)
    x, y = wl.make_batch(ctx.world_rank)
    n = config["steps"] * wl.BATCH_PER_WORKER * ctx.world_size
    reps = -(-n // len(x))
    dataset = TensorDataset(x.repeat(reps, 1)[:n], y.repeat(reps)[:n])
    loader = rt.prepare_data_loader(DataLoader(dataset, batch_size=wl.BATCH_PER_WORKER))
    loss_fn = torch.nn.CrossEntropyLoss()
    durations: list[float] = []
    t = time.perf_counter()
    for bx, by in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(bx), by)
        loss.backward()
        optimizer.step()
        now = time.perf_counter()
        durations.append(now - t)
        t = now
        if len(durations) % wl.REPORT_EVERY == 0:
            rt.report({"step": len(durations), "loss": loss.item()})
    if ctx.world_rank == 0:
        with open(config["out"], "w") as f:
            json.dump(durations, f)


def run_once(timing: bool, steps: int, tmp: str) -> float:
    out = os.path.join(tmp, f"steps-{timing}-{time.time_ns()}.json")
    rt.Trainer(
        train_fn,
        rt.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        rt.RunConfig(
            storage_path=os.path.join(tmp, "runs"),
            progress="off",
            monitor_config=rt.MonitorConfig(timing=timing, tensorboard=False, csv=False),
        ),
        train_loop_config={"steps": steps, "out": out},
    ).fit()
    with open(out) as f:
        durations = json.load(f)
    return statistics.median(durations[WARMUP_STEPS:])


def _pairs(off: list[float], on: list[float]) -> dict[str, Any]:
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    diffs = [a - b for a, b in zip(on, off, strict=True)]
    rq, dq = statistics.quantiles(ratios, n=4), statistics.quantiles(diffs, n=4)
    return {
        "off_s": statistics.median(off),
        "on_s": statistics.median(on),
        "ratio_median": statistics.median(ratios),
        "ratio_quartiles": [rq[0], rq[2]],
        "diff_s_median": statistics.median(diffs),
        "diff_s_quartiles": [dq[0], dq[2]],
    }


def in_process_ab(model: str, pairs: int, block: int, comm: str) -> dict[str, Any]:
    """Run ``_timing_ab.py`` on 2 ranks; summarise its per-pair block medians (wall time and CPU
    time per step)."""
    cmd = [
        *ov.torchrun_cmd(),
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "_timing_ab.py"),
        model,
        str(pairs),
        str(block),
        comm,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True)
    data = json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("{")))
    return {
        "model": model,
        "comm_timing": comm,
        "pairs": pairs,
        "block_steps": block,
        "wall": _pairs(data["off"], data["on"]),
        "cpu": _pairs(data["cpu_off"], data["cpu_on"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pairs", type=int, default=60, help="in-process A/B pairs per model")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="rt-timing-bench-") as tmp:
        for timing in (False, True):  # warm-up: page cache, imports
            run_once(timing, max(WARMUP_STEPS + 5, args.steps // 4), tmp)
        for i in range(args.repeats):
            for timing in (False, True) if i % 2 == 0 else (True, False):  # drift cancels
                ov.wait_for_quiet(0.15, 30.0)
                median = run_once(timing, args.steps, tmp)
                results["on" if timing else "off"].append(median)
                print(f"run {i + 1}/{args.repeats} timing={'on ' if timing else 'off'} "
                      f"median step {median * 1e3:.3f} ms", flush=True)  # fmt: skip
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    ratios = [a / b for a, b in zip(results["on"], results["off"], strict=True)]
    summary = {
        "steps": args.steps,
        "repeats": args.repeats,
        "median_step_s_off": off,
        "median_step_s_on": on,
        "ratio_on_off": on / off,
        "paired_ratio_median": statistics.median(ratios),
        "paired_ratio_range": [min(ratios), max(ratios)],
        "target_ratio": TARGET_RATIO,
        "runs": results,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    print(f"\nmedian step, timing off: {off * 1e3:.3f} ms")
    print(f"median step, timing on:  {on * 1e3:.3f} ms")
    print(
        f"ratio on/off: {on / off:.4f} (paired median {statistics.median(ratios):.4f}, range "
        f"{min(ratios):.4f}-{max(ratios):.4f}; target <= {TARGET_RATIO})"
    )
    ab = []
    for model, block, comm in (("workload", 25, "wait"), ("workload", 25, "hook")):
        ov.wait_for_quiet(0.15, 30.0)
        r = in_process_ab(model, args.pairs, block, comm)
        ab.append(r)
        for kind in ("wall", "cpu"):
            p = r[kind]
            rq, dq = p["ratio_quartiles"], p["diff_s_quartiles"]
            print(
                f"in process, {model} model, comm_timing={comm} ({args.pairs} pairs of "
                f"{block}-step blocks), {kind} time per step: off {p['off_s'] * 1e3:.3f} ms, "
                f"on {p['on_s'] * 1e3:.3f} ms; paired ratio {p['ratio_median']:.4f} "
                f"(quartiles {rq[0]:.4f}-{rq[1]:.4f}), difference {p['diff_s_median'] * 1e6:.0f} "
                f"us (quartiles {dq[0] * 1e6:.0f} to {dq[1] * 1e6:.0f})"
            )
    summary["in_process"] = ab
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
