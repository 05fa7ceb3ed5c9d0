"""Allreduce bus bandwidth: ``hvd.allreduce`` and a fused group of 100 tensors
(``hvd.grouped_allreduce_``) against raw ``torch.distributed.all_reduce`` on the same bytes.

For every message size S (bytes, float32) the W workers time, after a barrier, each of:

- ``raw``: one ``dist.all_reduce`` of S bytes (the ceiling);
- ``hvd``: ``hvd.allreduce(t)`` of S bytes (metadata check + clone + allreduce + average);
- ``fused100``: ``hvd.grouped_allreduce_`` of 100 tensors of S/100 bytes (one metadata check,
  packed into fusion buffers of ``HOROVOD_FUSION_THRESHOLD``, one allreduce per buffer);
- ``raw100``: 100 separate ``dist.all_reduce`` calls of S/100 bytes (what fusion replaces).

A call's time is the slowest rank's; the size's time is the median over ``--repeats`` calls.
busbw = S * 2(W-1)/W / time (bytes/s), the NCCL-tests convention. Targets: fused100 >= 90% of
raw at S >= 1 MB, and fused100 faster than raw100 on small tensors.

Run::

    python benchmarks/allreduce.py                       # 1 KB .. 64 MB, W=2, gloo
    python benchmarks/allreduce.py --max-bytes 4194304 --repeats 5   # quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ringtrain as rt


def probe(config):
    import torch
    import torch.distributed as dist

    import ringtrain.horovod as hvd

    hvd.init()
    n = hvd.size()
    repeats, sizes = int(config["repeats"]), [int(s) for s in config["sizes"]]

    def timed(fn):
        for _ in range(2):
            fn()
        times = torch.zeros(repeats, dtype=torch.float64)
        for i in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            times[i] = time.perf_counter() - start
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        return statistics.median(times.tolist())

    for _ in range(20):
        dist.all_reduce(torch.ones(256))
    metrics = {}
    for size in sizes:
        numel = size // 4
        whole = torch.ones(numel)
        parts = [torch.ones(max(1, numel // 100)) for _ in range(100)]
        metrics[f"raw_{size}"] = timed(lambda whole=whole: dist.all_reduce(whole))
        metrics[f"hvd_{size}"] = timed(lambda whole=whole: hvd.allreduce(whole))
        metrics[f"fused100_{size}"] = timed(lambda parts=parts: hvd.grouped_allreduce_(parts))
        metrics[f"raw100_{size}"] = timed(lambda parts=parts: [dist.all_reduce(p) for p in parts])
    metrics["world_size"] = n
    hvd.shutdown()
    rt.report(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--min-bytes", type=int, default=1 << 10)
    parser.add_argument("--max-bytes", type=int, default=64 << 20)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    sizes, s = [], args.min_bytes
    while s <= args.max_bytes:
        sizes.append(s)
        s *= 4
    with tempfile.TemporaryDirectory() as tmp:
        result = rt.Trainer(
            probe,
            rt.ScalingConfig(num_workers=args.workers),
            rt.RunConfig(name="allreduce", storage_path=tmp, progress="off"),
            train_loop_config={"sizes": sizes, "repeats": args.repeats},
        ).fit()
    m = result.metrics
    w = args.workers
    factor = 2 * (w - 1) / w
    print(f"W={w} gloo, median of {args.repeats}; busbw in MB/s (ratio to raw)")
    print(
        f"{'bytes':>10} {'raw':>9} {'hvd':>15} {'fused100':>15} {'raw100':>15} {'fused/raw100':>12}"
    )
    for size in sizes:

        def bw(key, size=size):
            return size * factor / m[f"{key}_{size}"] / 1e6

        raw = bw("raw")
        print(
            f"{size:>10} {raw:>9.1f} "
            f"{bw('hvd'):>9.1f} ({bw('hvd') / raw:.2f}) "
            f"{bw('fused100'):>9.1f} ({bw('fused100') / raw:.2f}) "
            f"{bw('raw100'):>9.1f} ({bw('raw100') / raw:.2f}) "
            f"{m[f'raw100_{size}'] / m[f'fused100_{size}']:>11.2f}x"
        )


if __name__ == "__main__":
    main()
