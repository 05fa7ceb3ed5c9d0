"""The sweep's terminal output: a live table of trials on a terminal, one line per trial event
otherwise, and the final summary."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from ringtrain.monitor.console_io import stop_live, whole_writes, write_whole

STATUS_STYLES = {
    "PENDING": "dim",
    "RUNNING": "bold cyan",
    "COMPLETE": "green",
    "PRUNED": "yellow",
    "FAILED": "bold red",
    "STOPPED": "magenta",
}


@dataclass
class TrialRow:
    """What the table shows of one trial."""

    number: int
    params: dict[str, Any]
    status: str = "PENDING"
    iterations: int = 0
    last: float | None = None
    best: float | None = None
    started: float | None = None
    ended: float | None = None
    error: str | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started


def fmt_value(v: Any) -> str:
    """A compact cell: 4 significant digits for floats."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class SweepDisplay:
    """Shows the trials of a sweep.

    Args:
        name: the sweep's name.
        metric: the metric being optimised; ``mode``: ``"max"`` or ``"min"`` (both ``None``
            for a sweep without a metric: the table then has no metric columns).
        columns: the hyperparameter columns (flat keys).
        mode_display: ``"auto"`` (live table on a terminal, plain lines otherwise), ``"rich"``,
            ``"plain"`` or ``"off"``.
        stream: where to write (``sys.stdout`` if None).
        total: the number of trials the sweep runs; with it the live table has a progress bar
            (trials ended / total) and an ETA, and plain lines of ended trials say
            ``[3/6 trials, ETA 1m 02s]``.

    Thread-safe: trial threads update rows; the table is redrawn by rich's refresh thread.
    """

    def __init__(
        self,
        name: str,
        metric: str | None,
        mode: str | None,
        columns: Sequence[str],
        mode_display: str = "auto",
        stream: TextIO | None = None,
        total: int | None = None,
    ) -> None:
        self.name = name
        self.total = total
        self._t_start = time.monotonic()
        self._done_at_start = 0
        self.metric = metric
        self.mode = mode
        self.columns = list(columns)
        self.rows: dict[int, TrialRow] = {}
        self._lock = threading.Lock()
        self._stream = stream or sys.stdout
        display = mode_display.lower().strip()
        if display not in ("auto", "rich", "plain", "off"):
            raise ValueError(
                f"progress mode must be 'auto', 'rich', 'plain' or 'off', not {mode_display!r}"
            )
        console = Console(
            file=whole_writes(self._stream), force_terminal=True if display == "rich" else None
        )
        if display == "auto":
            display = "rich" if console.is_terminal and not console.is_dumb_terminal else "plain"
        self.display = display
        self.console = console
        self._live: Live | None = None

    # ------------------------------------------------------------------ updates
    def start(self, capacity_text: str) -> None:
        self.line(f"[{self.name}] sweep started: {capacity_text}")
        with self._lock:
            self._t_start = time.monotonic()
            self._done_at_start = self._ended()  # a resumed sweep's earlier trials
        if self.display == "rich":
            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False)
            self._live.start()

    def add(self, row: TrialRow) -> None:
        with self._lock:
            self.rows[row.number] = row

    def update(self, number: int, event: str | None = None, **changes: Any) -> None:
        """Change trial ``number``'s row; ``event`` (e.g. ``"PRUNED at iteration 2"``) is printed
        as a line in plain mode."""
        with self._lock:
            row = self.rows[number]
            for k, v in changes.items():
                setattr(row, k, v)
        if event and self.display == "plain":
            params = ", ".join(f"{k}={fmt_value(v)}" for k, v in row.params.items())
            progress = ""
            if self.total and row.status in _ENDED:
                with self._lock:
                    ended, eta = self._ended(), self._eta_s()
                progress = f" [{ended}/{self.total} trials, ETA {_fmt_eta(eta)}]"
            self.line(f"[{self.name}] trial {number:04d} {event} ({params}){progress}")

    def line(self, text: str) -> None:
        if self.display == "off":
            return
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            write_whole(self._stream, text + "\n")  # a full non-blocking pipe waits

    def close(self) -> None:
        if self._live is not None:
            live, self._live = self._live, None
            stop_live(live)

    # ------------------------------------------------------------------ rendering
    def best_row(self) -> TrialRow | None:
        """The best trial: the best *last* reported value (the value Optuna records for the
        trial, and what ``ResultGrid.get_best_result()`` ranks by); the lowest number on ties."""
        scored = [r for r in self.rows.values() if r.last is not None and r.status != "FAILED"]
        if not scored:
            return None
        sign = -1.0 if self.mode == "max" else 1.0
        return min(scored, key=lambda r: (sign * (r.last or 0.0), r.number))

    def counts_text(self) -> str:
        counts: dict[str, int] = {}
        for r in self.rows.values():
            counts[r.status] = counts.get(r.status, 0) + 1
        parts = [f"{n} {s.lower()}" for s, n in sorted(counts.items())]
        best = self.best_row()
        if best is not None and best.last is not None:
            parts.append(f"best trial {best.number:04d}: {self.metric}={best.last:.4g}")
        return ", ".join(parts)

    def table(self, rows: Sequence[TrialRow] | None = None, title: str | None = None) -> Table:
        with self._lock:
            rows = list(rows) if rows is not None else sorted(self.rows.values(), key=_order)
        best = self.best_row()
        table = Table(title=title or f"{self.name}: {self.counts_text()}", title_justify="left")
        table.add_column("trial", justify="right")
        table.add_column("status")
        for c in self.columns:
            table.add_column(c, justify="right")
        table.add_column("iter", justify="right")
        if self.metric is not None:
            table.add_column(self.metric, justify="right")
            # The best value of any round (the highest, or the lowest when minimising); a trial
            # counts by its last one (the column before).
            table.add_column(
                f"{'lowest' if self.mode == 'min' else 'peak'} {self.metric}", justify="right"
            )
        table.add_column("time", justify="right")
        for r in rows:
            d = r.duration_s
            mark = " *" if best is not None and r.number == best.number else ""
            table.add_row(
                f"{r.number:04d}{mark}",
                f"[{STATUS_STYLES.get(r.status, '')}]{r.status}[/]",
                *(fmt_value(r.params.get(c, "")) for c in self.columns),
                str(r.iterations),
                *(
                    (
                        "" if r.last is None else f"{r.last:.4g}",
                        "" if r.best is None else f"{r.best:.4g}",
                    )
                    if self.metric is not None
                    else ()
                ),
                "" if d is None else f"{d:.1f}s",
            )
        return table

    def _ended(self) -> int:
        """Trials that ended (complete, pruned, failed); call with the lock held."""
        return sum(1 for r in self.rows.values() if r.status in _ENDED)

    def _eta_s(self) -> float | None:
        """Seconds until every trial ended, at the rate trials ended since :meth:`start`; None
        before one did (or without a total). Call with the lock held."""
        if not self.total:
            return None
        ended = self._ended()
        new = ended - self._done_at_start
        if new <= 0:
            return None
        elapsed = time.monotonic() - self._t_start
        return max(0.0, elapsed / new * (self.total - ended))

    def progress_bar(self) -> RenderableType | None:
        """``━━━━━━╺━━━━  3/6 trials  50%  ETA 1m 02s`` (None without a total)."""
        if not self.total:
            return None
        with self._lock:
            ended, eta = self._ended(), self._eta_s()
        fraction = min(1.0, ended / self.total)
        text = Text(f" {ended}/{self.total} trials {fraction * 100:3.0f}%", no_wrap=True)
        text.append("  ETA ", style="dim")
        text.append(_fmt_eta(eta))
        grid = Table.grid(expand=True)
        grid.add_column(ratio=1)
        grid.add_column(no_wrap=True)
        grid.add_row(ProgressBar(total=float(self.total), completed=float(ended)), text)
        return grid

    def __rich__(self) -> RenderableType:
        # The live view: running trials first, then the most recent others (a terminal's worth),
        # and the bar over all trials.
        with self._lock:
            rows = sorted(self.rows.values(), key=_order)
        bar = self.progress_bar()
        table = self.table(rows[:20])
        return table if bar is None else Group(table, bar)

    def summary(self) -> None:
        """The final table, best first, and the best trial's parameters."""
        if self.display == "off":
            return
        with self._lock:
            rows = list(self.rows.values())
        sign = -1.0 if self.mode == "max" else 1.0
        rows.sort(key=lambda r: (r.last is None or r.status == "FAILED", sign * (r.last or 0.0)))
        title = f"{self.name} finished: {self.counts_text()}"
        final = self.table(rows, title=title)
        if self._live is not None:  # the live table becomes the final one: shown once
            self._live.update(final, refresh=True)
            self.close()
            return
        if self.console.is_terminal:
            self.console.print(final)
            return
        # Piped (| tee, CI): no terminal width to fit, so nothing is cut or wrapped: the title
        # is one line, and the table as wide as its widest cells.
        self.line(title)
        final.title = None
        wide = Console(
            file=whole_writes(self._stream),
            width=max(self.console.width, _natural_width(self.console, final)),
            color_system=None,
        )
        wide.print(final)


_ENDED = frozenset({"COMPLETE", "PRUNED", "FAILED"})


def _natural_width(console: Console, table: Table) -> int:
    """The width ``table`` takes with no cell cut or wrapped."""
    return console.measure(table, options=console.options.update(max_width=10_000)).maximum


def _fmt_eta(seconds: float | None) -> str:
    """``"-"`` before an estimate, else ``"1m 02s"`` (see ``render.format_duration``)."""
    from ringtrain.monitor.render import format_duration

    return "-" if seconds is None else format_duration(seconds)


def _order(r: TrialRow) -> tuple[int, int]:
    rank = {"RUNNING": 0, "PENDING": 2}.get(r.status, 1)
    return (rank, -r.number if rank == 1 else r.number)
