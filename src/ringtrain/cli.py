"""The ``ringtrain`` command: ``run``, ``tune``, ``ls``, ``show``, ``bench``, ``dashboard``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

DESCRIPTION = """\
ringtrain runs a PyTorch training job as N data-parallel worker processes,
collects every worker's metrics and checkpoints into a run directory, and
reports which rank failed and why.

  ringtrain run -n 2 train.py --lr 0.01    run a per-worker script on 2 workers
  ringtrain ls                             list the runs under ./runs
  ringtrain show runs/train_2026-11-21_12-00-00
                                           metrics, checkpoints and failures of one run
  ringtrain bench train.py --workers 1,2 --steps 50
                                           scaling report: speedup, efficiency, limits
  ringtrain dashboard                      live web dashboard of the runs under ./runs
  ringtrain tune sweep.py                  hyperparameter sweep; every trial is an N-worker run
  ringtrain chaos train.py --workers 2,3   verify exact resume under random kills and hangs

Python API: ringtrain.Trainer(train_fn, ScalingConfig(...), RunConfig(...)).fit()
"""

RUN_HELP = """\
Start N worker processes, each running SCRIPT as __main__ with the variables
torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). Inside the script, plain torch.distributed works
(init_process_group() with no arguments), and so do ringtrain.get_context(),
ringtrain.report(metrics, checkpoint) and ringtrain.prepare_model(); a script
that calls ringtrain.Trainer(...).fit() runs its train function in place as
its rank. Everything after SCRIPT is passed to the script unchanged, except
that ringtrain's own options go before SCRIPT: `ringtrain run train.py -n 2`
is refused when train.py does not define -n itself (put `--` after SCRIPT to
pass such options to the script anyway: `ringtrain run train.py -- -n 2`).

Errors in the configuration or the command line are one line naming the flag
to change; --debug (or RINGTRAIN_DEBUG=1) adds the traceback. A worker's
exception is printed once, as that rank's own traceback, with the other ranks'
follow-on failures (a lost connection) folded into one line each.

A worker that raises, exits, is killed or hangs stops the group; with
--max-failures K the group restarts up to K times and every rank resumes from
the latest valid checkpoint (ringtrain.TrainState makes that bit-exact). If the
driver itself dies, `ringtrain run --resume RUN_DIR` continues the run.

Examples:
  ringtrain run -n 2 examples/mnist.py --epochs 3
  ringtrain run -n 2 --max-failures 3 --name exact examples/mnist.py
  ringtrain run --resume runs/exact
  ringtrain run --backend ray --address auto -n 8 train.py    (on a Ray cluster)
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (``ringtrain run: argument -n: must be >= 1, got 0 (see
    ringtrain run --help)``), not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("ringtrain").strip()
        print(
            f"{self.prog}: {message} (see `{self.prog} --help`)"
            if not command
            else f"ringtrain {command}: {message} (see `{self.prog} --help`)",
            file=sys.stderr,
        )
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="ringtrain",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ringtrain import __version__

    parser.add_argument("--version", action="version", version=f"ringtrain {__version__}")
    parser.add_argument(
        "--debug",
        dest="debug_all",
        action="store_true",
        help="show the traceback of configuration and usage errors (also RINGTRAIN_DEBUG=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_OneLineParser)

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
    run.add_argument(
        "--signing-key-file",
        metavar="PATH",
        help="the private key (mode 0600) that signs and checks checkpoints, config.json and "
        "payload.pkl (default: $RINGTRAIN_SIGNING_KEY, else ~/.config/ringtrain/signing.key; "
        "docs/security.md)",
    )
    run.add_argument(
        "--trust-unsigned",
        action="store_true",
        help="accept a run directory or checkpoints not signed with the key (a warning each "
        "time): only if you trust everyone who can write the storage",
    )
    run.add_argument("--name", help="run name (default: SCRIPT's stem and a timestamp)")
    run.add_argument(
        "--storage-path", default="./runs", help="where run directories go (default: ./runs)"
    )
    run.add_argument("--gpu", action="store_true", help="one CUDA device per worker (NCCL)")
    run.add_argument(
        "--backend",
        choices=("local", "ray"),
        default=None,
        help="where workers run: processes on this machine (local, the default) or Ray actors "
        "on a Ray cluster (ray; pip install 'ringtrain[ray]')",
    )
    run.add_argument(
        "--address",
        metavar="RAY_ADDRESS",
        help="the Ray cluster to join: auto, or HOST:PORT (implies --backend ray; default: "
        "RAY_ADDRESS, else a Ray started on this machine)",
    )
    run.add_argument(
        "--placement-strategy",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        default=None,
        help="how Ray places the workers over nodes (implies --backend ray; default: PACK)",
    )
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
    run.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the live web dashboard (read-only, on 127.0.0.1) while the run goes",
    )
    run.add_argument(
        "--dashboard-port",
        type=_port,
        metavar="PORT",
        help=f"the dashboard's port (default: {_DASHBOARD_PORT}, or a free one if taken; 0: any)",
    )
    run.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of configuration and usage errors (also RINGTRAIN_DEBUG=1)",
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
    _add_bench_parser(sub)
    _add_dashboard_parser(sub)
    _add_export_parser(sub)
    parser._tune_parser = _add_tune_parser(sub)  # type: ignore[attr-defined]
    from ringtrain.chaos.cli import add_parser as add_chaos_parser

    parser._chaos_parser = add_chaos_parser(sub)  # type: ignore[attr-defined]
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv, bench_script_args = _split_bench_args(list(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    args.explicit_script_args = "--" in argv  # `ringtrain run SCRIPT -- ARGS`: all the script's
    if args.debug_all or getattr(args, "debug", False):
        os.environ["RINGTRAIN_DEBUG"] = "1"  # also for the ringtrain code this process imports
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return _dispatch(args, parser, bench_script_args)
    except (TypeError, ValueError) as exc:
        if _debug():
            raise
        print(f"ringtrain {args.command}: {for_cli(str(exc))}", file=sys.stderr)
        print("(--debug or RINGTRAIN_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 2


def _debug() -> bool:
    return os.environ.get("RINGTRAIN_DEBUG", "") not in ("", "0")


# What a message that names a Python argument says on the command line instead.
_FLAGS: tuple[tuple[str, str], ...] = (
    (r"use another RunConfig\(name=\.\.\.\)", "use another --name"),
    (
        r"give a new RunConfig\(name=\.\.\.\) \(None: a fresh timestamped name\)",
        "give another --name (or none: a fresh timestamped name)",
    ),
    (r"use use_gpu=False: CPU workers with gloo", "drop --gpu: CPU workers with gloo"),
    (r"use num_workers<=(\d+), or use_gpu=False", r"use -n \1 or fewer, or drop --gpu"),
    (r"ScalingConfig\(use_gpu=True, num_workers=(\d+)\)", r"--gpu with -n \1"),
    (r"ScalingConfig\.num_workers|num_workers=", "-n/--num-workers "),
    (r"ScalingConfig\.resources_per_worker\S*", "--threads"),
    (r"FailureConfig\.max_failures", "--max-failures"),
    (r"FailureConfig\.worker_timeout_s", "--worker-timeout"),
    (r"CheckpointConfig\.num_to_keep", "--num-to-keep"),
    (r"CheckpointConfig\.checkpoint_score_attribute", "--checkpoint-score-attribute"),
    (r"RunConfig\.storage_path", "--storage-path"),
    (r"RunConfig\.name|RunConfig\(name=\.\.\.\)", "--name"),
    (r"RunConfig\.progress", "--progress"),
    (r" or None, got", ", got"),
    (r"\(None disables hang detection\)", "(0 disables hang detection)"),
    (r"\(or leave it None for '<function>_<timestamp>'\)", "(or leave it out: SCRIPT_<timestamp>)"),
)


def for_cli(message: str) -> str:
    """``message`` (written for the Python API: ``RunConfig(name=...)``) with the fix named for
    the command line (``--name``)."""
    import re

    for pattern, flag in _FLAGS:
        message = re.sub(pattern, flag, message)
    return message.replace("  ", " ")


def _dispatch(
    args: argparse.Namespace, parser: argparse.ArgumentParser, bench_script_args: tuple[str, ...]
) -> int:
    if args.command == "run":
        return _cmd_run(args, parser)
    if args.command == "bench":
        return _cmd_bench(args, bench_script_args)
    if args.command == "ls":
        return _cmd_ls(args)
    if args.command == "dashboard":
        return _cmd_dashboard(args)
    if args.command == "export":
        return _cmd_export(args)
    if args.command == "chaos":
        from ringtrain.chaos.cli import run as run_chaos

        return run_chaos(args, parser._chaos_parser)  # type: ignore[attr-defined]
    if args.command == "tune":
        from ringtrain.tune.cli import run as run_tune

        return run_tune(args, parser._tune_parser)  # type: ignore[attr-defined]
    return _cmd_show(args)


def _cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import dataclasses

    from ringtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    saved = None
    if args.resume is not None:
        if args.script is not None:
            refuse("run", "--resume RUN_DIR continues a run with its own SCRIPT; give no SCRIPT")
        from ringtrain.checkpoint.signing import resolve
        from ringtrain.trainer import load_saved_run

        try:
            signer = resolve(None, args.signing_key_file, args.trust_unsigned)
            saved = load_saved_run(args.resume, signer)
        except (FileNotFoundError, PermissionError, ValueError, TypeError) as exc:
            refuse("run", f"--resume: {exc}")
    elif args.script is None:
        refuse("run", "give SCRIPT to run, or --resume RUN_DIR")
    elif not os.path.isfile(args.script):
        refuse("run", f"SCRIPT {args.script!r} is not a file")
    elif not args.explicit_script_args:
        _refuse_misplaced_options(args.script, args.script_args, parser)
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
        scaling = _with_backend(scaling, args)
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
            signing_key_file=args.signing_key_file,
            trust_unsigned=args.trust_unsigned,
        )
        from ringtrain.trainer import default_run_name, run_workers, validate_gpus

        validate_gpus(scaling)
    except (TypeError, ValueError) as exc:
        if _debug():
            raise
        refuse("run", for_cli(str(exc)))
    if saved is not None:
        name, entrypoint = saved.name, saved.entrypoint
        script, script_args = saved.script, saved.script_args
    else:
        script = os.path.abspath(str(args.script))
        entrypoint, script_args = str(args.script), tuple(args.script_args)
        name = run_config.name or default_run_name(os.path.splitext(os.path.basename(script))[0])
        from ringtrain.trainer import finished_note

        note = finished_note(run_config.storage_path, name)
        if note is not None:
            print(f"ringtrain run: note: {for_cli(note)}", file=sys.stderr)
    dashboard = None
    if args.dashboard:
        dashboard = _start_dashboard(
            "ringtrain run", run_config.storage_path, port=args.dashboard_port
        )
        if dashboard is None:
            return 2
        print(
            f"ringtrain: dashboard at {dashboard.url}#run={name} (until the run ends; then "
            f"`ringtrain dashboard {run_config.storage_path}`)",
            file=sys.stderr,
            flush=True,
        )
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
        why = str(exc) if terminated and str(exc) else "interrupted by Ctrl-C (SIGINT)"
        where = os.path.join(run_config.storage_path, name)
        where = where if "://" in where else os.path.normpath(where)
        print(
            f"ringtrain: run stopped: {why}; workers stopped; resume with "
            f"`ringtrain run --resume {where}`",
            file=sys.stderr,
        )
        return 128 + (15 if terminated else 2)
    except (RuntimeError, ValueError, ImportError, PermissionError) as exc:  # ImportError:
        if _debug():  # backend not installed; unsafe key file; a name taken by a live run
            raise
        print(f"ringtrain run: {for_cli(str(exc))}", file=sys.stderr)
        return 2
    finally:
        if dashboard is not None:
            _stop_run_dashboard(dashboard)
    if result.error is not None:
        print(f"ringtrain: run failed: {result.error}", file=sys.stderr)
        return 1
    return 0


def _refuse_misplaced_options(
    script: str, script_args: Sequence[str], parser: argparse.ArgumentParser
) -> None:
    """``ringtrain run train.py -n 2``: ``-n 2`` would go to the script. Refused (one line, before
    anything starts) when an argument after SCRIPT is one of ``ringtrain run``'s own options and
    the script's source does not mention that option string itself (then it is the script's
    own, and passed on). ``ringtrain run train.py -- -n 2`` passes it on regardless."""
    import ast

    run_parser = next(
        action.choices["run"]
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    ours = {opt for opt in run_parser._option_string_actions if opt not in ("-h", "--help")}
    given = [arg.split("=", 1)[0] for arg in script_args if arg.split("=", 1)[0] in ours]
    if not given:
        return
    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return  # the workers report a syntax error with its line
    strings = {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }
    foreign = [opt for opt in given if opt not in strings]
    if not foreign:
        return
    moved: list[str] = []
    rest: list[str] = []
    args = list(script_args)
    while args:
        arg = args.pop(0)
        if arg.split("=", 1)[0] not in foreign:
            rest.append(arg)
            continue
        moved.append(arg)
        action = run_parser._option_string_actions[arg.split("=", 1)[0]]
        if "=" not in arg and action.nargs != 0 and args:  # the option's value
            moved.append(args.pop(0))
    name = os.path.basename(script)
    fixed = " ".join(["ringtrain run", *moved, name, *rest])
    refuse(
        "run",
        f"ringtrain's options go before SCRIPT: {fixed} ({name} does not define "
        f"{', '.join(foreign)}; to pass it to the script anyway: ringtrain run {name} -- ARGS)",
    )


def refuse(command: str, message: str) -> NoReturn:
    """A usage or configuration error of ``ringtrain COMMAND``: one line on stderr, exit status
    2, no usage block and no traceback."""
    print(f"ringtrain {command}: {message}", file=sys.stderr)
    raise SystemExit(2)


def _with_backend(scaling: Any, args: argparse.Namespace) -> Any:
    """``scaling`` with the backend options of ``ringtrain run`` applied (``--address`` and
    ``--placement-strategy`` imply ``--backend ray``)."""
    import dataclasses

    changes: dict[str, Any] = {}
    ray_options = args.address is not None or args.placement_strategy is not None
    if args.backend is not None or ray_options:
        changes["backend"] = args.backend or "ray"
    if args.address is not None:
        changes["ray_address"] = args.address
    if args.placement_strategy is not None:
        changes["placement_strategy"] = args.placement_strategy
    if changes.get("backend") == "local":
        if ray_options:
            raise ValueError("--address and --placement-strategy need --backend ray")
        changes.update(ray_address=None, placement_strategy="PACK")  # a resumed Ray run
    return dataclasses.replace(scaling, **changes) if changes else scaling


def _cmd_ls(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ringtrain.monitor.render import render_runs
    from ringtrain.monitor.runs import list_runs
    from ringtrain.monitor.sweeps import list_sweeps

    try:
        runs = list_runs(args.storage)
    except FileNotFoundError as exc:
        print(f"ringtrain ls: {exc}", file=sys.stderr)
        return 1
    render_runs(runs, Console(), list_sweeps(args.storage))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ringtrain.monitor.render import render_run
    from ringtrain.monitor.runs import load_run

    try:
        details = load_run(args.run_dir)
    except FileNotFoundError as exc:
        print(f"ringtrain show: {exc}", file=sys.stderr)
        return 1
    render_run(details, Console(), max_rounds=args.rounds)
    return 0


# ------------------------------------------------------------------------------ ringtrain bench

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


TUNE_HELP = """\
Run the hyperparameter sweep that SCRIPT defines: a Python file with
  train_fn      the training function (as for ringtrain.Trainer)
  param_space   the search space: tune.uniform / loguniform / randint / choice /
                grid_search, constants and nested dicts
  tune_config   tune.TuneConfig(metric=..., mode=..., num_samples=..., ...)
and optionally scaling_config (each trial's workers) and run_config (name,
storage path). Every trial is an N-worker ringtrain run in RUN/trial_NNNN/;
the Optuna study is RUN/study.db. Running the same sweep again (same name),
or `ringtrain tune --resume RUN`, continues it: finished trials are kept and
interrupted ones resume from their checkpoints.

Examples:
  ringtrain tune examples/tune_mnist.py
  ringtrain tune examples/tune_mnist.py --num-samples 32 -n 2 --name wide
  ringtrain tune --resume runs/tune_mnist
  optuna-dashboard sqlite:///runs/tune_mnist/study.db
"""


def _add_tune_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "tune",
        help="run a hyperparameter sweep whose trials are distributed runs",
        description=TUNE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("script", nargs="?", help="the sweep script (see above)")
    p.add_argument("--resume", metavar="RUN", help="continue the sweep in directory RUN")
    p.add_argument("--name", help="the sweep's name (default: the script's run_config)")
    p.add_argument("--storage-path", help="where the sweep directory goes (default ./runs)")
    p.add_argument("--num-samples", type=_positive_int, help="trials (x grid size)")
    p.add_argument(
        "-n", "--num-workers", type=_positive_int, dest="num_workers", help="workers per trial"
    )
    p.add_argument("--max-concurrent-trials", type=_positive_int)
    p.add_argument(
        "--progress", choices=("auto", "rich", "plain", "off"), help="the sweep's display"
    )
    return p


def _split_bench_args(argv: list[str]) -> tuple[list[str], tuple[str, ...]]:
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


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
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
        type=_positive_int,
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
        type=_positive_int,
        default=None,
        help="torch threads per worker, the same at every W (default: cores / the largest W)",
    )
    bench.add_argument(
        "--bandwidth-gbps",
        type=_positive_float,
        default=None,
        metavar="GBPS",
        help="network bandwidth (Gbit/s) to predict efficiency at larger W with "
        "(default: the bandwidth fitted to the allreduce measurement on this machine)",
    )


def _cmd_bench(args: argparse.Namespace, script_args: tuple[str, ...]) -> int:
    from ringtrain.bench.report import MATPLOTLIB_HINT

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(f"ringtrain bench: {MATPLOTLIB_HINT}", file=sys.stderr)
        return 2
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
        print(f"ringtrain bench: {exc}", file=sys.stderr)
        return 2
    try:
        run_bench(config)
    except KeyboardInterrupt:
        print("ringtrain bench: interrupted; workers stopped", file=sys.stderr)
        return 130
    except (BenchError, RuntimeError, ValueError, OSError) as exc:
        print(f"ringtrain bench: {exc}", file=sys.stderr)
        return 1
    return 0


# -------------------------------------------------------------------------- ringtrain dashboard

_DASHBOARD_PORT = (
    8470  # ringtrain.monitor.dashboard.DEFAULT_PORT (not imported: keeps startup light)
)

DASHBOARD_HELP = """\
Serve a read-only web page of the runs under STORAGE_OR_RUN_DIR (default
./runs; a sweep's directory shows its trials table; a run directory shows that
run): status, metric curves, each worker's step-time breakdown with stragglers
in red, throughput, memory, checkpoints, failures and restarts on a timeline.
It updates every second while runs are going.

It listens on 127.0.0.1 only unless --host says otherwise; any other address
(0.0.0.0 included) needs a token, which every request must then carry: open
the printed URL (it ends in ?token=...). Prefer RINGTRAIN_DASHBOARD_TOKEN to
--token: command lines are visible to other users of the machine.

Examples:
  ringtrain dashboard
  ringtrain dashboard runs/my_sweep --port 8480
  RINGTRAIN_DASHBOARD_TOKEN=$(openssl rand -hex 16) ringtrain dashboard --host 0.0.0.0
  ringtrain run -n 2 --dashboard train.py       the same page, while the run goes
"""


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any free port), got {value}")
    return value


def _add_dashboard_parser(sub: argparse._SubParsersAction) -> None:
    dash = sub.add_parser(
        "dashboard",
        help="serve a live web dashboard of the runs (read-only)",
        description=DASHBOARD_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dash.add_argument(
        "path",
        nargs="?",
        default="./runs",
        metavar="STORAGE_OR_RUN_DIR",
        help="a directory of runs, a sweep's directory or one run directory; a local path or "
        "fsspec URL (default: ./runs)",
    )
    dash.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    dash.add_argument(
        "--port",
        type=_port,
        default=None,
        help=f"port to listen on (default: {_DASHBOARD_PORT}, or a free one if taken; 0: any)",
    )
    dash.add_argument(
        "--token",
        default=None,
        help="require this token on every request (needed off loopback; default: "
        "$RINGTRAIN_DASHBOARD_TOKEN)",
    )


def _start_dashboard(
    prog: str, path: str, *, host: str = "127.0.0.1", port: int | None, token: str | None = None
) -> Any:
    """Starts a DashboardServer; on the default port, falls back to a free one if it is taken.
    Prints why and returns None when it cannot start."""
    import errno

    from ringtrain.monitor.dashboard import DashboardServer

    try:
        server = DashboardServer(
            path, host=host, port=_DASHBOARD_PORT if port is None else port, token=token
        )
        try:
            server.start()
        except OSError as exc:
            if port is not None or exc.errno != errno.EADDRINUSE:
                raise
            print(f"{prog}: port {_DASHBOARD_PORT} is taken; using a free port", file=sys.stderr)
            server.port = 0
            server.start()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    except (OSError, RuntimeError) as exc:
        print(f"{prog}: cannot serve the dashboard on {host}:{port}: {exc}", file=sys.stderr)
        return None
    return server


def _stop_run_dashboard(server: Any) -> None:
    """Lets an open page fetch the run's final state (up to 3 s), then stops the server."""
    import time

    ended = time.time()
    if server.last_request > ended - 10.0:
        server.wait_for_request(after=ended, timeout_s=3.0)
    server.stop()


def _cmd_dashboard(args: argparse.Namespace) -> int:
    from fsspec.core import url_to_fs

    try:
        fs, fs_path = url_to_fs(args.path)
        missing = not fs.exists(fs_path)
    except (ImportError, ValueError, OSError) as exc:
        print(f"ringtrain dashboard: cannot open {args.path!r}: {exc}", file=sys.stderr)
        return 2
    server = _start_dashboard(
        "ringtrain dashboard", args.path, host=args.host, port=args.port, token=args.token
    )
    if server is None:
        return 2
    if missing:
        print(f"note: {args.path} does not exist yet; runs appear as they start", file=sys.stderr)
    print(f"ringtrain dashboard: {args.path} (read-only) at {server.url}", flush=True)
    print("Ctrl-C to stop", file=sys.stderr, flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0


# ----------------------------------------------------------------------------- ringtrain export


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model as one consolidated state dict (safetensors)",
        description="Write the model of a TrainState checkpoint (DDP or FSDP-sharded) as one "
        "unsharded state dict file for inference: safetensors for *.safetensors (and any other "
        "name when safetensors is installed), torch.save for *.pt/*.pth/*.bin. No process group "
        "or GPU is needed. RUN_OR_CHECKPOINT is a checkpoint directory, or a run directory (its "
        "newest valid checkpoint).",
    )
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT")
    export.add_argument("out", metavar="OUT")
    export.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="cast floating-point tensors (default: keep the saved dtype)",
    )


def _cmd_export(args: argparse.Namespace) -> int:
    from ringtrain.export import export_model, find_checkpoint

    try:
        ckpt = find_checkpoint(args.source)
        out = export_model(ckpt, args.out, dtype=args.dtype)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"ringtrain export: {exc}", file=sys.stderr)
        return 1
    print(f"exported the model of {ckpt.uri} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
