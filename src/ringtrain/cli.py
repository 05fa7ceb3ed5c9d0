"""The ``ringtrain`` command: ``run``, ``ls``, ``show``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

DESCRIPTION = """\
ringtrain runs a PyTorch training job as N data-parallel worker processes,
collects every worker's metrics and checkpoints into a run directory, and
reports which rank failed and why.

  ringtrain run -n 2 train.py --lr 0.01    run a per-worker script on 2 workers
  ringtrain ls                             list the runs under ./runs
  ringtrain show runs/train_2026-11-21_12-00-00
                                           metrics, checkpoints and failures of one run

Python API: ringtrain.Trainer(train_fn, ScalingConfig(...), RunConfig(...)).fit()
"""

RUN_HELP = """\
Start N worker processes, each running SCRIPT as __main__ with the variables
torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Inside the script, plain torch.distributed works
(init_process_group() with no arguments), and so do ringtrain.get_context(),
ringtrain.report(metrics, checkpoint) and ringtrain.prepare_model(); a script
that calls ringtrain.Trainer(...).fit() runs its train function in place as
its rank. Everything after SCRIPT is passed to the script unchanged.

A worker that raises, exits, is killed or hangs stops the group; with
--max-failures K the group restarts up to K times and every rank resumes from
the latest valid checkpoint (ringtrain.TrainState makes that bit-exact). If the
driver itself dies, `ringtrain run --resume RUN_DIR` continues the run.

Examples:
  ringtrain run -n 2 examples/mnist.py --epochs 3
  ringtrain run -n 2 --max-failures 3 --name exact examples/mnist.py
  ringtrain run --resume runs/exact
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringtrain",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ringtrain import __version__

    parser.add_argument("--version", action="version", version=f"ringtrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="run a per-worker script on N workers",
        description=RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument(
        "-n",
        "-np",
        "--num-workers",
        dest="num_workers",
        type=_positive_int,
        default=None,
        help="number of worker processes, the world size (default: 1)",
    )
    run.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR (after its driver died, or to retry a failed run) "
        "from its latest valid checkpoint, with the script, arguments and settings it was "
        "started with; options given here override them",
    )
    run.add_argument("--name", help="run name (default: SCRIPT's stem and a timestamp)")
    run.add_argument(
        "--storage-path", default="./runs", help="where run directories go (default: ./runs)"
    )
    run.add_argument("--gpu", action="store_true", help="one CUDA device per worker (NCCL)")
    run.add_argument(
        "--threads", type=_positive_int, help="torch threads per worker (default: cores / N)"
    )
    run.add_argument(
        "--max-failures",
        type=int,
        default=None,
        help="restart the workers after up to this many failures (-1: forever; default: 0)",
    )
    run.add_argument(
        "--num-to-keep",
        type=_positive_int,
        help="keep this many best checkpoints (plus the latest; default: all)",
    )
    run.add_argument(
        "--checkpoint-score-attribute",
        metavar="METRIC",
        help="rank checkpoints by this reported metric (default: recency)",
    )
    run.add_argument(
        "--checkpoint-score-order",
        choices=("max", "min"),
        default="max",
        help="keep the highest (max) or lowest (min) scores (default: max)",
    )
    run.add_argument(
        "--progress",
        choices=("auto", "rich", "plain", "off"),
        default="auto",
        help="live display on a terminal, log lines otherwise (default: auto)",
    )
    run.add_argument(
        "--worker-timeout",
        type=float,
        metavar="SECONDS",
        help="fail a worker that makes no progress for this long (default: 600; 0: never)",
    )
    run.add_argument(
        "--sync-checkpoints",
        action="store_true",
        help="write TrainState checkpoints before report() returns (default: in the background)",
    )
    run.add_argument("script", nargs="?", metavar="SCRIPT", help="the per-worker Python script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="its arguments")

    ls = sub.add_parser(
        "ls",
        help="list runs with status, duration and last metrics",
        description="List the runs under STORAGE (a directory or fsspec URL).",
    )
    ls.add_argument("storage", nargs="?", default="./runs", help="default: ./runs")

    show = sub.add_parser(
        "show",
        help="show one run: config, metrics per round, checkpoints, failures",
        description="Show one run directory: its config, a table of rank 0's metrics per "
        "round, its checkpoints and its failures.",
    )
    show.add_argument("run_dir", metavar="RUN_DIR")
    show.add_argument("--rounds", type=_positive_int, default=30, help="last N rounds (default 30)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "run":
        return _cmd_run(args, parser)
    if args.command == "ls":
        return _cmd_ls(args)
    return _cmd_show(args)


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import dataclasses

    from ringtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    saved = None
    if args.resume is not None:
        if args.script is not None:
            parser.error("--resume RUN_DIR continues a run with its own SCRIPT; give no SCRIPT")
        from ringtrain.trainer import load_saved_run

        try:
            saved = load_saved_run(args.resume)
        except (FileNotFoundError, ValueError, TypeError) as exc:
            parser.error(f"--resume: {exc}")
    elif args.script is None:
        parser.error("give SCRIPT to run, or --resume RUN_DIR")
    elif not os.path.isfile(args.script):
        parser.error(f"SCRIPT {args.script!r} is not a file")
    try:
        if saved is not None:
            scaling = saved.scaling_config
            if args.num_workers is not None:
                scaling = dataclasses.replace(scaling, num_workers=args.num_workers)
            failure = saved.run_config.failure_config
            checkpoint = saved.run_config.checkpoint_config
        else:
            scaling = ScalingConfig(
                num_workers=args.num_workers or 1,
                use_gpu=args.gpu,
                resources_per_worker={"CPU": args.threads} if args.threads else None,
            )
            failure = FailureConfig()
            checkpoint = CheckpointConfig(
                num_to_keep=args.num_to_keep,
                checkpoint_score_attribute=args.checkpoint_score_attribute,
                checkpoint_score_order=args.checkpoint_score_order,
            )
        if args.max_failures is not None:
            failure = dataclasses.replace(failure, max_failures=args.max_failures)
        if args.worker_timeout is not None:
            failure = dataclasses.replace(failure, worker_timeout_s=args.worker_timeout or None)
        if args.sync_checkpoints:
            checkpoint = dataclasses.replace(checkpoint, async_save=False)
        run_config = RunConfig(
            name=saved.name if saved else args.name,
            storage_path=saved.storage_path if saved else args.storage_path,
            failure_config=failure,
            checkpoint_config=checkpoint,
            progress=args.progress,
        )
        from ringtrain.trainer import default_run_name, run_workers, validate_gpus

        validate_gpus(scaling)
    except (TypeError, ValueError) as exc:
        parser.error(str(exc))
    if saved is not None:
        name, entrypoint = saved.name, saved.entrypoint
        script, script_args = saved.script, saved.script_args
    else:
        script = os.path.abspath(str(args.script))
        entrypoint, script_args = str(args.script), tuple(args.script_args)
        name = run_config.name or default_run_name(os.path.splitext(os.path.basename(script))[0])
    try:
        result = run_workers(
            name=name,
            entrypoint=entrypoint,
            scaling_config=scaling,
            run_config=run_config,
            payload=saved.payload if saved is not None and script is None else None,
            script=script,
            script_args=script_args,
            train_loop_config=saved.train_loop_config if saved is not None else None,
        )
    except KeyboardInterrupt as exc:
        from ringtrain.trainer import DriverTerminated

        terminated = isinstance(exc, DriverTerminated)
        print(f"ringtrain: run stopped ({exc or 'interrupted'}); workers stopped", file=sys.stderr)
        return 128 + (15 if terminated else 2)
    except (RuntimeError, ValueError) as exc:
        print(f"ringtrain run: {exc}", file=sys.stderr)
        return 2
    if result.error is not None:
        print(f"ringtrain: run failed: {result.error}", file=sys.stderr)
        return 1
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ringtrain.monitor.runs import list_runs, render_runs

    try:
        runs = list_runs(args.storage)
    except FileNotFoundError as exc:
        print(f"ringtrain ls: {exc}", file=sys.stderr)
        return 1
    render_runs(runs, Console())
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ringtrain.monitor.runs import load_run, render_run

    try:
        details = load_run(args.run_dir)
    except FileNotFoundError as exc:
        print(f"ringtrain show: {exc}", file=sys.stderr)
        return 1
    render_run(details, Console(), max_rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
