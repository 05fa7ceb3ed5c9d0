"""The Horovod-API synthetic benchmark on ringtrain.horovod vs the same loop on plain torch DDP.

Two programs, the same model, batch and step counts, both started by ``ringtrain run -np 2``
(so the launcher, the torch thread count (1 per worker on 2 cores) and the process group are
the same):

* ``hvd``: ``examples/horovod_synthetic_benchmark.py``, ringtrain's script written against
  Horovod's API the way Horovod's ``pytorch_synthetic_benchmark.py`` measures throughput
  (``hvd.DistributedOptimizer`` averages the gradients, ``hvd.SyncBatchNorm`` layers);
* ``ddp``: ``benchmarks/_hvd_synthetic_ddp.py``, the same loop with
  ``torch.nn.parallel.DistributedDataParallel`` (and the same ``hvd.SyncBatchNorm``: torch's
  ``nn.SyncBatchNorm`` refuses CPU tensors).

Each run prints ``Total img/sec on 2 CPU(s): X``; runs alternate (hvd, ddp, hvd, ...),
and the summary is the median of each over ``--repeats`` runs, with the ratio hvd / ddp (1.0 =
as fast as DDP) of the medians and the median of the per-pair ratios (each hvd run against the
ddp run right after it: robust to a machine load that drifts during the benchmark), and the CPU
seconds each run used (driver and workers, start-up included: less sensitive than img/s to
other processes on the machine, as long as they do not share the cores' caches). The model
is the stand-in ResNet of ``examples/horovod_synthetic_benchmark.py`` (torchvision is not
installed), on 3x224x224 random images.

Usage::

    python benchmarks/hvd_synthetic.py                       # resnet18, batch 2, 3 repeats
    python benchmarks/hvd_synthetic.py --model resnet50 --batch-size 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = {
    "hvd": ROOT / "examples" / "horovod_synthetic_benchmark.py",
    "ddp": ROOT / "benchmarks" / "_hvd_synthetic_ddp.py",
}
TOTAL = re.compile(r"Total img/sec on (\d+) CPU\(s\): ([0-9.]+)")


def run_once(program: Path, args: argparse.Namespace, storage: str) -> tuple[float, float]:
    """One ``ringtrain run -np N`` of ``program``: its total img/s, and the CPU seconds (user +
    system) of the whole run, driver and workers (reaped descendants), start-up included."""
    cmd = [
        sys.executable,
        "-m",
        "ringtrain.cli",
        "run",
        "-np",
        str(args.np),
        "--storage-path",
        storage,
        "--progress",
        "off",
        str(program),
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--num-warmup-batches",
        str(args.warmup),
        "--num-batches-per-iter",
        str(args.batches_per_iter),
        "--num-iters",
        str(args.iters),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = proc.stdout + proc.stderr
    match = TOTAL.search(text)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"{program.name} failed ({proc.returncode}):\n{text[-3000:]}")
    return float(match.group(2)), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2, help="workers (default 2)")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch-size", type=int, default=2, help="per worker")
    parser.add_argument("--warmup", type=int, default=1, help="--num-warmup-batches")
    parser.add_argument("--batches-per-iter", type=int, default=2)
    parser.add_argument("--iters", type=int, default=3, help="--num-iters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the raw numbers here")
    args = parser.parse_args()

    results: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    cpu: dict[str, list[float]] = {name: [] for name in PROGRAMS}
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="hvd-synthetic-") as storage:
        for repeat in range(args.repeats):
            for name, program in PROGRAMS.items():
                value, seconds = run_once(program, args, storage)
                results[name].append(value)
                cpu[name].append(seconds)
                print(f"repeat {repeat}: {name} {value:.2f} img/s, {seconds:.1f} CPU s", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    ratio = medians["hvd"] / medians["ddp"]
    # each hvd run and the ddp run right after it saw about the same machine load
    paired = statistics.median(h / d for h, d in zip(results["hvd"], results["ddp"], strict=True))
    print(
        f"\n{args.model}, batch {args.batch_size}/worker, {args.np} workers, "
        f"{args.iters}x{args.batches_per_iter} timed steps after {args.warmup} warm-up, "
        f"{args.repeats} repeats ({time.time() - started:.0f} s in all), {platform.machine()}"
    )
    print("| program | total img/s (median) | runs | CPU s per run (median) | runs |")
    print("|---|---|---|---|---|")
    for name, values in results.items():
        runs = ", ".join(f"{v:.2f}" for v in values)
        cpus = ", ".join(f"{v:.1f}" for v in cpu[name])
        row = f"{medians[name]:.2f} | {runs} | {statistics.median(cpu[name]):.1f} | {cpus}"
        print(f"| {name} | {row} |")
    print(f"\nratio hvd / ddp = {ratio:.3f} (of the medians), {paired:.3f} (median of the pairs)")
    if args.json:
        summary = {
            "args": vars(args),
            "runs": results,
            "cpu_s": cpu,
            "ratio": ratio,
            "paired_ratio": paired,
        }
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
