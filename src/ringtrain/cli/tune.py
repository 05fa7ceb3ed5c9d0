"""``ringtrain tune SWEEP.py``: run the sweep a script defines.

The script is executed (not as ``__main__``, so its ``if __name__ == "__main__":`` block does not
run) and must define ``train_fn``, ``param_space`` and ``tune_config``; ``scaling_config`` and
``run_config`` are optional. Command-line options override the script's values.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import runpy
import sys
from typing import Any

from ringtrain.cli.common import positive_int, refuse, say

REQUIRED = ("train_fn", "param_space", "tune_config")


def _undefined(script: str) -> list[str]:
    """The names of :data:`REQUIRED` that ``script`` does not define at top level, found without
    running it (its top-level code would otherwise run in the driver: a per-worker script fails
    there with torch's "environment variable RANK expected"). A name bound by an assignment, a
    ``def``, an import or inside a top-level ``if``/``try``/``with`` counts; a ``*`` import, or
    a file that does not parse, defers the check to after running it (as before)."""
    import ast

    try:
        with open(script, "rb") as f:
            tree = ast.parse(f.read(), filename=script)
    except (OSError, SyntaxError, ValueError):
        return []
    bound: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return []
                bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                bound.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    todo.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return [name for name in REQUIRED if name not in bound]


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


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``tune`` subcommand's parser, added to ``sub`` (an ``add_subparsers()`` result)."""
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
    p.add_argument("--num-samples", type=positive_int, help="trials (x grid size)")
    p.add_argument(
        "-n", "--num-workers", type=positive_int, dest="num_workers", help="workers per trial"
    )
    p.add_argument("--max-concurrent-trials", type=positive_int)
    p.add_argument(
        "--progress", choices=("auto", "rich", "plain", "off"), help="the sweep's display"
    )
    return p


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Returns 0 when at least one trial completed, 1 otherwise (2 for usage errors)."""
    import ringtrain as rt

    try:
        from ringtrain.tune import Tuner
    except ImportError as exc:  # the tune extra is missing: say which, in one line
        refuse("tune", str(exc))

    if args.resume:
        if args.script:
            parser.error("give either SCRIPT or --resume RUN, not both")
        try:
            tuner = Tuner.restore(args.resume)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    else:
        if not args.script:
            parser.error("the sweep SCRIPT is required (or --resume RUN)")
        if not os.path.isfile(args.script):
            parser.error(f"no such sweep script: {args.script}")
        missing = _undefined(args.script)
        if missing:  # refused before its top-level code runs in this (driver) process
            refuse(
                "tune",
                f"{args.script} is not a sweep script: it defines no {', '.join(missing)} at "
                f"top level (a sweep file defines {', '.join(REQUIRED)}; see `ringtrain tune "
                f"--help`); to run a per-worker training script, use `ringtrain run -n N "
                f"{args.script}`",
            )
        script_dir = os.path.dirname(os.path.abspath(args.script))
        sys.path.insert(0, script_dir)  # the script's own imports, as `python SCRIPT` would
        found = runpy.run_path(args.script, run_name="__ringtrain_tune__")
        missing = [k for k in REQUIRED if k not in found]
        if missing:
            parser.error(
                f"{args.script} must define {', '.join(REQUIRED)}; missing: {', '.join(missing)}"
            )
        scaling = found.get("scaling_config") or rt.ScalingConfig()
        run_config = found.get("run_config") or rt.RunConfig(
            name=os.path.splitext(os.path.basename(args.script))[0]
        )
        tune_config = found["tune_config"]
        try:
            if args.num_workers:
                scaling = dataclasses.replace(scaling, num_workers=args.num_workers)
            changes = {
                k: v
                for k, v in (
                    ("name", args.name),
                    ("storage_path", args.storage_path),
                    ("progress", args.progress),
                )
                if v is not None
            }
            run_config = dataclasses.replace(run_config, **changes)
            tchanges = {
                k: v
                for k, v in (
                    ("num_samples", args.num_samples),
                    ("max_concurrent_trials", args.max_concurrent_trials),
                )
                if v is not None
            }
            tune_config = dataclasses.replace(tune_config, **tchanges)
            tuner = Tuner(
                found["train_fn"],
                param_space=found["param_space"],
                tune_config=tune_config,
                scaling_config=scaling,
                run_config=run_config,
            )
        except (TypeError, ValueError) as exc:
            parser.error(str(exc))
    try:
        grid = tuner.fit()
    except ValueError as exc:
        say(f"ringtrain tune: {exc}", err=True)
        return 2
    except KeyboardInterrupt:
        return 130
    done = [s for s in grid.statuses if s == "COMPLETE"]
    if not done:
        say("ringtrain tune: no trial completed", err=True)
        return 1
    if grid.metric is None:  # nothing was optimised: every trial is the answer
        say(f"{len(done)} of {len(grid)} trials completed in {grid.path}")
        return 0
    best = grid.get_best_result()
    say(f"best trial: {best.path}")
    say(f"  config: {best.config}")
    say(f"  {grid.metric}: {best.metrics.get(grid.metric)}")
    return 0
