"""Which of a group's failures is the root cause; signal names. (The per-group book-keeping that
this module held as ``Attempt`` is :class:`~ringtrain.controller.generation.Generation` now.)"""

from __future__ import annotations

import re
import signal

from ringtrain.result import WorkerFailure

# Errors a rank raises because a *peer* died: never the root cause when another failure exists.
PEER_ERROR = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"failed to recv|Socket Timeout|NCCL communicator was aborted|"
    r"DistBackendError|DistNetworkError|ProcessGroupGloo|Gloo|remote process exited",
    re.IGNORECASE,
)


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure:
    """The failure that explains the others: a non-peer error first, then the earliest."""

    def secondary(f: WorkerFailure) -> bool:
        return f.kind == "exception" and bool(PEER_ERROR.search(f"{f.exc_type} {f.message}"))

    primaries = [f for f in failures if not secondary(f)] or failures
    return min(primaries, key=lambda f: (f.time, f.rank))


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
