"""How far a run is, and when it will be done: the live panel's progress bar and ETA.

Workers inside ``TrainState.epochs(N)`` send where they are with each timing window
(``progress_epoch``, ``progress_epochs``, ``progress_epoch_steps``, ``progress_epoch_start_step``;
see :func:`ringtrain.worker.session.note_epoch`); :class:`RunProgress` folds rank 0's windows and
the completed rounds' ``epoch`` metric into a fraction done, a 1-based ``epoch k/N`` label and an
ETA.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RunProgress"]


class RunProgress:
    """How far the run is, from rank 0's timing windows (``progress_*`` fields, sent while
    ``TrainState.epochs(N)`` runs) and the completed rounds' ``epoch`` metric.

    The fraction done is ``(epoch + steps into it / steps per epoch) / epochs``, never going
    back; the ETA extrapolates the rate since the first known position (so a resumed run's
    earlier epochs do not count as fast)."""

    def __init__(self) -> None:
        self.epochs: int | None = None
        self.epoch: int | None = None  # 0-based, the one being trained
        self.done: float | None = None
        self._first: tuple[float, float] | None = None  # (time, fraction) when first known
        self._last: tuple[float, float] | None = None

    @property
    def fraction(self) -> float | None:
        """Done, 0.0-1.0, or None while the length is unknown."""
        return self.done

    def _move(self, fraction: float, now: float) -> None:
        fraction = min(1.0, max(0.0, fraction))
        if self.done is not None and fraction <= self.done:
            return
        self.done = fraction
        if self._first is None:
            self._first = (now, fraction)
        self._last = (now, fraction)

    def update(self, window: dict[str, Any], now: float) -> None:
        """Folds in a timing window's ``progress_*`` fields (windows without them are ignored)."""
        epochs, epoch = window.get("progress_epochs"), window.get("progress_epoch")
        if not isinstance(epochs, int) or not isinstance(epoch, int) or epochs <= 0:
            return
        self.epochs = epochs
        self.epoch = epoch if self.epoch is None else max(self.epoch, epoch)
        within = 0.0
        steps, start, step = (
            window.get("progress_epoch_steps"),
            window.get("progress_epoch_start_step"),
            window.get("step"),
        )
        if (
            isinstance(steps, int)
            and steps > 0
            and isinstance(start, int)
            and isinstance(step, int)
        ):
            within = min(1.0, max(0.0, (step - start) / steps))
        if self._first is None and epoch > 0 and within == 0.0:
            self._first = (now, epoch / epochs)  # a resumed run: count its rate from here
        self._move((epoch + within) / epochs, now)

    def epoch_done(self, epoch: int, now: float) -> None:
        """A round completed with metric ``epoch`` (0-based, as ``TrainState.epochs`` yields)."""
        if self.epochs is not None:
            self.epoch = epoch if self.epoch is None else max(self.epoch, epoch)
            self._move((epoch + 1) / self.epochs, now)

    def finish(self) -> None:
        """The run finished: the bar is full."""
        if self.done is not None:
            self.done = 1.0

    def epoch_label(self) -> str | None:
        """``"3/4"``: the epoch being trained (or just finished), 1-based, as the worker's own
        ``f"epoch {epoch + 1}/{epochs}"`` prints it; None while the total is unknown."""
        if self.epochs is None or self.epoch is None:
            return None
        return f"{min(self.epoch + 1, self.epochs)}/{self.epochs}"

    def eta_s(self, now: float) -> float | None:
        """Seconds left at the rate since the first known position; None before a rate."""
        if self._first is None or self._last is None or self.done is None:
            return None
        t0, f0 = self._first
        t1, f1 = self._last
        if f1 <= f0 or t1 <= t0:
            return None
        rate = (f1 - f0) / (t1 - t0)
        return max(0.0, (1.0 - self.done) / rate - (now - t1))
