"""Several fits in a row: one warm pool per fit (the default) vs one ``rt.warm_pool()`` block
shared by all of them vs cold starts, side by side (issue 20: the test suite's time; a notebook
running several fits).

Each round runs, in turn, ``--fits`` consecutive ``Trainer.fit()`` calls of a small DDP job
(``--workers`` ranks, ``--steps`` steps of a linear model) three ways:

- ``per-fit``: ``ScalingConfig(warm_start=True)`` outside any block: each fit starts its own
  zygote (``import torch`` once per fit) and stops it at its end;
- ``block``: the same fits inside one ``with rt.warm_pool():`` (the zygote starts at the first
  fit and stops when the block exits; both are inside the measured time);
- ``cold``: ``warm_start=False``: a fresh interpreter per worker.

Reported per way (medians over ``--repeats`` rounds): wall seconds for all the fits, and CPU
seconds of this process and every process it waited for (driver + zygote + workers +
reapers: ``getrusage`` of self and children), with ratios to ``per-fit``.

    python benchmarks/warm_pool_block.py                   # 4 fits of 2 workers, 5 rounds
    python benchmarks/warm_pool_block.py --fits 8 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import ringtrain as rt


def train_fn(config: dict[str, Any]) -> None:
    import torch

    torch.manual_seed(rt.get_context().world_rank)
    model = rt.prepare_model(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(config["steps"]):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rt.report({"loss": loss.item()})


def _cpu_s() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def _fits(way: str, fits: int, workers: int, steps: int, storage: str, tag: str) -> None:
    scaling = rt.ScalingConfig(num_workers=workers, warm_start=way != "cold")
    block = rt.warm_pool() if way == "block" else contextlib.nullcontext()
    with block:
        for k in range(fits):
            run = rt.RunConfig(name=f"{tag}-{way}-{k}", storage_path=storage, progress="off")
            result = rt.Trainer(train_fn, scaling, run, train_loop_config={"steps": steps}).fit()
            if result.status != "FINISHED":
                raise SystemExit(f"{way} fit {k} ended {result.status}: {result.error}")


@contextlib.contextmanager
def _measure(into: list[tuple[float, float]]) -> Iterator[None]:
    wall, cpu = time.perf_counter(), _cpu_s()
    yield
    into.append((time.perf_counter() - wall, _cpu_s() - cpu))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ways = ("per-fit", "block", "cold")
    samples: dict[str, list[tuple[float, float]]] = {way: [] for way in ways}
    with tempfile.TemporaryDirectory(prefix="rt-warm-pool-") as storage:
        for r in range(args.repeats):
            for way in ways:
                with _measure(samples[way]):
                    _fits(way, args.fits, args.workers, args.steps, storage, f"r{r}")
                wall, cpu = samples[way][-1]
                print(f"round {r} {way:8s} wall {wall:6.2f} s  cpu {cpu:6.2f} s", flush=True)
    base_wall = statistics.median(w for w, _ in samples["per-fit"])
    base_cpu = statistics.median(c for _, c in samples["per-fit"])
    print(
        f"\n{args.fits} fits x {args.workers} workers x {args.steps} steps, "
        f"medians of {args.repeats} rounds"
    )
    print(f"{'way':8s} {'wall s':>8s} {'per fit':>8s} {'ratio':>6s} {'cpu s':>8s} {'ratio':>6s}")
    for way in ways:
        wall = statistics.median(w for w, _ in samples[way])
        cpu = statistics.median(c for _, c in samples[way])
        print(
            f"{way:8s} {wall:8.2f} {wall / args.fits:8.2f} {wall / base_wall:6.2f} "
            f"{cpu:8.2f} {cpu / base_cpu:6.2f}"
        )


if __name__ == "__main__":
    main()
