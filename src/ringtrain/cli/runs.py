"""``ringtrain ls`` and ``ringtrain show``: the runs of a storage path, and one run in detail."""

from __future__ import annotations

import argparse
from typing import Any

from ringtrain.cli.common import positive_int, say


def add_runs_parsers(sub: Any) -> None:
    """Add the ``ls`` and ``show`` subcommands to ``sub`` (an ``add_subparsers()`` result)."""
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
    show.add_argument("--rounds", type=positive_int, default=30, help="last N rounds (default 30)")


def cmd_ls(args: argparse.Namespace) -> int:
    """``ringtrain ls``: a table of the runs (and sweeps) under ``args.storage``."""
    from rich.console import Console

    from ringtrain.monitor.console_io import whole_writes
    from ringtrain.monitor.render import render_runs
    from ringtrain.monitor.runs import list_runs
    from ringtrain.monitor.sweeps import list_sweeps

    try:
        runs = list_runs(args.storage)
    except FileNotFoundError as exc:
        say(f"ringtrain ls: {exc}", err=True)
        return 1
    render_runs(runs, Console(file=whole_writes()), list_sweeps(args.storage))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """``ringtrain show``: one run's config, metrics, checkpoints and failures."""
    from rich.console import Console

    from ringtrain.monitor.console_io import whole_writes
    from ringtrain.monitor.render import render_run
    from ringtrain.monitor.runs import load_run

    try:
        details = load_run(args.run_dir)
    except FileNotFoundError as exc:
        say(f"ringtrain show: {exc}", err=True)
        return 1
    render_run(details, Console(file=whole_writes()), max_rounds=args.rounds)
    return 0
