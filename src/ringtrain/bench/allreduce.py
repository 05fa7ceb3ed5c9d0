"""A short allreduce measurement: the data the alpha-beta model is fitted to.

A separate ringtrain job of W workers (the same launcher, backend and process group the training
runs use) times ``torch.distributed.all_reduce`` of float32 tensors of several sizes. For every
size: a few untimed warm-up calls, then ``repeats`` timed calls, each started after a barrier so
that all ranks enter together; a call's time is the slowest rank's (an allreduce is done when
the last rank has its result), and the size's time is the median over the repeats. Twenty small
allreduces before all that set up the connections and buffers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ringtrain.bench.analysis import AllreduceSample, BenchError

__all__ = ["DEFAULT_SIZES", "measure_allreduce", "probe"]

#: Message sizes (bytes): 4 KB to 16 MB, by factors of 4.
DEFAULT_SIZES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)


def probe(config: dict[str, Any]) -> None:
    """The train function of the measurement job (runs on every rank).

    Args:
        config: ``sizes`` (bytes, multiples of 4), ``repeats`` and ``warmup`` (calls per size).

    Reports one round on every rank: ``{"bytes_<n>": seconds, "bytes_<n>_p10": ...,
    "bytes_<n>_p90": ..., ...}``: the median, 10th and 90th percentiles over the repeats of the
    slowest rank's time of each call.
    """
    import torch
    import torch.distributed as dist

    import ringtrain as rt

    sizes = [int(n) for n in config["sizes"]]
    repeats, warmup = int(config["repeats"]), int(config["warmup"])
    metrics: dict[str, float] = {}
    small = torch.ones(256, dtype=torch.float32)
    for _ in range(20):  # the first collectives set up connections and buffers
        dist.all_reduce(small)
    for nbytes in sizes:
        tensor = torch.ones(nbytes // 4, dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        times = torch.zeros(repeats, dtype=torch.float64)
        for i in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(tensor)
            times[i] = time.perf_counter() - start
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        metrics[f"bytes_{nbytes}"] = float(times.median())
        low, high = torch.quantile(times, torch.tensor([0.1, 0.9], dtype=times.dtype)).tolist()
        metrics[f"bytes_{nbytes}_p10"], metrics[f"bytes_{nbytes}_p90"] = low, high
    rt.report(metrics)


def measure_allreduce(
    workers: int,
    *,
    storage_path: str,
    name: str,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = 20,
    warmup: int = 3,
    threads: int | None = None,
) -> tuple[list[AllreduceSample], str]:
    """Run the measurement job on ``workers`` local workers and return its samples.

    Args:
        workers: W (>= 2).
        storage_path: where the job's run directory goes (local path or fsspec URL).
        name: the job's run name (a directory name).
        sizes: message sizes (bytes; each a positive multiple of 4).
        repeats: timed calls per size (>= 1).
        warmup: untimed calls per size before them (>= 0).
        threads: torch threads per worker (default: cores / workers).

    Returns:
        One sample per size (its median time, and the 10th and 90th percentiles, in seconds),
        and the job's run directory.

    Raises:
        BenchError: ``workers`` < 2, a bad size, or the job failed (the message names its run
            directory).
    """
    from ringtrain.config import MonitorConfig, RunConfig, ScalingConfig
    from ringtrain.trainer import Trainer

    if workers < 2:
        raise BenchError(f"an allreduce needs at least 2 workers, got {workers}")
    bad = [n for n in sizes if n <= 0 or n % 4]
    if bad:
        raise BenchError(f"allreduce sizes must be positive multiples of 4 bytes, got {bad}")
    result = Trainer(
        probe,
        ScalingConfig(
            num_workers=workers,
            resources_per_worker={"CPU": threads} if threads is not None else None,
        ),
        RunConfig(
            name=name,
            storage_path=storage_path,
            progress="off",
            monitor_config=MonitorConfig(timing=False, tensorboard=False, csv=False),
        ),
        train_loop_config={"sizes": list(sizes), "repeats": repeats, "warmup": warmup},
    ).fit(raise_on_error=False)
    if result.error is not None:
        raise BenchError(f"the allreduce measurement job failed ({result.path}): {result.error}")
    samples = []
    for nbytes in sizes:
        seconds = result.metrics.get(f"bytes_{nbytes}")
        if not isinstance(seconds, (int, float)):
            raise BenchError(
                f"the allreduce measurement job ({result.path}) reported no time for {nbytes} B"
            )
        low, high = (result.metrics.get(f"bytes_{nbytes}_{q}") for q in ("p10", "p90"))
        samples.append(
            AllreduceSample(
                nbytes=int(nbytes),
                workers=workers,
                seconds=float(seconds),
                low_s=float(low) if isinstance(low, (int, float)) else None,
                high_s=float(high) if isinstance(high, (int, float)) else None,
            )
        )
    return samples, str(result.path)
