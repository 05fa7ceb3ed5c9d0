"""DiLoCo's outer loop in the timing windows: what a worker adds to each window
(:func:`outer_fields`, :mod:`ringtrain.monitor.timing`) and what the readers (the dashboard,
``ringtrain bench``) sum over a rank's windows (:func:`summarize_outer`).

The figures come from the DiLoCo plug-in (:mod:`ringtrain.parallel.diloco`), which tells the
step timer after every inner step what the outer loop cost
(:meth:`~ringtrain.worker.hooks.CommObserver.outer_sync_done`); windows of a run that is not
DiLoCo have none of these fields.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

OUTER_FIELDS = (
    "outer_steps",
    "outer_bytes",
    "outer_sync_s",
    "outer_sync_frac",
    "outer_exchanges",
)
"""The fields of a DiLoCo run's timing windows (:func:`outer_fields`)."""


def outer_fields(
    outer_steps: int, steps: int, window_s: float, sync_s: float, nbytes: float, exchanges: float
) -> dict[str, Any]:
    """A window's figures of DiLoCo's outer loop, from its ``steps`` inner steps (``window_s``
    seconds), which spent ``sync_s`` seconds in the outer loop and sent ``nbytes`` bytes in
    ``exchanges`` exchanges.

    Returns:
        ``outer_steps`` (the rank's outer steps so far, a resumed run's included:
        ``OuterSync.outer_steps``, one per fragment exchange, so streaming DiLoCo with P
        fragments counts P per full sync), ``outer_bytes`` (mean bytes sent per inner step),
        ``outer_sync_s`` (seconds of the window spent in the outer loop: computing outer
        gradients, starting and waiting for exchanges, the outer step and the merge; part of
        ``other_s``), ``outer_sync_frac`` (``outer_sync_s / window_s``, 0 to 1) and
        ``outer_exchanges`` (exchanges started in the window).
    """
    return {
        "outer_steps": int(outer_steps),
        "outer_bytes": nbytes / steps if steps > 0 else 0.0,
        "outer_sync_s": sync_s,
        "outer_sync_frac": sync_s / window_s if window_s > 0 else 0.0,
        "outer_exchanges": int(exchanges),
    }


@dataclass(frozen=True)
class OuterFigures:
    """One rank's outer loop over a set of its timing windows.

    Attributes:
        outer_steps: the outer steps of its last window (its count so far), or ``None``.
        steps: inner steps in the windows.
        bytes_per_step: bytes sent by outer exchanges per inner step (mean over the steps).
        sync_s: seconds spent in the outer loop, in all.
        sync_s_per_step: ``sync_s / steps`` (seconds).
        sync_frac: ``sync_s`` over the windows' step time (0 to 1).
        exchanges: outer exchanges started.
    """

    outer_steps: int | None
    steps: int
    bytes_per_step: float
    sync_s: float
    sync_s_per_step: float
    sync_frac: float
    exchanges: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _num(window: Mapping[str, Any], key: str) -> float | None:
    value = window.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


class OuterSum:
    """:class:`OuterFigures` of one rank, summed window by window (:meth:`add`); what the
    dashboard keeps per rank as a run directory grows."""

    def __init__(self) -> None:
        self.steps = 0
        self.nbytes = self.sync_s = self.window_s = 0.0
        self.exchanges = 0
        self.outer_steps: int | None = None
        self.seen = False

    def add(self, window: Mapping[str, Any]) -> None:
        """Count ``window`` if it has DiLoCo's fields and steps (else nothing)."""
        n, per_step = _num(window, "steps"), _num(window, "outer_bytes")
        sync = _num(window, "outer_sync_s")
        if n is None or n <= 0 or per_step is None or sync is None:
            return
        self.seen = True
        self.steps += int(n)
        self.nbytes += per_step * n
        self.sync_s += sync
        self.window_s += _num(window, "window_s") or 0.0
        self.exchanges += int(_num(window, "outer_exchanges") or 0)
        count = _num(window, "outer_steps")
        self.outer_steps = int(count) if count is not None else self.outer_steps

    def figures(self) -> OuterFigures | None:
        """The sums so far, or ``None`` when no window counted."""
        if not self.seen:
            return None
        return OuterFigures(
            outer_steps=self.outer_steps,
            steps=self.steps,
            bytes_per_step=self.nbytes / self.steps,
            sync_s=self.sync_s,
            sync_s_per_step=self.sync_s / self.steps,
            sync_frac=self.sync_s / self.window_s if self.window_s > 0 else 0.0,
            exchanges=self.exchanges,
        )


def summarize_outer(windows: Iterable[Mapping[str, Any]]) -> OuterFigures | None:
    """Sum DiLoCo's figures over one rank's ``windows`` (in the order written); windows
    without them (or without steps) are left out.

    Returns:
        The rank's :class:`OuterFigures`, or ``None`` when no window has DiLoCo's fields (a run
        that is not DiLoCo, or an older run directory).
    """
    total = OuterSum()
    for window in windows:
        total.add(window)
    return total.figures()


def outer_by_rank(windows: Iterable[Mapping[str, Any]]) -> dict[int, OuterFigures]:
    """:func:`summarize_outer` of each rank's windows (those with an integer ``rank``), by
    rank; empty for a run that is not DiLoCo."""
    by_rank: dict[int, list[Mapping[str, Any]]] = {}
    for w in windows:
        rank = w.get("rank")
        if isinstance(rank, int) and not isinstance(rank, bool):
            by_rank.setdefault(rank, []).append(w)
    out = {}
    for rank in sorted(by_rank):
        figures = summarize_outer(by_rank[rank])
        if figures is not None:
            out[rank] = figures
    return out
