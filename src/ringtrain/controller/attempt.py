"""Which of a group's failures is the root cause; signal names. (The per-group book-keeping that
this module held as ``Attempt`` is :class:`~ringtrain.controller.generation.Generation` now.)"""

from __future__ import annotations

import signal

from ringtrain.result import PEER_ERROR, WorkerFailure

__all__ = ["PEER_ERROR", "root_cause", "signal_name"]


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    """The failure that explains the others: a non-peer error first, then the earliest."""

    primaries = [f for f in failures if not f.peer_error] or failures
    return min(primaries, key=lambda f: (f.time, f.rank))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
