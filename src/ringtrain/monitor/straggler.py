"""Straggler detection on the driver, from the workers' timing windows.

In synchronous data parallelism every rank waits for the slowest one inside the gradient allreduce,
so the wall time of a step is the same on every rank: a slow rank makes the others slow. What
differs is where the time goes. A rank's *busy time* per step (``busy_s``: the step minus
``comm_exposed_s``, the communication it waited for after its own backward was done) is its own
work; the fast ranks spend the difference waiting in the allreduce. So a rank is a straggler when

    busy_s(rank) > (1 + threshold) * median(busy_s of the other ranks)

in ``patience`` consecutive windows of its own; it is cleared after ``patience`` consecutive
windows back under the threshold. The reason given is the part of the step (data wait, compute,
optimizer, other) where the rank spends the most extra time compared with the median of the
others. Communication itself is never the reason: a ring allreduce finishes at the same moment on
every rank, so a slow link shows up as exposed communication on all of them, not on one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

REASONS = {
    "data_s": ("data", "waiting for data"),
    "compute_s": ("compute", "forward and backward"),
    "optimizer_s": ("optimizer", "the optimizer step"),
    "other_s": ("other", "time outside the data loader, model and optimizer"),
}


@dataclasses.dataclass(frozen=True)
class StragglerEvent:
    """A rank flagged as a straggler (``flagged=True``) or back in line (``flagged=False``).

    Attributes:
        rank: the rank.
        flagged: True when it becomes a straggler, False when it is cleared.
        busy_s: its busy time per step in the window that decided (seconds).
        median_s: the median busy time per step of the other ranks (seconds).
        ratio: ``busy_s / median_s``.
        reason: where its extra time goes: ``"data"``, ``"compute"``, ``"optimizer"`` or
            ``"other"`` (``""`` when cleared).
        message: one line for people.
        time: when it was decided (Unix seconds).
    """

    rank: int
    flagged: bool
    busy_s: float
    median_s: float
    ratio: float
    reason: str
    message: str
    time: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class StragglerDetector:
    """Flags stragglers from timing windows (see the module docstring for the rule).

    Args:
        threshold: the margin over the others' median busy time (0.2: 20 % slower).
        patience: consecutive windows over (or under) the threshold to flag (or clear) a rank.
        min_busy_s: ignore windows whose others' median busy time is below this (seconds): a
            relative margin on microsecond steps is noise.
    """

    def __init__(self, threshold: float = 0.2, patience: int = 2, min_busy_s: float = 1e-4):
        self.threshold = threshold
        self.patience = patience
        self.min_busy_s = min_busy_s
        self.latest: dict[int, dict[str, Any]] = {}
        self.flagged: set[int] = set()
        self._over: dict[int, int] = {}
        self._under: dict[int, int] = {}

    def reset(self) -> None:
        """Forget every window (a new attempt of the worker group starts)."""
        self.latest.clear()
        self.flagged.clear()
        self._over.clear()
        self._under.clear()

    def update(
        self, rank: int, window: dict[str, Any], now: float | None = None
    ) -> list[StragglerEvent]:
        """Take ``rank``'s new timing window; return the flag/clear events it causes (at most
        one, for ``rank``)."""
        now = time.time() if now is None else now
        self.latest[rank] = window
        others = [w for r, w in self.latest.items() if r != rank]
        busy = _busy(window)
        if not others or busy is None:
            return []
        timed = {r: b for r, w in self.latest.items() if r != rank and (b := _busy(w)) is not None}
        if not timed:
            return []
        median = statistics.median(timed.values())
        # What the rank is compared with: the one other rank, or the others' median.
        versus = (
            f"{median:.3g} s/step of rank {next(iter(timed))}"
            if len(timed) == 1
            else f"{median:.3g} s/step, the median of the other ranks"
        )
        if median < self.min_busy_s:
            return []
        ratio = busy / median
        if ratio > 1 + self.threshold:
            self._over[rank] = self._over.get(rank, 0) + 1
            self._under[rank] = 0
            if rank not in self.flagged and self._over[rank] >= self.patience:
                self.flagged.add(rank)
                key = _reason(window, others)
                name, words = REASONS[key]
                message = (
                    f"rank {rank} is a straggler: busy {busy:.3g} s/step vs {versus} "
                    f"({ratio:.2f}x); most of its extra time is {words}"
                )
                return [StragglerEvent(rank, True, busy, median, ratio, name, message, now)]
        else:
            self._under[rank] = self._under.get(rank, 0) + 1
            self._over[rank] = 0
            if rank in self.flagged and self._under[rank] >= self.patience:
                self.flagged.discard(rank)
                message = f"rank {rank} is no longer a straggler ({busy:.3g} s/step vs {versus})"
                return [StragglerEvent(rank, False, busy, median, ratio, "", message, now)]
        return []


def _busy(window: dict[str, Any]) -> float | None:
    value = window.get("busy_s")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return float(value)
    return None


def _reason(window: dict[str, Any], others: list[dict[str, Any]]) -> str:
    """The part of the step where ``window`` exceeds the others' median the most."""
    best, best_excess = "other_s", float("-inf")
    for key in REASONS:
        values = [float(w.get(key) or 0.0) for w in others]
        excess = float(window.get(key) or 0.0) - statistics.median(values)
        if excess > best_excess:
            best, best_excess = key, excess
    return best
