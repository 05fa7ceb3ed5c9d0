"""``ringtrain bench``: the scaling report of a per-worker script (see :mod:`ringtrain.bench`)."""

from __future__ import annotations

import argparse
from typing import Any

from ringtrain.cli.common import positive_float, positive_int, say

BENCH_HELP = """\
Run SCRIPT (a per-worker script, as for `ringtrain run`) at each worker count
of --workers, --steps timed training steps each (a step = one batch from a
loader made by ringtrain.prepare_data_loader), then a short allreduce
measurement at the largest count, and write the scaling report to --out:
scaling.html (with PNG charts), scaling.json and the charts as PNG files.

Weak scaling: each worker keeps its batch and its torch threads (--threads,
default cores / the largest W). throughput(W) = samples/s summed
over ranks (warm-up steps left out), speedup S(W) = throughput(W) /
throughput(1), efficiency E(W) = S(W) / W. The report splits each step into
data wait, compute, exposed communication, optimizer and other, fits Amdahl's
law and an alpha-beta model of the ring allreduce, predicts E(W) at larger W
for --bandwidth-gbps, and says in words what limits scaling. See
docs/scaling.md. Needs matplotlib: pip install 'ringtrain[bench]'.

Examples:
  ringtrain bench examples/mnist.py --workers 1,2 --steps 60
  ringtrain bench train.py --workers 1,2,4 --steps 100 --bandwidth-gbps 100 -- --lr 0.1
"""


def split_bench_args(argv: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """``ringtrain bench ... -- ARGS``: everything after the first ``--`` goes to the script
    (argparse cannot put options after SCRIPT and a ``--`` list in one positional)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command != "bench" or "--" not in argv:
        return argv, ()
    cut = argv.index("--")
    return argv[:cut], tuple(argv[cut + 1 :])


def _worker_counts(text: str) -> tuple[int, ...]:
    from ringtrain.bench.runner import parse_workers

    try:
        return parse_workers(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--workers: ")) from None


def add_bench_parser(sub: Any) -> None:
    """Add the ``bench`` subcommand to ``sub`` (an ``add_subparsers()`` result)."""
    bench = sub.add_parser(
        "bench",
        help="scaling report: run SCRIPT at several worker counts",
        description=BENCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="ringtrain bench SCRIPT --workers 1,2[,4...] [--steps K] [options] [-- ARGS...]",
    )
    bench.add_argument("script", metavar="SCRIPT", help="the per-worker Python script")
    bench.add_argument(
        "--workers",
        type=_worker_counts,
        required=True,
        metavar="1,2[,4...]",
        help="worker counts to run, comma-separated; must include 1 and a count >= 2",
    )
    bench.add_argument(
        "--steps",
        type=positive_int,
        default=50,
        metavar="K",
        help="timed training steps per run; the first 20%% (at least 2) are warm-up (default: 50)",
    )
    bench.add_argument(
        "--out", default="./scaling", metavar="DIR", help="report directory (default: ./scaling)"
    )
    bench.add_argument(
        "--storage-path",
        default=None,
        help="where the runs' directories go (default: DIR/runs)",
    )
    bench.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads per worker, the same at every W (default: cores / the largest W)",
    )
    bench.add_argument(
        "--bandwidth-gbps",
        type=positive_float,
        default=None,
        metavar="GBPS",
        help="network bandwidth (Gbit/s) to predict efficiency at larger W with "
        "(default: the bandwidth fitted to the allreduce measurement on this machine)",
    )


def cmd_bench(args: argparse.Namespace, script_args: tuple[str, ...]) -> int:
    """``ringtrain bench``: run SCRIPT at each worker count and write the scaling report."""
    from ringtrain.bench.analysis import BenchError
    from ringtrain.bench.runner import BenchConfig, run_bench

    try:
        config = BenchConfig(
            script=args.script,
            workers=args.workers,
            steps=args.steps,
            out_dir=args.out,
            storage_path=args.storage_path,
            bandwidth_gbps=args.bandwidth_gbps,
            script_args=script_args,
            threads=args.threads,
        )
    except ValueError as exc:
        say(f"ringtrain bench: {exc}", err=True)
        return 2
    try:
        run_bench(config)
    except KeyboardInterrupt:
        say("ringtrain bench: interrupted; workers stopped", err=True)
        return 130
    except (BenchError, RuntimeError, ValueError, OSError) as exc:
        say(f"ringtrain bench: {exc}", err=True)
        return 1
    return 0
