"""What every ``ringtrain`` subcommand shares: argument types, one-line usage errors, and the
translation of Python-API wording (``RunConfig(name=...)``) into command-line flags (``--name``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import NoReturn

from ringtrain.monitor.console_io import write_whole

#: The dashboard's default port: ringtrain.monitor.dashboard.DEFAULT_PORT (not imported: keeps
#: the command's startup light).
DASHBOARD_PORT = 8470


def say(text: str, *, err: bool = False) -> None:
    """Write ``text`` and a newline to stdout (stderr with ``err=True``) whole
    (:func:`ringtrain.monitor.console_io.write_whole`): into a non-blocking pipe that is full,
    ``print`` drops what does not fit, silently; this waits until the pipe takes it all.

    Raises:
        OSError: as ``write_whole`` does (a closed stream, ``BrokenPipeError``).
    """
    write_whole(sys.stderr if err else sys.stdout, text + "\n")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line (``ringtrain run: argument -n: must be >= 1, got 0 (see
    ringtrain run --help)``), not the whole usage block."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("ringtrain").strip()
        say(
            f"{self.prog}: {message} (see `{self.prog} --help`)"
            if not command
            else f"ringtrain {command}: {message} (see `{self.prog} --help`)",
            err=True,
        )
        raise SystemExit(2)


def debug_enabled() -> bool:
    """Whether ``--debug`` or ``RINGTRAIN_DEBUG`` asks for tracebacks."""
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
    (r"ScalingConfig\.preload_modules", "--preload"),
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
    for pattern, flag in _FLAGS:
        message = re.sub(pattern, flag, message)
    return message.replace("  ", " ")


def refuse(command: str, message: str) -> NoReturn:
    """A usage or configuration error of ``ringtrain COMMAND``: one line on stderr, exit status
    2, no usage block and no traceback."""
    say(f"ringtrain {command}: {message}", err=True)
    raise SystemExit(2)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def port_number(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535 (0: any free port), got {value}")
    return value


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` of ``parser`` (``KeyError`` if there is none)."""
    return next(
        action.choices[command]
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
    )
