"""The live panel of :class:`RichProgress`: the driver's progress display on a terminal.

Use it through :func:`ringtrain.monitor.progress.make_progress`; :mod:`ringtrain.monitor.progress`
re-exports :class:`RichProgress` and holds the :class:`ProgressReporter` protocol, the plain-lines
and silent reporters.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ringtrain.monitor.console_io import stop_live, whole_writes
from ringtrain.monitor.eta import RunProgress
from ringtrain.monitor.render import format_duration, format_metrics, format_value

__all__ = ["WORKER_STATES", "RichProgress"]

#: The states :meth:`ProgressReporter.worker_state` is called with.
WORKER_STATES = ("starting", "running", "finished", "failed", "stopped")

_STATE_STYLES = {
    "starting": "yellow",
    "running": "cyan",
    "finished": "green",
    "failed": "bold red",
    "stopped": "dim",
}
_STATUS_STYLES = {
    "FINISHED": "green",
    "ERRORED": "red",
    "ABORTED": "yellow",
    "STOPPED": "magenta",
    "PREEMPTED": "blue",
}
_FIRST_KEYS = ("epoch",)


class _ReporterBase(abc.ABC):
    """Context-manager support: ``with reporter:`` closes it, ``ERRORED`` on an exception."""

    @abc.abstractmethod
    def close(self, status: str) -> None: ...

    def __enter__(self) -> _ReporterBase:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            status = "FINISHED"
        elif issubclass(exc_type, KeyboardInterrupt):
            status = "ABORTED"
        else:
            status = "ERRORED"
        self.close(status)


@dataclass
class _Worker:
    state: str = "starting"
    round: int | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    timing: dict[str, Any] | None = None
    straggler: bool = False


class RichProgress(_ReporterBase):
    """A live panel on a terminal, redrawn about ``refresh_per_second`` times a second.

    The panel shows the run name, elapsed time, the last completed round (and epoch, if the
    metrics have one), rank 0's latest metrics and a table of workers: rank, state, last round
    reported and last metric values. Messages are printed above the panel. The panel is left on
    screen, with the final status, by :meth:`close`.

    The public methods are meant for one thread (the driver's loop); the panel is redrawn by
    rich's refresh thread, which only reads a snapshot taken under a lock.

    Args:
        console: The console to draw on; if None, one on stdout whose writes are never cut
            short (:class:`ringtrain.monitor.console_io.WholeWrites`).
        refresh_per_second: Redraws per second.
        clock: Monotonic clock in seconds (injectable for tests).
        max_worker_rows: Show at most this many workers in the table; the rest are summarised.
        max_metric_columns: Show at most this many metric columns in the worker table.
    """

    def __init__(
        self,
        console: Console | None = None,
        *,
        refresh_per_second: float = 4.0,
        clock: Callable[[], float] = time.monotonic,
        max_worker_rows: int = 16,
        max_metric_columns: int = 6,
    ) -> None:
        self._console = console if console is not None else Console(file=whole_writes())
        self._refresh_per_second = refresh_per_second
        self._clock = clock
        self._max_worker_rows = max(1, max_worker_rows)
        self._max_metric_columns = max(0, max_metric_columns)
        self._lock = threading.Lock()
        self._live: Live | None = None
        self._name = "ringtrain"
        self._world_size = 0
        self._run_dir = ""
        self._t0 = clock()
        self._t_end: float | None = None
        self._workers: dict[int, _Worker] = {}
        self._round: int | None = None
        self._metrics: dict[str, Any] = {}
        self._status: str | None = None
        self._closed = False
        self._progress = RunProgress()

    @property
    def console(self) -> Console:
        """The console the panel is drawn on."""
        return self._console

    def start(self, name: str, world_size: int, run_dir: str) -> None:
        """Starts the live panel. See :meth:`ProgressReporter.start`."""
        with self._lock:
            self._name = name
            self._world_size = world_size
            self._run_dir = run_dir
            self._t0 = self._clock()
            for rank in range(world_size):
                self._workers.setdefault(rank, _Worker())
        if self._live is not None or self._closed:
            return
        live = Live(
            console=self._console,
            refresh_per_second=self._refresh_per_second,
            get_renderable=self._render,
            transient=False,
        )
        live.start()
        self._live = live

    def worker_state(self, rank: int, state: str) -> None:
        """Records a worker's state. See :meth:`ProgressReporter.worker_state`."""
        with self._lock:
            self._workers.setdefault(rank, _Worker()).state = state

    def report(self, rank: int, round: int, metrics: dict[str, Any]) -> None:
        """Records a rank's report. See :meth:`ProgressReporter.report`."""
        with self._lock:
            worker = self._workers.setdefault(rank, _Worker())
            worker.round = round
            worker.metrics = dict(metrics)
            if worker.state == "starting":
                worker.state = "running"

    def round_complete(self, round: int, metrics: dict[str, Any]) -> None:
        """Records a completed round. See :meth:`ProgressReporter.round_complete`."""
        with self._lock:
            self._round = round
            self._metrics = dict(metrics)
            epoch = metrics.get("epoch")
            if isinstance(epoch, int) and not isinstance(epoch, bool):
                self._progress.epoch_done(epoch, self._clock())

    def timing(self, rank: int, window: dict[str, Any]) -> None:
        """Records a rank's timing window (step time and samples/s columns); rank 0's
        ``progress_*`` fields (``TrainState.epochs``) move the progress bar."""
        with self._lock:
            self._workers.setdefault(rank, _Worker()).timing = dict(window)
            if rank == 0:
                self._progress.update(window, self._clock())

    def straggler(self, rank: int, flagged: bool) -> None:
        """Marks or unmarks a rank as a straggler (its row turns red)."""
        with self._lock:
            self._workers.setdefault(rank, _Worker()).straggler = flagged

    def message(self, text: str) -> None:
        """Prints a line above the panel. See :meth:`ProgressReporter.message`."""
        with self._lock:
            elapsed = (self._t_end or self._clock()) - self._t0
        # Never print while holding self._lock: the refresh thread holds rich's lock and waits
        # for ours inside _render.
        self._console.print(Text.assemble((f"{format_duration(elapsed):>7} ", "dim"), text))

    def close(self, status: str) -> None:
        """Stops the live panel, leaving its final state (with ``status``) on screen.

        The panel is stopped even if drawing it fails. Only the first call has an effect.
        """
        if self._closed:
            return
        self._closed = True
        live, self._live = self._live, None
        try:
            with self._lock:
                self._status = status
                self._t_end = self._clock()
                # Workers still shown as busy are not any more: the final panel says so.
                after = "finished" if status == "FINISHED" else "stopped"
                for worker in self._workers.values():
                    if worker.state in ("starting", "running"):
                        worker.state = after
                if status == "FINISHED":
                    self._progress.finish()
        finally:
            if live is not None:
                stop_live(live)  # the final frame, whole

    # -- drawing ---------------------------------------------------------------------------

    def _render(self) -> RenderableType:
        try:
            with self._lock:
                return self._build()
        except Exception as exc:  # drawing must never take the run down
            return Text(f"[progress display error: {exc!r}]", style="red")

    def _build(self) -> RenderableType:
        elapsed = (self._t_end if self._t_end is not None else self._clock()) - self._t0
        counts: dict[str, int] = {}
        for worker in self._workers.values():
            counts[worker.state] = counts.get(worker.state, 0) + 1

        header = Text()
        if self._status is not None:
            header.append(self._status, style=_STATUS_STYLES.get(self._status, "bold"))
            header.append("   ")
        header.append("elapsed ", style="dim")
        header.append(format_duration(elapsed))
        header.append("   round ", style="dim")
        header.append("-" if self._round is None else str(self._round))
        # The round's epoch, as the rows (and the plain lines) give it; without one reported,
        # the epoch being trained (TrainState.epochs' windows).
        epoch = self._cell(self._metrics, "epoch") or self._progress.epoch_label()
        if epoch:
            header.append("   epoch ", style="dim")
            header.append(epoch)
        header.append("   workers ", style="dim")
        order = [s for s in WORKER_STATES if s in counts]
        order += sorted(s for s in counts if s not in WORKER_STATES)
        header.append(", ".join(f"{counts[s]} {s}" for s in order) or "-")

        metrics_line = Text()
        metrics_line.append("metrics ", style="dim")
        metrics_line.append(
            format_metrics({k: v for k, v in self._metrics.items() if k != "epoch"}, max_items=12)
            or "-"
        )
        speed = _speed_text({r: w.timing for r, w in self._workers.items() if w.timing})
        if speed:
            metrics_line.append("   speed ", style="dim")
            metrics_line.append(speed)

        parts: list[RenderableType] = [header, metrics_line]
        bar = self._progress_bar(elapsed)
        if bar is not None:
            parts.append(bar)
        if self._workers:
            parts.append(self._worker_table())
        border = _STATUS_STYLES.get(self._status or "", "blue")
        # Two columns short of the terminal: the "^C" a terminal echoes after the panel's last
        # line then does not wrap it, which would leave a stray top border on the next redraw.
        width = max(20, self._console.width - 2)
        return Panel(
            Group(*parts),
            title=Text(f"ringtrain · {self._name}", style="bold"),
            title_align="left",
            subtitle=Text(self._run_dir, style="dim") if self._run_dir else None,
            subtitle_align="right",
            border_style=border,
            width=width,
        )

    def _cell(self, metrics: dict[str, Any], key: str) -> str:
        """A worker table cell; ``epoch`` 1-based of the total when it is known, as the header
        (and the worker's ``epoch k/N`` line) shows it."""
        if key not in metrics:
            return ""
        value = metrics[key]
        total = self._progress.epochs
        if key == "epoch" and total is not None and isinstance(value, int):
            return f"{min(value + 1, total)}/{total}"
        return format_value(value, 12)

    def _progress_bar(self, elapsed: float) -> RenderableType | None:
        """The bar with percent and ETA, when the run's length is known (else None)."""
        fraction = self._progress.fraction
        if fraction is None:
            return None
        text = Text(f" {fraction * 100:5.1f}%", no_wrap=True)
        if self._status is None:
            eta = self._progress.eta_s(self._clock())
            text.append("   ETA ", style="dim")
            text.append("-" if eta is None else format_duration(eta))
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1)
        grid.add_column(no_wrap=True)
        grid.add_row(ProgressBar(total=1.0, completed=fraction), text)
        return grid

    def _worker_table(self) -> Table:
        ranks = sorted(self._workers)
        keys: dict[str, None] = {}
        for rank in ranks:
            for key in self._workers[rank].metrics:
                keys.setdefault(key, None)
        shown_keys = list(keys)[: self._max_metric_columns]
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
        table.add_column("Rank", justify="right", no_wrap=True)
        table.add_column("State", no_wrap=True)
        table.add_column("Round", justify="right", no_wrap=True)
        timed = any(self._workers[r].timing for r in ranks)
        # No samples counted (no prepared loader): no throughput column, rather than zeros.
        counted = any(_counted(self._workers[r].timing) for r in ranks)
        if timed:
            table.add_column("s/step", justify="right", no_wrap=True)
            if counted:
                table.add_column("samples/s", justify="right", no_wrap=True)
        for key in shown_keys:
            table.add_column(key, justify="right", no_wrap=True, overflow="ellipsis")
        limit = self._max_worker_rows
        shown = ranks[: limit - 1] if len(ranks) > limit else ranks
        for rank in shown:
            w = self._workers[rank]
            speed: list[str] = []
            if timed:
                t = w.timing or {}
                speed = [f"{t['step_s']:.3g}" if "step_s" in t else ""]
                if counted:
                    speed.append(f"{t['samples_per_s']:.4g}" if "samples_per_s" in t else "")
            state = Text(w.state, style=_STATE_STYLES.get(w.state, ""))
            if w.straggler:
                state.append(" straggler", style="bold red")
            table.add_row(
                str(rank),
                state,
                "-" if w.round is None else str(w.round),
                *speed,
                *(self._cell(w.metrics, k) for k in shown_keys),
                style="red" if w.straggler else None,
            )
        hidden = len(ranks) - len(shown)
        if hidden:
            table.add_row(
                "…",
                Text(f"{hidden} more", style="dim"),
                "",
                *([""] * (int(timed) + int(timed and counted))),
                *("" for _ in shown_keys),
            )
        return table


def _speed_text(windows: dict[int, dict[str, Any]]) -> str:
    """``"0.052 s/step, 2460 samples/s"``: the slowest rank's median step time and the total
    throughput of the latest windows ("" without any)."""
    steps = [w["step_s"] for w in windows.values() if isinstance(w.get("step_s"), (int, float))]
    if not steps:
        return ""
    if not any(_counted(w) for w in windows.values()):  # no prepared loader counts samples
        return f"{max(steps):.3g} s/step"
    total = sum(float(w.get("samples_per_s") or 0.0) for w in windows.values())
    return f"{max(steps):.3g} s/step, {total:.4g} samples/s"


def _counted(window: dict[str, Any] | None) -> bool:
    """Whether a timing window counted samples (a prepared data loader did)."""
    value = (window or {}).get("samples_per_s")
    return isinstance(value, (int, float)) and value > 0
