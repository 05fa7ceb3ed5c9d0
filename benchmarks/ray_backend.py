"""ringtrain on Ray vs ringtrain on local processes vs Ray Train's ``TorchTrainer``.

The same 2-worker workload (``_workload.py``: an MLP 784 -> 1024 -> 1024 -> 10 of 1,863,690
parameters, one synthetic batch of 64 per worker, SGD with momentum, DDP on gloo, one torch thread
and one CPU per worker, a report every 50 steps, no checkpoints) runs three ways from one driver
process, with Ray already running (``ray.init`` once before any timing):

* ``ringtrain-local``: ``rt.Trainer(..., ScalingConfig(num_workers=2,
  resources_per_worker={"CPU": 1})).fit()``, worker processes on this machine;
* ``ringtrain-ray``: the same with ``backend="ray"``: one Ray actor per worker in a placement
  group;
* ``raytrain``: ``ray.train.torch.TorchTrainer(loop, scaling_config=ray.train.ScalingConfig(
  num_workers=2, resources_per_worker={"CPU": 1})).fit()`` with ``ray.train.torch.prepare_model``
  and ``ray.train.report`` (Ray Train is a benchmark-only dependency: ``pip install
  "ray[train]"``, matching the installed Ray).

``t0 = time.time()`` right before ``fit()``; rank 0 records the wall-clock time its first step
completed and every step's duration (``time.perf_counter`` around zero_grad + forward + backward +
optimizer step, so the three loops time exactly the same code).

* time to first step = first step's end - t0
* median step time = median of steps 10.. (the first 10 are warm-up)

After one untimed warm-up run of each variant, runs are interleaved (local, ray, raytrain, local,
...) and each summary is the median over the repetitions. Targets (issue 4): ringtrain-ray median
step time within 2 % of ringtrain-local and below Ray Train's; ringtrain-ray time to first step
below Ray Train's.

Usage::

    python benchmarks/ray_backend.py                          # 200 steps, 5 repetitions
    python benchmarks/ray_backend.py --steps 60 --repeats 3   # quicker
    python benchmarks/ray_backend.py --json ray_backend.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _workload as wl
import cloudpickle
import torch

import ringtrain as rt

VARIANTS = ("ringtrain-local", "ringtrain-ray", "raytrain")
TIMING = True  # ringtrain's per-step timing (on by default); --no-timing turns it off
WARMUP_STEPS = 10


# ------------------------------------------------------------------ the three train loops


def ringtrain_loop(config: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    ctx = rt.get_context()
    model = rt.prepare_model(wl.build_model())
    optimizer = wl.make_optimizer(model)
    x, y = wl.make_batch(ctx.world_rank)
    timings = wl.train_loop(
        model,
        optimizer,
        x,
        y,
        config["steps"],
        lambda step, loss: rt.report({"step": step, "loss": loss}),
    )
    wl.write_timings(config["out"], ctx.world_rank, timings)


def raytrain_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(wl.build_model())
    optimizer = wl.make_optimizer(model)
    x, y = wl.make_batch(rank)
    timings = wl.train_loop(
        model,
        optimizer,
        x,
        y,
        config["steps"],
        lambda step, loss: ray.train.report({"step": step, "loss": loss}),
    )
    wl.write_timings(config["out"], rank, timings)


# ------------------------------------------------------------------ one run


def run_once(variant: str, steps: int, workdir: Path) -> dict[str, float]:
    out = str(workdir / f"{variant}-{time.time_ns()}")
    config = {"steps": steps, "out": out}
    storage = str(workdir / "runs")
    name = f"{variant}-{time.time_ns()}"
    t0 = time.time()
    if variant == "raytrain":
        import ray.train
        from ray.train.torch import TorchTrainer

        TorchTrainer(
            raytrain_loop,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(
                num_workers=2, use_gpu=False, resources_per_worker={"CPU": 1}
            ),
            run_config=ray.train.RunConfig(name=name, storage_path=storage),
        ).fit()
    else:
        rt.Trainer(
            ringtrain_loop,
            rt.ScalingConfig(
                num_workers=2,
                resources_per_worker={"CPU": 1},
                backend="ray" if variant == "ringtrain-ray" else "local",
            ),
            rt.RunConfig(
                name=name,
                storage_path=storage,
                progress="off",
                monitor_config=rt.MonitorConfig(timing=TIMING),
            ),
            train_loop_config=config,
        ).fit()
    t_end = time.time()
    with open(f"{out}.rank0.json") as f:
        record = json.load(f)
    return {
        "first_step_s": record["first_step_wall"] - t0,
        "median_step_ms": 1000 * statistics.median(record["step_durations"][WARMUP_STEPS:]),
        "fit_s": t_end - t0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--no-timing", action="store_true", help="turn ringtrain's per-step timing off"
    )
    args = parser.parse_args()
    global TIMING
    TIMING = not args.no_timing
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be > {WARMUP_STEPS}")

    import ray

    # The loops and _workload travel by value: no worker needs this directory on its path.
    cloudpickle.register_pickle_by_value(wl)
    ray.cloudpickle.register_pickle_by_value(wl)
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="rt-ray-bench-") as tmp:
        workdir = Path(tmp)
        for variant in VARIANTS:  # warm-up: imports, Ray worker pool, page cache
            run_once(variant, WARMUP_STEPS + 5, workdir)
        for i in range(args.repeats):
            for variant in VARIANTS:
                r = run_once(variant, args.steps, workdir)
                runs[variant].append(r)
                print(
                    f"run {i + 1}/{args.repeats} {variant:16s} first step {r['first_step_s']:6.2f}"
                    f" s  median step {r['median_step_ms']:7.2f} ms  fit {r['fit_s']:6.2f} s",
                    flush=True,
                )
    ray.shutdown()

    summary = {
        v: {k: statistics.median(r[k] for r in runs[v]) for k in runs[v][0]} for v in VARIANTS
    }
    local, on_ray, raytrain = (summary[v] for v in VARIANTS)
    ratios = {
        "step ringtrain-ray / ringtrain-local": on_ray["median_step_ms"] / local["median_step_ms"],
        "step ringtrain-ray / raytrain": on_ray["median_step_ms"] / raytrain["median_step_ms"],
        "first step ringtrain-ray / raytrain": on_ray["first_step_s"] / raytrain["first_step_s"],
    }
    print(
        f"\n2 workers, {args.steps} steps, {args.repeats} repetitions, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}, ray {ray.__version__}"
    )
    print(f"{'variant':16s} {'first step (s)':>15s} {'median step (ms)':>17s} {'fit (s)':>8s}")
    for v in VARIANTS:
        s = summary[v]
        print(f"{v:16s} {s['first_step_s']:15.2f} {s['median_step_ms']:17.2f} {s['fit_s']:8.2f}")
    for k, value in ratios.items():
        print(f"{k}: {value:.3f}")
    targets = {
        "ringtrain-ray step within 2 % of local": ratios["step ringtrain-ray / ringtrain-local"]
        <= 1.02,
        "ringtrain-ray step below Ray Train": ratios["step ringtrain-ray / raytrain"] < 1.0,
        "ringtrain-ray first step below Ray Train": ratios["first step ringtrain-ray / raytrain"]
        < 1.0,
    }
    for k, ok in targets.items():
        print(f"target {k}: {'met' if ok else 'MISSED'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
                    "runs": runs,
                    "summary": summary,
                    "ratios": ratios,
                    "targets": targets,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
