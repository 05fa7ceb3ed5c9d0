"""The controller's book-keeping of one worker-group generation (:class:`Generation`) and of an
elastic grow in progress (:class:`Grow`)."""

from __future__ import annotations

import time
from typing import Any

from ringtrain.channel import Interrupted
from ringtrain.controller.health import Health
from ringtrain.controller.rounds import Rounds
from ringtrain.result import WorkerFailure


class Generation:
    """One worker group: attempt ``number`` (0 first, +1 per restart), whose ``world_size``
    workers run together. An elastic resize or grow makes a new generation with the same
    attempt number.

    ``rounds``: reports and checkpoint outcomes; ``health``: liveness; ``exited``: rank ->
    return code; ``done``: ranks whose train function returned; ``failures``: rank -> failure;
    ``first_failure_at``: monotonic time of the first failure (None: none yet). Elastic runs:
    ``interrupted``: ranks waiting for a Resize; ``elastic_fallback``: this generation gave up
    on resizing in place; ``resize``: the resize that started this generation (its event is
    written once the first step after it completes).
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

    @property
    def started_at(self) -> float:
        return self.health.started_at

    @property
    def all_exited(self) -> bool:
        return len(self.exited) == self.world_size

    @property
    def all_failed_or_exited(self) -> bool:
        return all(r in self.failures or r in self.exited for r in range(self.world_size))

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
