"""The controller's book-keeping of one worker group (:class:`Attempt`), of an elastic grow in
progress (:class:`Grow`), and which of a group's failures is the root cause."""

from __future__ import annotations

import re
import signal
import time
from typing import Any

from ringtrain.channel import Interrupted, Report
from ringtrain.result import WorkerFailure

# Errors a rank raises because a *peer* died: never the root cause when another failure exists.
PEER_ERROR = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"failed to recv|Socket Timeout|NCCL communicator was aborted|"
    r"DistBackendError|DistNetworkError|ProcessGroupGloo|Gloo|remote process exited",
    re.IGNORECASE,
)

HELLO_TIMEOUT_S = 60.0
"""A worker process that has not connected after this long (or ``worker_timeout_s`` if longer)
is failed as hung."""


class Attempt:
    """Book-keeping of one worker group."""

    def __init__(self, number: int, world_size: int) -> None:
        self.number = number
        self.world_size = world_size
        self.pending: dict[int, dict[int, Report]] = {}  # round -> rank -> report
        self.last_round: dict[int, int] = {}  # rank -> last round it reported
        self.exited: dict[int, int] = {}  # rank -> return code
        self.done: set[int] = set()
        self.failures: dict[int, WorkerFailure] = {}
        self.first_failure_at: float | None = None
        self.started_at = time.monotonic()
        # Monotonic times of the last progress (absent until the rank's first batch, step or
        # report) and of the last message of any kind (absent until its Hello).
        self.last_progress: dict[int, float] = {}
        self.last_seen: dict[int, float] = {}
        self.last_step: dict[int, int] = {}
        self.progress_count: dict[int, int] = {}
        # Checkpoint writes: round -> rank -> ("files", {...}) | ("error", "why").
        self.outcomes: dict[int, dict[int, tuple[str, Any]]] = {}
        # Rounds whose reports are all in but whose files are still being written.
        self.writing: dict[int, tuple[dict[int, Report], set[int]]] = {}
        # Elastic runs: ranks waiting for a Resize; whether this generation gave up on resizing
        # in place; the resize that started this generation (its event is written once the
        # first step after it completes).
        self.interrupted: dict[int, Interrupted] = {}
        self.elastic_fallback = False
        self.resize: dict[str, Any] | None = None

    @property
    def all_exited(self) -> bool:
        return len(self.exited) == self.world_size

    @property
    def all_failed_or_exited(self) -> bool:
        return all(r in self.failures or r in self.exited for r in range(self.world_size))


class Grow:
    """An elastic grow in progress: workers started to join (``ranks``), those ready to join
    (``ready``: their JoinReady arrived) or failed (``dead``: rank -> why); ``requested``: the
    members were sent a GrowRequest. ``capacity_time`` (Unix) and ``started_at`` (monotonic):
    when the workers were started."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = list(ranks)
        self.ready: set[int] = set()
        self.dead: dict[int, str] = {}
        self.requested = False
        self.capacity_time = time.time()
        self.started_at = time.monotonic()


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
