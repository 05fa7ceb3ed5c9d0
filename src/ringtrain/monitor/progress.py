"""The driver's live progress display.

The driver calls one :class:`ProgressReporter` from its event loop (one thread) as workers start,
report and finish. :func:`make_progress` picks the display: a live rich panel on a terminal
(:class:`RichProgress`), plain log lines otherwise (:class:`PlainProgress`), or nothing
(:class:`NullProgress`).

Typical use::

    progress = make_progress("auto")
    progress.start("mnist", world_size=2, run_dir="/abs/runs/mnist")
    try:
        ...  # progress.worker_state(...), progress.report(...), progress.round_complete(...)
    finally:
        progress.close(status)
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO, runtime_checkable

from rich.console import Console

from ringtrain.monitor.console_io import whole_writes
from ringtrain.monitor.eta import RunProgress
from ringtrain.monitor.panel import (
    _FIRST_KEYS,
    WORKER_STATES,
    RichProgress,
    _ReporterBase,
    _speed_text,
)
from ringtrain.monitor.render import format_duration, format_metrics

__all__ = [
    "WORKER_STATES",
    "NullProgress",
    "PlainProgress",
    "ProgressReporter",
    "RichProgress",
    "make_progress",
]


@runtime_checkable
class ProgressReporter(Protocol):
    """What the driver tells the progress display. All methods are called from one thread."""

    def start(self, name: str, world_size: int, run_dir: str) -> None:
        """The run starts.

        Args:
            name: The run's name.
            world_size: Number of workers.
            run_dir: The run directory (local path or fsspec URL).
        """
        ...

    def worker_state(self, rank: int, state: str) -> None:
        """A worker changed state.

        Args:
            rank: The worker's rank.
            state: ``"starting"``, ``"running"``, ``"finished"``, ``"failed"`` or ``"stopped"``.
        """
        ...

    def report(self, rank: int, round: int, metrics: dict[str, Any]) -> None:
        """One rank's report arrived.

        Args:
            rank: The reporting worker's rank.
            round: The 0-based report round on that rank.
            metrics: The reported metrics.
        """
        ...

    def round_complete(self, round: int, metrics: dict[str, Any]) -> None:
        """All ranks have reported a round.

        Args:
            round: The 0-based report round.
            metrics: Rank 0's metrics of that round.
        """
        ...

    def timing(self, rank: int, window: dict[str, Any]) -> None:
        """A rank's step-timing window arrived.

        Args:
            rank: The worker's rank.
            window: Its window (``step_s``, ``samples_per_s``, the parts...; see
                :meth:`ringtrain.monitor.timing.StepTimer.take_window`).
        """
        ...

    def straggler(self, rank: int, flagged: bool) -> None:
        """A rank was flagged as a straggler (``flagged``) or cleared.

        Args:
            rank: The worker's rank.
            flagged: True when flagged, False when cleared.
        """
        ...

    def message(self, text: str) -> None:
        """A notable event: a checkpoint saved, a failure, a restart.

        Args:
            text: The line to show.
        """
        ...

    def close(self, status: str) -> None:
        """The run is over; stop the display. Safe to call more than once.

        Args:
            status: The run's final status (``FINISHED``, ``ERRORED``, ``ABORTED``).
        """
        ...


class NullProgress(_ReporterBase):
    """A reporter that shows nothing (mode ``"off"``)."""

    def start(self, name: str, world_size: int, run_dir: str) -> None:
        """Does nothing."""

    def worker_state(self, rank: int, state: str) -> None:
        """Does nothing."""

    def report(self, rank: int, round: int, metrics: dict[str, Any]) -> None:
        """Does nothing."""

    def round_complete(self, round: int, metrics: dict[str, Any]) -> None:
        """Does nothing."""

    def timing(self, rank: int, window: dict[str, Any]) -> None:
        """Does nothing."""

    def straggler(self, rank: int, flagged: bool) -> None:
        """Does nothing."""

    def message(self, text: str) -> None:
        """Does nothing."""

    def close(self, status: str) -> None:
        """Does nothing."""


class PlainProgress(_ReporterBase):
    """Plain log lines, for logs and pipes.

    One line when the run starts, one per completed round (every round by default; with
    ``min_interval_s`` > 0 at most one per that many seconds, a round line held back being
    written before the next message and at close, so the last round always shows), one per
    message and one at close::

        [mnist] started: 2 workers, run directory /abs/runs/mnist
        [mnist] round 3 epoch=2 loss=0.1234 val_acc=0.9712 (12.3s)
        [mnist] FINISHED in 1m 32s (4 rounds)

    Args:
        stream: Where to write; ``sys.stdout`` if None.
        min_interval_s: Shortest time between two round lines, in seconds; 0 (the default)
            writes every round.
        clock: Monotonic clock in seconds (injectable for tests).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        *,
        min_interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stream = stream if stream is not None else sys.stdout
        self._min_interval_s = min_interval_s
        self._clock = clock
        self._name = "ringtrain"
        self._t0 = clock()
        self._last_round_line_at: float | None = None
        self._pending: str | None = None
        self._last_round: int | None = None
        self._closed = False
        self._timing: dict[int, dict[str, Any]] = {}
        self._progress = RunProgress()

    def _write(self, line: str) -> None:
        try:
            self._stream.write(line + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            pass  # a closed or broken stream must not break the run

    def _prefix(self) -> str:
        return f"[{self._name}]"

    def _flush_pending(self) -> None:
        if self._pending is not None:
            self._write(self._pending)
            self._pending = None
            self._last_round_line_at = self._clock()

    def start(self, name: str, world_size: int, run_dir: str) -> None:
        """Writes the start line. See :meth:`ProgressReporter.start`."""
        self._name = name
        self._t0 = self._clock()
        plural = "s" if world_size != 1 else ""
        self._write(
            f"{self._prefix()} started: {world_size} worker{plural}, run directory {run_dir}"
        )

    def worker_state(self, rank: int, state: str) -> None:
        """Writes nothing: the driver reports notable worker events through :meth:`message`."""

    def report(self, rank: int, round: int, metrics: dict[str, Any]) -> None:
        """Writes nothing: rounds are written once complete, by :meth:`round_complete`."""

    def round_complete(self, round: int, metrics: dict[str, Any]) -> None:
        """Writes the round's line, or holds it back if the last one was too recent.

        See :meth:`ProgressReporter.round_complete`.
        """
        now = self._clock()
        self._last_round = round
        parts = [self._prefix(), f"round {round}"]
        epoch, total = metrics.get("epoch"), self._progress.epochs
        if isinstance(epoch, int) and not isinstance(epoch, bool) and total is not None:
            # This round's epoch, 1-based of the total, as the worker prints it: "epoch 2/4".
            parts.append(f"epoch {min(epoch + 1, total)}/{total}")
            metrics = {k: v for k, v in metrics.items() if k != "epoch"}
        text = format_metrics(metrics, first=_FIRST_KEYS)
        if text:
            parts.append(text)
        speed = _speed_text(self._timing)
        if speed:
            parts.append(f"[{speed}]")
        parts.append(f"({format_duration(now - self._t0)})")
        line = " ".join(parts)
        last = self._last_round_line_at
        if last is None or now - last >= self._min_interval_s:
            self._pending = None
            self._write(line)
            self._last_round_line_at = now
        else:
            self._pending = line  # superseded by a later round, or written before the next line

    def timing(self, rank: int, window: dict[str, Any]) -> None:
        """Keeps the window: round lines show the step time and throughput, and the epoch as
        ``epoch k/N`` once rank 0's windows tell N (``TrainState.epochs``)."""
        self._timing[rank] = window
        if rank == 0:
            self._progress.update(window, self._clock())

    def straggler(self, rank: int, flagged: bool) -> None:
        """Writes nothing: the driver announces stragglers through :meth:`message`."""

    def message(self, text: str) -> None:
        """Writes the message (after any held-back round line). See
        :meth:`ProgressReporter.message`."""
        self._flush_pending()
        first, *rest = text.splitlines() or [""]
        self._write(f"{self._prefix()} {first}")
        for line in rest:
            self._write(line)

    def close(self, status: str) -> None:
        """Writes any held-back round line and the final line. Only the first call writes."""
        if self._closed:
            return
        self._closed = True
        self._flush_pending()
        line = f"{self._prefix()} {status} in {format_duration(self._clock() - self._t0)}"
        if self._last_round is not None:
            n = self._last_round + 1
            line += f" ({n} round{'s' if n != 1 else ''})"
        self._write(line)


def make_progress(mode: str = "auto", stream: TextIO | None = None) -> ProgressReporter:
    """Makes the driver's progress reporter.

    Args:
        mode: ``"auto"`` (a live panel when ``stream`` is a terminal, plain lines otherwise),
            ``"rich"`` (the live panel, even if ``stream`` is not a terminal), ``"plain"`` or
            ``"off"`` (shows nothing). Case-insensitive.
        stream: Where to write; ``sys.stdout`` if None.

    Returns:
        The reporter.

    Raises:
        ValueError: ``mode`` is not one of the above.
    """
    mode = mode.lower().strip()
    if mode == "off":
        return NullProgress()
    if mode == "plain":
        return PlainProgress(stream)
    if mode == "rich":
        return RichProgress(Console(file=whole_writes(stream), force_terminal=True))
    if mode == "auto":
        console = Console(file=whole_writes(stream))
        if console.is_terminal and not console.is_dumb_terminal:
            return RichProgress(console)
        return PlainProgress(stream)
    raise ValueError(f"progress mode must be 'auto', 'rich', 'plain' or 'off', not {mode!r}")
