"""ringtrain variant of ``benchmarks/overhead.py``: the workload of ``_workload.py`` as a ringtrain
train function, started with ``rt.Trainer(...).fit()``::

    python benchmarks/_ringtrain_driver.py --steps 200 --out /tmp/rt --storage-path /tmp/runs

``benchmarks/multihost_ddp.py`` runs it with ``--workers 3 --backend ray --address auto
--placement SPREAD`` on three namespace hosts.

Each rank writes its timings to ``{--out}.rank{RANK}.json``; the driver writes its own time stamps
to ``{--out}.driver.json``.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()  # before torch and ringtrain are imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from typing import Any  # noqa: E402

import _workload as wl  # noqa: E402  (imports torch)
import torch  # noqa: E402

import ringtrain as rt  # noqa: E402


def train_fn(config: dict[str, Any]) -> None:
    t_entry = time.time()  # the worker bootstrap already initialised the process group
    torch.set_num_threads(1)
    ctx = rt.get_context()

    model = rt.prepare_model(wl.build_model())
    optimizer = wl.make_optimizer(model)
    x, y = wl.make_batch(ctx.world_rank)
    t_ready = time.time()

    losses: list[tuple[int, float]] = []

    def on_report(step: int, loss: float) -> None:
        losses.append((step, loss))
        rt.report({"step": step, "loss": loss})

    timings = wl.train_loop(model, optimizer, x, y, config["steps"], on_report)
    wl.write_timings(
        config["out"],
        ctx.world_rank,
        {
            "variant": "ringtrain",
            "rank": ctx.world_rank,
            "world_size": ctx.world_size,
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "proc_start": wl.proc_start_time(),
            "t_entry": t_entry,
            "t_pg": t_entry,
            "t_ready": t_ready,
            "losses": losses,
            **timings,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", required=True, help="prefix of the per-rank JSON files")
    parser.add_argument("--storage-path", required=True, help="RunConfig.storage_path")
    parser.add_argument("--workers", type=int, default=2, help="ScalingConfig.num_workers")
    parser.add_argument("--backend", default="local", help="ScalingConfig.backend")
    parser.add_argument("--address", default=None, help="ScalingConfig.ray_address (Ray)")
    parser.add_argument("--placement", default="PACK", help="ScalingConfig.placement_strategy")
    args = parser.parse_args()
    ray_args: dict[str, Any] = {}
    if args.backend == "ray":
        ray_args = {"ray_address": args.address, "placement_strategy": args.placement}
    t_fit_start = time.time()
    result = rt.Trainer(
        train_fn,
        rt.ScalingConfig(
            num_workers=args.workers,
            resources_per_worker={"CPU": 1},
            backend=args.backend,
            **ray_args,
        ),
        rt.RunConfig(name="overhead", storage_path=args.storage_path, progress="off"),
        train_loop_config={"steps": args.steps, "out": args.out},
    ).fit()
    t_fit_end = time.time()
    with open(f"{args.out}.driver.json", "w") as f:
        json.dump(
            {
                "t_script": T_SCRIPT,
                "t_fit_start": t_fit_start,
                "t_fit_end": t_fit_end,
                "metrics": result.metrics,
            },
            f,
        )


if __name__ == "__main__":
    main()
