"""What preemption readiness costs per step, and how fast a notice becomes a saved checkpoint.

1. **Per-step cost of the stop-step agreement** (:class:`ringtrain.worker.preempt.
   PreemptionPlugin`: one MAX allreduce of a 4-byte int at every ``TrainState.step``): W gloo
   processes time (a) the flag allreduce alone, blocking, and (b) a small DDP training step
   without it, with it blocking, and with it pipelined as the plug-in does (started
   asynchronously at one boundary, read at the next), side by side in the same processes
   (interleaved blocks, medians of the blocks).
2. **Notice to saved**: a real ``Trainer.fit`` at W=2 gets SIGTERM at a step; the
   ``preemption_saved`` event's ``saved_s`` (notice -> every worker saved its TrainState and
   exited) and the steps lost (always 0: the checkpoint is at the stop step).

    python benchmarks/preemption.py [--workers 2] [--blocks 7] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def _flag(box: torch.Tensor) -> bool:
    """A blocking flag allreduce (the naive way: what a step would wait for)."""
    box.fill_(0)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return bool(box.item())


class Pipelined:
    """What ``PreemptionPlugin._agreed`` does at each boundary: read the allreduce started at
    the previous one, start this one asynchronously."""

    def __init__(self) -> None:
        self.pending: tuple[object, torch.Tensor] | None = None

    def __call__(self) -> bool:
        agreed = False
        if self.pending is not None:
            work, box = self.pending
            work.wait()  # type: ignore[attr-defined]
            agreed = bool(box.item())
        box = torch.zeros(1, dtype=torch.int32)
        self.pending = (dist.all_reduce(box, op=dist.ReduceOp.MAX, async_op=True), box)
        return agreed


def _worker(rank: int, world: int, port: int, blocks: int, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 64), torch.randint(0, 8, (32,))
    box = torch.zeros(1, dtype=torch.int32)
    pipelined = Pipelined()

    def step(flag: str) -> None:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if flag == "blocking":
            _flag(box)
        elif flag == "pipelined":
            pipelined()

    for _ in range(20):
        step("blocking")
    flag_us: list[float] = []
    times: dict[str, list[float]] = {"none": [], "blocking": [], "pipelined": []}
    for _ in range(blocks):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            _flag(box)
        flag_us.append((time.perf_counter() - t) / steps * 1e6)
        for flag, into in times.items():
            dist.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                step(flag)
            into.append((time.perf_counter() - t) / steps * 1e3)
    if pipelined.pending is not None:
        pipelined.pending[0].wait()  # type: ignore[attr-defined]  # the last one started
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"flag_us": flag_us, **times}, f)
    dist.destroy_process_group()


def per_step_cost(world: int, blocks: int, steps: int) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world, port, blocks, steps, out), nprocs=world, join=True)
        with open(out) as f:
            return json.load(f)


def notice_to_saved(world: int) -> dict:
    import preempt_workloads
    from support import read_events, run_job

    with tempfile.TemporaryDirectory() as tmp:
        config = {
            "epochs": 2,
            "out": os.path.join(tmp, "out.pt"),
            "kill": None,
            "kill_rank": 0,
            "marker": os.path.join(tmp, "marker"),
            "how": "driver-SIGTERM",
            "notice_step": 6,
        }
        result = run_job(
            preempt_workloads.preempt_fn,
            world,
            storage_path=os.path.join(tmp, "runs"),
            name="bench",
            train_loop_config=config,
        )
        (saved,) = read_events(os.path.join(tmp, "runs", "bench"), "preemption_saved")
        return {"status": result.status, "step": saved["step"], "saved_s": saved["saved_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--saves", type=int, default=3, help="notice-to-saved runs")
    args = parser.parse_args()
    cost = per_step_cost(args.workers, args.blocks, args.steps)
    flag = statistics.median(cost["flag_us"])
    plain = statistics.median(cost["none"])
    print(f"W={args.workers}, {args.blocks} blocks x {args.steps} steps (medians of the blocks)")
    print(f"  flag allreduce alone, blocking      {flag:8.1f} us")
    print(f"  DDP step, no flag                   {plain * 1e3:8.1f} us")
    for how in ("blocking", "pipelined"):
        t = statistics.median(cost[how])
        print(
            f"  DDP step + {how:9s} flag          {t * 1e3:8.1f} us  "
            f"(ratio {t / plain:.3f}, +{(t - plain) * 1e3:.1f} us)"
        )
    saves = [notice_to_saved(args.workers) for _ in range(args.saves)]
    secs = [s["saved_s"] for s in saves]
    print(
        f"notice -> every worker saved and exited: median {statistics.median(secs):.3f} s "
        f"(runs: {', '.join(f'{s:.3f}' for s in secs)}); statuses "
        f"{sorted({s['status'] for s in saves})}; steps lost: 0 (saved at steps "
        f"{[s['step'] for s in saves]})"
    )


if __name__ == "__main__":
    main()
