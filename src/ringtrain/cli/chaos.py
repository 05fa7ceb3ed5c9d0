"""``ringtrain chaos SCRIPT_OR_RUN``: the command line of a campaign.

SCRIPT is a Python file that defines ``train_fn`` (and optionally ``config`` or
``train_loop_config``, and ``scaling_config``); it is executed as ``ringtrain tune`` executes a
sweep script (not as ``__main__``). RUN is the directory of a run started by
``Trainer(train_fn, ...).fit()``: its train function, config and scaling come from it through
``Trainer.restore`` (a ``ringtrain run SCRIPT`` run is refused: give its SCRIPT instead only if it
defines ``train_fn``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any

from ringtrain.chaos.plan import DEFAULT_FAULTS, FAULT_KINDS
from ringtrain.cli.common import positive_int

CHAOS_HELP = """\
Verify that a training resumes exactly: run it once without faults, then
--runs times under a seeded-random fault schedule (workers SIGKILLed at random
moments and in the middle of a checkpoint write, workers SIGSTOPped until the
hang detection fires, the driver SIGKILLed and the run resumed from its run
directory), and compare every checkpoint of each faulty run with the clean
run's, tensor by tensor (bit-exact). Each run gets a verdict: EXACT, DIVERGED
(with the state and the step it first differs at, and the resume before it),
HUNG, ERRORED or ORPHANS. Exit status 0 when every run is EXACT, 1 otherwise.

SCRIPT_OR_RUN: a Python file defining train_fn (and optionally config and
scaling_config), or the directory of a run started by Trainer(...).fit().
train_fn must save a ringtrain.TrainState with report(..., checkpoint=state)
every few steps and increment state.step per optimizer step. See docs/chaos.md.

Examples:
  ringtrain chaos train.py --workers 2,3 --runs 5 --steps 40
  ringtrain chaos train.py --faults kill,driver --seed 7 --json chaos.json
  ringtrain chaos runs/my_run --runs 3
"""


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """The ``chaos`` subcommand's parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "chaos",
        help="verify exact resume under random faults (kills, hangs, driver kills)",
        description=CHAOS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("target", metavar="SCRIPT_OR_RUN")
    p.add_argument(
        "--workers",
        metavar="W[,W...]",
        help="world sizes to test, comma-separated, e.g. 2,3 (default: the script's "
        "scaling_config, else 2)",
    )
    p.add_argument(
        "--runs", type=positive_int, default=3, help="faulty runs per world size (default: 3)"
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        help="stop every run after this many TrainState steps (default: the training's length)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedules (default 0)")
    p.add_argument(
        "--faults",
        default=",".join(DEFAULT_FAULTS),
        help=f"fault kinds to draw from: {','.join(FAULT_KINDS)} (default: "
        f"{','.join(DEFAULT_FAULTS)}; bitflip turns on the replica check)",
    )
    p.add_argument(
        "--faults-per-run", type=positive_int, default=2, metavar="F", help="(default: 2)"
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="the runs' FailureConfig.worker_timeout_s (default 10; 0: no hang detection)",
    )
    p.add_argument(
        "--budget",
        metavar="SECONDS|Nx",
        help="a faulty run not finished this long after its first training step is HUNG: "
        "seconds, or Nx for N times the clean run's wall time (default: 5 x the clean run's "
        "wall time + 60 s); its start-up may take as long again",
    )
    p.add_argument("--out", default="./chaos", help="campaign directory (default: ./chaos)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument(
        "--progress",
        choices=("auto", "rich", "plain", "off"),
        default="auto",
        help="live line on a terminal, plain lines otherwise (default: auto)",
    )
    return p


def _parse_workers(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        workers = tuple(int(w) for w in text.split(","))
    except ValueError:
        raise ValueError(f"--workers must be world sizes like 2,3, got {text!r}") from None
    if not workers or min(workers) < 1:
        raise ValueError(f"--workers must be world sizes >= 1 like 2,3, got {text!r}")
    return workers


def _load_target(target: str) -> tuple[Any, dict[str, Any] | None, Any]:
    """``(train_fn, config, scaling_config)`` of a script or a run directory.

    Raises:
        ValueError: what is wrong with SCRIPT_OR_RUN, in one line.
    """
    if os.path.isdir(target):
        from ringtrain.trainer import Trainer

        if not os.path.isfile(os.path.join(target, "config.json")):
            raise ValueError(f"SCRIPT_OR_RUN {target!r} is a directory without config.json")
        try:
            trainer = Trainer.restore(target)
        except (OSError, ValueError, TypeError) as exc:  # OSError: e.g. an unsafe key file
            raise ValueError(f"SCRIPT_OR_RUN {target!r}: {exc}".split(": resume it")[0]) from None
        return trainer.train_fn, trainer.train_loop_config, trainer.scaling_config
    if not os.path.isfile(target):
        raise ValueError(f"SCRIPT_OR_RUN {target!r} is neither a script nor a run directory")
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    found = runpy.run_path(target, run_name="__ringtrain_chaos__")
    if not callable(found.get("train_fn")):
        raise ValueError(
            f"SCRIPT_OR_RUN {target!r} must define train_fn (a per-worker script for "
            "`ringtrain run` cannot be re-run under faults; wrap its body in train_fn(config))"
        )
    config = found.get("config", found.get("train_loop_config"))
    return found["train_fn"], config, found.get("scaling_config")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the campaign; 0 when every run is EXACT, 1 otherwise, 2 for usage errors."""
    from ringtrain.chaos.campaign import ChaosError, run_campaign
    from ringtrain.chaos.display import Display
    from ringtrain.chaos.plan import ChaosConfig

    hang = None if args.hang_timeout == 0 else args.hang_timeout
    try:
        workers = _parse_workers(args.workers)
        faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
        ChaosConfig(  # every option checked before the script is even loaded
            runs=args.runs,
            seed=args.seed,
            faults=faults,
            faults_per_run=args.faults_per_run,
            workers=workers or (2,),
            steps=args.steps,
            hang_timeout_s=hang,
            budget_s=args.budget,
            out_dir=args.out,
        )
        train_fn, config, scaling = _load_target(args.target)
    except ValueError as exc:
        parser.error(str(exc))
    display = Display(args.progress)
    try:
        report = run_campaign(
            train_fn,
            train_loop_config=config,
            scaling_config=scaling,
            steps=args.steps,
            runs=args.runs,
            seed=args.seed,
            faults=faults,
            faults_per_run=args.faults_per_run,
            workers=workers,
            hang_timeout_s=hang,
            budget_s=args.budget,
            out_dir=args.out,
            display=display,
        )
    except ValueError as exc:
        parser.error(str(exc))
    except ChaosError as exc:
        print(f"ringtrain chaos: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("ringtrain chaos: interrupted; every process of the run stopped", file=sys.stderr)
        return 130
    if args.json:
        report.write_json(args.json)
        print(f"report: {args.json}")
    return 0 if report.ok else 1
