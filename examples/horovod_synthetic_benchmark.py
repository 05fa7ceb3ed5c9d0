"""Training throughput with the Horovod API on ringtrain: images per second on random data.

ringtrain's own benchmark script, written against ``horovod.torch`` the way Horovod users
measure throughput (Horovod's code is not vendored here): a ResNet (a stand-in built here, since
torchvision is not a dependency; ``hvd.SyncBatchNorm`` as its norm layer) trained by
``hvd.DistributedOptimizer`` on one fixed random batch of 3x224x224 images, a few warm-up steps,
then ``--num-iters`` timed rounds of ``--num-batches-per-iter`` ``optimizer.step()`` s. Each rank
measures its own rate; ``hvd.allreduce`` of the per-rank rates gives the mean per worker and
(``op=hvd.Sum``) the total.

Run it::

    ringtrain run -np 2 examples/horovod_synthetic_benchmark.py --model resnet18 \\
        --batch-size 8 --num-warmup-batches 2 --num-batches-per-iter 2 --num-iters 3

``benchmarks/hvd_synthetic.py`` runs it against the same loop on plain torch DDP.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import ringtrain.horovod as hvd  # was: import horovod.torch as hvd

Norm = Callable[[int], nn.Module]

# ----------------------------------------------------------------------- the stand-in ResNets

# name -> (residual unit, units per stage); the units are He et al.'s (2016) "basic" (two 3x3)
# and "bottleneck" (1x1, 3x3, 1x1 with 4x wider output) units.
DEPTHS = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
}


class Residual(nn.Module):
    """One residual unit: ``relu(body(x) + shortcut(x))``."""

    def __init__(self, kind: str, c_in: int, width: int, stride: int, norm: Norm) -> None:
        super().__init__()
        c_out = width * (4 if kind == "bottleneck" else 1)
        if kind == "basic":
            layers = [(c_in, width, 3, stride), (width, c_out, 3, 1)]
        else:
            layers = [(c_in, width, 1, 1), (width, width, 3, stride), (width, c_out, 1, 1)]
        body: list[nn.Module] = []
        for i, (a, b, k, s) in enumerate(layers):
            body += [nn.Conv2d(a, b, k, s, k // 2, bias=False), norm(b)]
            if i < len(layers) - 1:
                body.append(nn.ReLU(inplace=True))
        self.body = nn.Sequential(*body)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride, bias=False), norm(c_out)
            )
        self.out_channels = c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def resnet(name: str, norm: Norm = nn.BatchNorm2d, classes: int = 1000) -> nn.Sequential:
    """The ResNet ``name`` (a key of ``DEPTHS``) for 3-channel images, randomly initialised.

    Raises:
        ValueError: an unknown ``name`` (the message lists the known ones).
    """
    if name not in DEPTHS:
        raise ValueError(f"--model {name!r}: expected one of {', '.join(DEPTHS)}")
    kind, counts = DEPTHS[name]
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        norm(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    channels = 64
    for stage, count in enumerate(counts):
        for unit in range(count):
            stride = 2 if stage > 0 and unit == 0 else 1
            block = Residual(kind, channels, 64 * 2**stage, stride, norm)
            layers.append(block)
            channels = block.out_channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes)]
    return nn.Sequential(*layers)


# ------------------------------------------------------------------------------ the benchmark


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Images per second with the Horovod API on ringtrain",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="resnet50", choices=sorted(DEPTHS))
    p.add_argument("--batch-size", type=int, default=32, help="images per worker and step")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="untimed steps first")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="steps per timed round")
    p.add_argument("--num-iters", type=int, default=10, help="timed rounds")
    p.add_argument("--fp16-allreduce", action="store_true", help="hvd.Compression.fp16")
    p.add_argument("--use-adasum", action="store_true", help="refused: no Adasum here")
    return p


def main() -> None:
    args = build_parser().parse_args()
    if args.use_adasum:
        raise SystemExit(
            "--use-adasum: ringtrain.horovod has no Adasum reduction; "
            "drop the flag to average the gradients (hvd.Average)"
        )
    hvd.init()
    torch.manual_seed(1234 + hvd.rank())  # each rank its own random batch
    model = resnet(args.model, norm=hvd.SyncBatchNorm)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size()),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        op=hvd.Average,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    images = torch.randn(args.batch_size, 3, 224, 224)
    labels = torch.randint(0, 1000, (args.batch_size,))

    def steps(n: int) -> float:
        """``n`` training steps; their wall time in seconds."""
        began = time.perf_counter()
        for _ in range(n):
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
        return time.perf_counter() - began

    def say(line: str) -> None:
        if hvd.rank() == 0:
            print(line, flush=True)

    say(f"Model: {args.model}")
    say(f"Batch size: {args.batch_size}")
    say(f"Number of CPUs: {hvd.size()}")
    say(f"Warm-up: {args.num_warmup_batches} step(s)")
    steps(args.num_warmup_batches)
    rates = []
    for i in range(args.num_iters):
        rates.append(args.batch_size * args.num_batches_per_iter / steps(args.num_batches_per_iter))
        say(f"Iter #{i}: {rates[-1]:.1f} img/sec per CPU (rank 0)")
    mine = torch.tensor([statistics.fmean(rates), statistics.pstdev(rates)])
    mean_rate, mean_spread = hvd.allreduce(mine, name="img_per_sec", op=hvd.Average).tolist()
    total = hvd.allreduce(mine[:1], name="img_per_sec_total", op=hvd.Sum).item()
    say(f"Img/sec per CPU: {mean_rate:.1f} +-{1.96 * mean_spread:.1f}")
    say(
        f"Total img/sec on {hvd.size()} CPU(s): {total:.1f} +-{1.96 * mean_spread * hvd.size():.1f}"
    )


if __name__ == "__main__":
    main()
