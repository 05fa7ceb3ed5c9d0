"""``ringtrain run``: start N workers on a per-worker script (or resume a run directory).

:func:`cmd_run` reads top to bottom: check the arguments (or load the saved run of
``--resume``), build the configs, name the run, start the dashboard if asked, run the workers,
and turn the outcome into an exit status (0 done, 1 the run failed, 2 a usage or configuration
error, 75 (``EX_TEMPFAIL``, :data:`EXIT_PREEMPTED`) when a preemption notice ended the run: it
saved its state and resumes with ``--resume``, 128 + signal when stopped).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ringtrain.cli.common import (
    DASHBOARD_PORT,
    debug_enabled,
    for_cli,
    port_number,
    positive_int,
    refuse,
    say,
    subparser,
)
from ringtrain.cli.dashboard import start_dashboard, stop_run_dashboard

if TYPE_CHECKING:
    from ringtrain.config import RunConfig, ScalingConfig
    from ringtrain.trainer import SavedRun

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


def _parallel_config(text: str) -> Any:
    """``--parallel dp_shard=2,tp=2`` as a :class:`ringtrain.ParallelConfig`."""
    from ringtrain.config.parallel import ParallelConfig

    try:
        return ParallelConfig.parse(text)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_run_parser(sub: Any) -> None:
    """Add the ``run`` subcommand to ``sub`` (an ``add_subparsers()`` result)."""
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
        type=positive_int,
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
        "--from-scratch-if-invalid",
        action="store_true",
        help="when the run directory holds checkpoints and none verifies, set them aside "
        "(checkpoint_NNNNNN.corrupt) and start from step 0 instead of refusing to start",
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
        "--parallel",
        type=_parallel_config,
        default=None,
        metavar="DIMS",
        help="the device mesh, e.g. dp_shard=2,tp=2 (sizes of pp, dp_replicate, dp_shard, tp; "
        "-1: the rest of the world size; docs/parallelism.md)",
    )
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
        "--threads", type=positive_int, help="torch threads per worker (default: cores / N)"
    )
    run.add_argument(
        "--preload",
        action="append",
        metavar="MODULE",
        help="a module the warm pool imports once before forking the workers, so each worker "
        "and each restart skips its import (repeatable; e.g. --preload lightning.pytorch)",
    )
    run.add_argument(
        "--max-failures",
        type=int,
        default=None,
        help="restart the workers after up to this many failures (-1: forever; default: 0)",
    )
    run.add_argument(
        "--num-to-keep",
        type=positive_int,
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
        type=port_number,
        metavar="PORT",
        help=f"the dashboard's port (default: {DASHBOARD_PORT}, or a free one if taken; 0: any)",
    )
    run.add_argument(
        "--debug",
        action="store_true",
        help="show the traceback of configuration and usage errors (also RINGTRAIN_DEBUG=1)",
    )
    run.add_argument("script", nargs="?", metavar="SCRIPT", help="the per-worker Python script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="...", help="its arguments")


class _Target(NamedTuple):
    """What ``ringtrain run`` starts: the run's name and the script with its arguments."""

    name: str
    entrypoint: str
    script: str | None
    script_args: tuple[str, ...]


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``ringtrain run``; returns the exit status (usage errors exit with status 2)."""
    saved = _check_arguments(args, parser)
    scaling, run_config = _configs(args, saved)
    target = _target(args, saved, run_config)
    dashboard = None
    if args.dashboard:
        dashboard = start_dashboard(
            "ringtrain run", run_config.storage_path, port=args.dashboard_port
        )
        if dashboard is None:
            return 2
        say(
            f"ringtrain: dashboard at {dashboard.url}#run={target.name} (until the run ends; then "
            f"`ringtrain dashboard {run_config.storage_path}`)",
            err=True,
        )
    try:
        return _run(target, saved, scaling, run_config)
    finally:
        if dashboard is not None:
            stop_run_dashboard(dashboard)


def _check_arguments(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SavedRun | None:
    """Refuse what cannot run (no SCRIPT, a SCRIPT that is no file, ringtrain options after
    SCRIPT); with ``--resume``, the saved run (checked against the signing key)."""
    if args.resume is not None:
        if args.script is not None:
            refuse("run", "--resume RUN_DIR continues a run with its own SCRIPT; give no SCRIPT")
        from ringtrain.checkpoint.signing import resolve
        from ringtrain.trainer import load_saved_run

        try:
            signer = resolve(None, args.signing_key_file, args.trust_unsigned)
            return load_saved_run(args.resume, signer)
        except (FileNotFoundError, PermissionError, ValueError, TypeError) as exc:
            refuse("run", f"--resume: {exc}")
    if args.script is None:
        refuse("run", "give SCRIPT to run, or --resume RUN_DIR")
    if not os.path.isfile(args.script):
        refuse("run", f"SCRIPT {args.script!r} is not a file")
    if not args.explicit_script_args:
        _refuse_misplaced_options(args.script, args.script_args, parser)
    return None


def _configs(args: argparse.Namespace, saved: SavedRun | None) -> tuple[ScalingConfig, RunConfig]:
    """The scaling and run configs: the saved run's (``--resume``) or the defaults, with the
    options given applied. A configuration error exits with one line naming the flag."""
    from ringtrain.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

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
        if args.parallel is not None:
            scaling = dataclasses.replace(scaling, parallel=args.parallel)
        if args.preload:
            scaling = dataclasses.replace(scaling, preload_modules=tuple(args.preload))
        if args.max_failures is not None:
            failure = dataclasses.replace(failure, max_failures=args.max_failures)
        if args.worker_timeout is not None:
            failure = dataclasses.replace(failure, worker_timeout_s=args.worker_timeout or None)
        if args.sync_checkpoints:
            checkpoint = dataclasses.replace(checkpoint, async_save=False)
        if args.from_scratch_if_invalid:
            checkpoint = dataclasses.replace(checkpoint, from_scratch_if_invalid=True)
        run_config = RunConfig(
            name=saved.name if saved else args.name,
            storage_path=saved.storage_path if saved else args.storage_path,
            failure_config=failure,
            checkpoint_config=checkpoint,
            progress=args.progress,
            signing_key_file=args.signing_key_file,
            trust_unsigned=args.trust_unsigned,
        )
        from ringtrain.trainer import validate_gpus

        validate_gpus(scaling)
    except (TypeError, ValueError) as exc:
        if debug_enabled():
            raise
        refuse("run", for_cli(str(exc)))
    return scaling, run_config


def _target(args: argparse.Namespace, saved: SavedRun | None, run_config: RunConfig) -> _Target:
    """The run's name and script: the saved run's, or SCRIPT's (a note when a finished run of
    that name exists)."""
    if saved is not None:
        return _Target(saved.name, saved.entrypoint, saved.script, tuple(saved.script_args))
    from ringtrain.trainer import default_run_name, finished_note

    script = os.path.abspath(str(args.script))
    name = run_config.name or default_run_name(os.path.splitext(os.path.basename(script))[0])
    note = finished_note(run_config.storage_path, name)
    if note is not None:
        say(f"ringtrain run: note: {for_cli(note)}", err=True)
    return _Target(name, str(args.script), script, tuple(args.script_args))


def _run(
    target: _Target, saved: SavedRun | None, scaling: ScalingConfig, run_config: RunConfig
) -> int:
    """Run the workers; the exit status (a stop by Ctrl-C or SIGTERM says how to resume)."""
    from ringtrain.trainer import run_workers

    try:
        result = run_workers(
            name=target.name,
            entrypoint=target.entrypoint,
            scaling_config=scaling,
            run_config=run_config,
            payload=saved.payload if saved is not None and target.script is None else None,
            script=target.script,
            script_args=target.script_args,
            train_loop_config=saved.train_loop_config if saved is not None else None,
        )
    except KeyboardInterrupt as exc:
        from ringtrain.trainer import DriverTerminated

        terminated = isinstance(exc, DriverTerminated)
        why = str(exc) if terminated and str(exc) else "interrupted by Ctrl-C (SIGINT)"
        where = os.path.join(run_config.storage_path, target.name)
        where = where if "://" in where else os.path.normpath(where)
        say(
            f"ringtrain: run stopped: {why}; workers stopped; resume with "
            f"`ringtrain run --resume {where}`",
            err=True,
        )
        return 128 + (15 if terminated else 2)
    except (RuntimeError, ValueError, ImportError, PermissionError) as exc:  # ImportError:
        if debug_enabled():  # backend not installed; unsafe key file; a name taken by a live run
            raise
        say(f"ringtrain run: {for_cli(str(exc))}", err=True)
        return 2
    if result.error is not None:
        say(f"ringtrain: run failed: {result.error}", err=True)
        return 1
    if result.status == "PREEMPTED":
        where = os.path.join(run_config.storage_path, target.name)
        where = where if "://" in where else os.path.normpath(where)
        say(
            f"ringtrain: run preempted (its state is saved); resume with "
            f"`ringtrain run --resume {where}` (exit status {EXIT_PREEMPTED}: retry)",
            err=True,
        )
        return EXIT_PREEMPTED
    return 0


EXIT_PREEMPTED = 75
"""``ringtrain run``'s exit status when a preemption notice ended the run (``EX_TEMPFAIL`` of
sysexits.h: what schedulers and retry wrappers read as "try again"); the run resumes with
``--resume``."""


def _refuse_misplaced_options(
    script: str, script_args: Sequence[str], parser: argparse.ArgumentParser
) -> None:
    """``ringtrain run train.py -n 2``: ``-n 2`` would go to the script. Refused (one line, before
    anything starts) when an argument after SCRIPT is one of ``ringtrain run``'s own options and
    the script's source does not mention that option string itself (then it is the script's
    own, and passed on). ``ringtrain run train.py -- -n 2`` passes it on regardless."""
    import ast

    run_parser = subparser(parser, "run")
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


def _with_backend(scaling: ScalingConfig, args: argparse.Namespace) -> ScalingConfig:
    """``scaling`` with the backend options of ``ringtrain run`` applied (``--address`` and
    ``--placement-strategy`` imply ``--backend ray``)."""
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
