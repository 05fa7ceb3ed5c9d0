"""The baseline of ``hvd_synthetic.py``: the synthetic benchmark's loop on plain torch DDP.

The same model (``resnet(--model)`` of ``examples/horovod_synthetic_benchmark.py`` with
``hvd.SyncBatchNorm``: torch's own ``nn.SyncBatchNorm`` refuses CPU tensors, and ringtrain's is
plain ``torch.distributed``; DDP's GPU-only check of SyncBatchNorm layers is skipped), the same
fixed random batch, SGD at ``lr=0.01 * world size``, the same warm-up/iteration counts, and the
same result lines as that example (the total is the sum of the ranks' rates there and here);
only the gradient averaging differs:
``torch.nn.parallel.DistributedDataParallel`` (bucketed allreduce overlapped with backward)
instead of ``hvd.DistributedOptimizer``. Started like the example (``ringtrain run -np 2``,
which sets the torchrun variables), so the launcher is the same.
"""

from __future__ import annotations

import argparse
import os
import sys
import timeit

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import optim
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from horovod_synthetic_benchmark import resnet

from ringtrain.horovod import SyncBatchNorm

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark on DDP")
parser.add_argument("--model", type=str, default="resnet50")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--num-warmup-batches", type=int, default=10)
parser.add_argument("--num-batches-per-iter", type=int, default=10)
parser.add_argument("--num-iters", type=int, default=10)


def main() -> None:
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # as the example: each rank its own random batch
    # DDP refuses any nn.SyncBatchNorm outside a GPU (torch's own cannot run on CPU); ringtrain's
    # subclass can, so skip that check to train the very model the Horovod example trains.
    DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None  # type: ignore[method-assign]
    model = DistributedDataParallel(resnet(args.model, norm=SyncBatchNorm))
    optimizer = optim.SGD(model.parameters(), lr=0.01 * size)
    data = torch.randn(args.batch_size, 3, 224, 224)
    target = torch.randint(0, 1000, (args.batch_size,))

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(s: str) -> None:
        if rank == 0:
            print(s, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of CPUs: {size}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log(f"Iter #{x}: {img_sec:.1f} img/sec per CPU")
        img_secs.append(img_sec)
    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    log(f"Img/sec per CPU: {mean:.1f} +-{conf:.1f}")
    total = torch.tensor([mean])
    dist.all_reduce(total)  # the sum of the ranks' rates, as the example's hvd.allreduce(op=Sum)
    log(f"Total img/sec on {size} CPU(s): {total.item():.1f} +-{size * conf:.1f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
