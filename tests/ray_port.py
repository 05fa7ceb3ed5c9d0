"""Port a Ray Train script to ringtrain by rewriting its import lines, and nothing else.

``port(source)`` is what docs/ray.md's "Coming from Ray Train" table says by hand: every import
of ``ray.train``, ``ray.tune`` (and ``horovod.torch``) becomes the ringtrain import that binds
the same name to ringtrain's mirror of it; every other line is left as it is.
tests/backends/test_ray_compat.py ports the examples installed with Ray this way at test time, so
the repository holds no copy of Ray's code; tests/e2e/test_ray_seeds.py ports the seed snippets
of tests/seeds/.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

# (pattern of an import statement, with the line's indentation cut off; its replacement).
# Tried in order; the first that matches the whole statement wins.
IMPORT_MAP: tuple[tuple[str, str], ...] = (
    # the body calls ray.train.… / ray.train.torch.…: bind ``ray`` to ringtrain
    (r"import ray\.train(\.torch|\.horovod)?", "import ringtrain as ray"),
    (r"import ray\.train(\.torch|\.horovod)? as (\w+)", r"import ringtrain.train\1 as \2"),
    (r"from ray import train", "from ringtrain import train"),
    (r"from ray import train as (\w+)", r"from ringtrain import train as \1"),
    (
        r"from ray\.train(\.torch|\.horovod|\.lightning)? import (.+)",
        r"from ringtrain.train\1 import \2",
    ),
    # Ray Tune: ringtrain.tune mirrors ray.tune (seed 001's Tuner over a TorchTrainer)
    (r"from ray import tune", "from ringtrain import tune"),
    (r"from ray import train, tune", "from ringtrain import train, tune"),
    (r"import ray\.tune as (\w+)", r"import ringtrain.tune as \1"),
    (r"from ray\.tune import (.+)", r"from ringtrain.tune import \1"),
    (r"import horovod\.torch as (\w+)", r"import ringtrain.horovod as \1"),
    (r"from horovod\.torch import (.+)", r"from ringtrain.horovod import \1"),
)


def _is_import(line: str) -> bool:
    """Whether ``line`` (indentation allowed; several lines for a parenthesised import) is
    exactly one import statement."""
    try:
        body = ast.parse(textwrap.dedent(line).strip()).body
    except SyntaxError:
        return False
    return len(body) == 1 and isinstance(body[0], (ast.Import, ast.ImportFrom))


def port_line(line: str) -> str:
    """``line`` with its Ray import swapped for ringtrain's; any other line unchanged."""
    stripped = line.strip()
    if not stripped.startswith(("import ", "from ")):
        return line
    indent = line[: len(line) - len(line.lstrip())]
    for pattern, replacement in IMPORT_MAP:
        match = re.fullmatch(pattern, stripped)
        if match:
            return indent + match.expand(replacement)
    return line


def port(source: str) -> tuple[str, int]:
    """Port a Ray Train script.

    Args:
        source: the script's text.

    Returns:
        ``(ported source, number of import statements changed)``. A parenthesised import that
        spans several lines (``from ray.train.lightning import (`` ... ``)``) is one statement;
        only its first line changes.

    Raises:
        AssertionError: a changed line is not an import statement before and after the swap (the
            rules above would then be wrong), or the ported source does not parse.
    """
    lines = source.splitlines(keepends=True)
    out = []
    changed = 0
    i = 0
    while i < len(lines):
        line = lines[i]
        ending = line[len(line.rstrip("\r\n")) :]
        text = line[: len(line) - len(ending)]
        new = port_line(text)
        # The rest of a parenthesised import (its names) is part of the statement.
        rest: list[str] = []
        if text.rstrip().endswith("(") and text.lstrip().startswith(("from ", "import ")):
            while i + 1 < len(lines) and ")" not in "".join(rest):
                i += 1
                rest.append(lines[i])
        tail = "".join(rest)
        if new != text:
            whole = text + "\n" + tail
            assert _is_import(whole) and _is_import(new + "\n" + tail), (
                f"not an import swap: {text!r} -> {new!r}"
            )
            changed += 1
        out.append(new + ending + tail)
        i += 1
    ported = "".join(out)
    ast.parse(ported)
    return ported, changed


def ray_example(name: str) -> Path | None:
    """The example ``name`` as installed with Ray (``ray/train/examples/{pytorch,horovod}/``),
    or None when Ray or the file is not installed."""
    try:
        import ray
    except ImportError:
        return None
    kind = "horovod" if name.startswith("horovod") else "pytorch"
    path = Path(ray.__file__).parent / "train" / "examples" / kind / name
    return path if path.exists() else None


def changed_lines(source: str) -> list[tuple[str, str]]:
    """``[(Ray's line, ported line)]`` for every line ``port`` changes in ``source``."""
    ported, _ = port(source)
    return [(a, b) for a, b in zip(source.splitlines(), ported.splitlines(), strict=True) if a != b]
