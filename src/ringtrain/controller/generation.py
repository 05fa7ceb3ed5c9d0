"""The controller's book-keeping of one worker-group generation (:class:`Generation`) and of an
elastic grow in progress (:class:`Grow`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ringtrain.controller.health import Health
from ringtrain.controller.rounds import Rounds
from ringtrain.result import WorkerFailure
from ringtrain.wire.channel import IntegrityMismatch, Interrupted

LAST_MESSAGES_S = 5.0
"""How long the driver waits, once every worker exited, for the channel messages a cleanly exited
worker wrote before its exit (``Done`` last) when its exit was reported first (seconds)."""


class Generation:
    """One worker group: attempt ``number`` (0 first, +1 per restart), whose ``world_size``
    workers run together. An elastic resize or grow makes a new generation with the same
    attempt number.

    ``rounds``: reports and checkpoint outcomes; ``health``: liveness; ``exited``: rank ->
    return code; ``done``: ranks whose train function returned; ``failures``: rank -> failure;
    ``first_failure_at``: monotonic time of the first failure (None: none yet). Elastic runs:
    ``interrupted``: ranks waiting for a Resize; ``elastic_fallback``: this generation gave up
    on resizing in place; ``resize``: the resize that started this generation (its event is
    written once the first step after it completes); ``hosts``: rank -> host name;
    ``mismatch``: what a failed replica check told (silent data corruption).
    """

    def __init__(self, number: int, world_size: int) -> None:
        self.number = number
        self.world_size = world_size
        self.rounds = Rounds(world_size)
        self.health = Health(world_size)
        self.exited: dict[int, int] = {}
        self.done: set[int] = set()
        self.failures: dict[int, WorkerFailure] = {}
        self.first_failure_at: float | None = None
        self.interrupted: dict[int, Interrupted] = {}
        self.elastic_fallback = False
        self.resize: dict[str, Any] | None = None
        self.drained_since: float | None = None  # when every worker had exited (monotonic)
        self.read_out: set[int] = set()  # ranks whose channel was read to its end
        self.hosts: dict[int, str] = {}  # rank -> host name (its Hello)
        self.pids: dict[int, int] = {}  # rank -> process id on its host (its Hello)
        self.mismatch: IntegrityMismatch | None = None  # a replica check's, if one failed

    def worker_id(self, rank: int) -> str | None:
        """``"HOST:PID"`` of ``rank``'s process, as its Hello said (``None`` before it)."""
        if rank not in self.hosts or rank not in self.pids:
            return None
        return f"{self.hosts[rank]}:{self.pids[rank]}"

    @property
    def started_at(self) -> float:
        return self.health.started_at

    @property
    def all_exited(self) -> bool:
        return len(self.exited) == self.world_size

    @property
    def all_failed_or_exited(self) -> bool:
        return all(r in self.failures or r in self.exited for r in range(self.world_size))

    def last_messages_due(self, reading: Callable[[int], bool]) -> bool:
        """Whether a rank that exited cleanly has not said ``Done`` yet while its channel is still
        being read (``reading(rank)``, :meth:`WorkerGroup.reading`): its last messages
        (``PreemptSaved``, ``Done``) come on the channel, its exit from the launcher, and the
        exit can come first. Waited for at most :data:`LAST_MESSAGES_S` after every worker
        exited (a script may exit 0 without a ``Done``)."""
        if self.drained_since is None:
            self.drained_since = time.monotonic()
        if time.monotonic() - self.drained_since > LAST_MESSAGES_S:
            return False
        due = False
        for rank, code in self.exited.items():
            if code != 0 or rank in self.done:
                continue
            if reading(rank):
                due = True
            elif rank not in self.read_out:  # read to its end: one more poll takes its queue
                self.read_out.add(rank)
                due = True
        return due

    def drained(self, failure_grace_s: float, checkpoint_grace_s: float) -> bool:
        """After a failure: whether the group's remaining events are in: every rank exited, or
        every rank failed, or ``failure_grace_s`` passed (held while a live rank finishes a
        checkpoint write of a round every rank reported, up to ``checkpoint_grace_s``)."""
        if self.all_exited:
            return True
        assert self.first_failure_at is not None
        since = time.monotonic() - self.first_failure_at
        # A hung rank's write, or a cut-off one's, will never be reported: not waited for.
        hung = {r for r, f in self.failures.items() if f.kind in ("hang", "unreachable")}
        if self.rounds.writes_in_flight(hung | set(self.exited)):
            return since >= checkpoint_grace_s
        return self.all_failed_or_exited or since > failure_grace_s

    def last_round(self, rank: int) -> int:
        return self.rounds.last_round.get(rank, -1)

    def last_step(self, rank: int) -> int | None:
        return self.health.last_step.get(rank)


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
