"""Hand-written DDP baseline of ``benchmarks/overhead.py``; run it under torchrun::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/_ddp_worker.py \\
        --steps 200 --out /tmp/ddp

Each rank writes its timings to ``{--out}.rank{RANK}.json``.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()  # before torch is imported

import argparse  # noqa: E402
import os  # noqa: E402

import _workload as wl  # noqa: E402  (imports torch)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", required=True, help="prefix of the per-rank JSON files")
    args = parser.parse_args()
    t_entry = time.time()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t_pg = time.time()
    rank = dist.get_rank()

    model = DistributedDataParallel(wl.build_model())
    optimizer = wl.make_optimizer(model)
    x, y = wl.make_batch(rank)
    t_ready = time.time()

    losses: list[tuple[int, float]] = []
    timings = wl.train_loop(
        model, optimizer, x, y, args.steps, lambda step, loss: losses.append((step, loss))
    )
    wl.write_timings(
        args.out,
        rank,
        {
            "variant": "torchrun",
            "rank": rank,
            "world_size": dist.get_world_size(),
            "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "proc_start": wl.proc_start_time(),
            "t_script": T_SCRIPT,
            "t_entry": t_entry,
            "t_pg": t_pg,
            "t_ready": t_ready,
            "losses": losses,
            **timings,
        },
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
