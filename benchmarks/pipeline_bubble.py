"""The pipeline bubble of ``rt.prepare_pipeline``'s schedules, measured against the formula.

Each of ``p`` gloo processes holds one stage (two with Interleaved1F1B) whose forward takes
``t_f`` and backward ``t_b = 2 t_f`` per microbatch, spent in ``time.sleep`` inside a custom
autograd function: the stage's work is then exactly known and does not depend on how many CPU
cores are free (this machine has 2, shared), so what is measured is the schedule (and the p2p
messages between stages), not contention. The ideal, bubble-free step of a rank is its busy time
``m (t_f + t_b)``; the measured bubble fraction is ``1 - busy / step time`` (median over
``--steps`` steps after warm-up, the step being ``schedule.step`` between two barriers), beside
the formula of GPipe and 1F1B, ``(p - 1) / (m + p - 1)`` (Huang et al. 2019; Narayanan et al.
2021), and for Interleaved1F1B with ``v`` stages per rank ``(p - 1) / (v m + p - 1)``.

Run::

    python benchmarks/pipeline_bubble.py                 # p = 2 and 4, m = 1, 2, 4, 8
    python benchmarks/pipeline_bubble.py --pp 2 --tf-ms 10
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
MICROBATCHES = (1, 2, 4, 8)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, t_f: float, t_b: float) -> torch.Tensor:
        ctx.t_b = t_b
        time.sleep(t_f)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.t_b)
        return grad, None, None


class SleepStage(nn.Module):
    """``t_f`` seconds forward, ``t_b`` backward per call; one scalar parameter."""

    def __init__(self, t_f: float, t_b: float) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(()))
        self.t_f, self.t_b = t_f, t_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x * self.w, self.t_f, self.t_b)


def formula(p: int, m: int, v: int = 1) -> float:
    """The bubble fraction of GPipe/1F1B (``v = 1``) and interleaved 1F1B."""
    return (p - 1) / (v * m + p - 1)


def _worker(rank: int, p: int, port: int, args: argparse.Namespace, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from ringtrain.parallel.pipeline import prepare_pipeline

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=p)
    mesh = init_device_mesh(
        "cpu", (p, 1, 1, 1), mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp")
    )
    t_f = args.tf_ms / 1000
    rows = []
    for schedule in SCHEDULES:
        v = 2 if schedule == "Interleaved1F1B" else 1
        for m in MICROBATCHES:
            if schedule != "GPipe" and m < p:
                continue  # torch's 1F1B schedules need m >= p
            n = p * v
            model = nn.Sequential(*(SleepStage(t_f, 2 * t_f) for _ in range(n)))
            split = [str(i) for i in range(1, n)]
            stage = prepare_pipeline(
                model, split, m, schedule, stages_per_rank=v if v > 1 else None, mesh=mesh
            )
            x, y = torch.zeros(m, 4), torch.zeros(m, 4)
            times = []
            for k in range(args.warmup + args.steps):
                dist.barrier()
                start = time.perf_counter()
                stage.step(x, target=y, loss_fn=nn.functional.mse_loss)
                dist.barrier()
                if k >= args.warmup:
                    times.append(time.perf_counter() - start)
            step = statistics.median(times)
            busy = m * v * 3 * t_f
            rows.append(
                {
                    "p": p,
                    "schedule": schedule,
                    "m": m,
                    "step_ms": step * 1000,
                    "ideal_ms": busy * 1000,
                    "measured": 1 - busy / step,
                    "formula": formula(p, m, v),
                }
            )
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(p: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        mp.start_processes(_worker, (p, _free_port(), args, out), nprocs=p, start_method="spawn")
        with open(out) as f:
            rows: list[dict[str, Any]] = json.load(f)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tf-ms", type=float, default=20.0, help="forward time per microbatch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(f"t_f = {args.tf_ms} ms, t_b = {2 * args.tf_ms} ms per microbatch and stage")
    print("| p | schedule | m | step (ms) | ideal (ms) | bubble measured | formula | diff |")
    print("|---|---|---|---|---|---|---|---|")
    for p in args.pp:
        for r in run(p, args):
            print(
                f"| {r['p']} | {r['schedule']} | {r['m']} | {r['step_ms']:.0f} | "
                f"{r['ideal_ms']:.0f} | {r['measured']:.3f} | {r['formula']:.3f} | "
                f"{r['measured'] - r['formula']:+.3f} |"
            )


if __name__ == "__main__":
    main()
