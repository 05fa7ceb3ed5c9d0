"""The command-line options of the benchmarks that train the GPT of ``examples/`` at several
sizes and world sizes (``fsdp.py``, ``parallel_memory.py``): one place, one set of defaults."""

from __future__ import annotations

import argparse
from typing import Any


def gpt_arg_parser(
    doc: str | None, *, workers: int, batch: int, steps: int, batch_help: str
) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc`` with ``--workers``, the model's
    size (``--layers 14 --dim 768 --heads 12 --seq 64``), ``--batch`` and ``--steps`` (timed
    steps, after one warm-up); the caller adds its own options."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--workers", type=int, default=workers)
    p.add_argument("--layers", type=int, default=14)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=batch, help=batch_help)
    p.add_argument("--steps", type=int, default=steps, help="timed steps (after one warm-up)")
    return p


def gpt_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model's size and the run's length from :func:`gpt_arg_parser`'s options, as the
    benchmark's ``train_loop_config`` entries (``layers``, ``dim``, ``heads``, ``seq``,
    ``batch``, ``steps``)."""
    return {k: getattr(args, k) for k in ("layers", "dim", "heads", "seq", "batch", "steps")}
