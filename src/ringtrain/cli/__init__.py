"""The ``ringtrain`` command: ``run``, ``tune``, ``ls``, ``show``, ``bench``, ``dashboard``,
``export``, ``chaos``.

``ringtrain`` (the console script) and ``python -m ringtrain`` / ``python -m ringtrain.cli`` all
call :func:`main`. :mod:`ringtrain.cli.main` builds the parser and dispatches; each subcommand
is a module of this package (or ``ringtrain.cli.tune``, ``ringtrain.cli.chaos``).
"""

from __future__ import annotations

from ringtrain.cli.common import for_cli, refuse
from ringtrain.cli.main import build_parser, main

__all__ = ["build_parser", "for_cli", "main", "refuse"]
