"""Allreduce bus bandwidth across hosts, the worker of ``benchmarks/multihost_ddp.py``; run it
under torchrun on every host::

    torchrun --nnodes 3 --node-rank I --nproc-per-node 1 --master-addr ADDR --master-port P \\
        benchmarks/_mh_allreduce_worker.py --sizes 1048576,8388608 --repeats 5 --out /tmp/ar.json

For each size S (bytes of float32) the ranks time ``--repeats`` calls of ``dist.all_reduce``
after a barrier each; a call's time is the slowest rank's (an all-reduce of the durations with
MAX). Rank 0 writes ``{"world_size": W, "sizes": {S: [seconds, ...]}}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--sizes", default="1048576,8388608,33554432", help="bytes, comma-separated"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict[str, list[float]] = {}
    for size in (int(s) for s in args.sizes.split(",")):
        t = torch.ones(size // 4)
        dist.all_reduce(t)  # warm-up: the connections' buffers
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times.append(float(took))
        out[str(size)] = times
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"world_size": dist.get_world_size(), "sizes": out}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
