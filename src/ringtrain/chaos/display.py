"""A campaign's output: a live line per run, a line per verdict, the final table."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Protocol, TextIO

from ringtrain.chaos.report import CampaignReport, RunReport
from ringtrain.monitor.console_io import whole_writes

if TYPE_CHECKING:
    from rich.status import Status

_STYLE = {
    "EXACT": "green",
    "CLEAN": "cyan",
    "DIVERGED": "red",
    "HUNG": "red",
    "ERRORED": "red",
    "ORPHANS": "yellow",
}


class CampaignDisplay(Protocol):
    """What a campaign tells about its progress (``run_campaign(display=...)``)."""

    def run_started(self, run: RunReport, plan: list[str]) -> None:
        """A run starts, with its planned faults in words."""

    def tick(self, run: RunReport, now: float) -> None:
        """About once a second while ``run`` goes (``now``: ``time.monotonic()``)."""

    def run_finished(self, run: RunReport) -> None:
        """``run`` has its verdict."""

    def finished(self, report: CampaignReport) -> None:
        """Every run has ended."""


class Display:
    """Progress of a campaign on a console (a :class:`CampaignDisplay`).

    Args:
        mode: ``"rich"`` (a live status line per run), ``"plain"`` (a line when a run starts and
            ends; for logs and CI), ``"auto"`` (rich on a terminal, plain otherwise) or ``"off"``.
        file: where to print (default: stdout).
    """

    def __init__(self, mode: str = "auto", file: TextIO | None = None) -> None:
        if mode not in ("auto", "rich", "plain", "off"):
            raise ValueError(f"--progress must be auto, rich, plain or off, got {mode!r}")
        from rich.console import Console

        self.file = file or sys.stdout
        if mode == "auto":
            mode = "rich" if getattr(self.file, "isatty", lambda: False)() else "plain"
        self.mode = mode
        # Written whole: into a full non-blocking pipe a plain write lost the rest, silently.
        self.console = Console(file=whole_writes(self.file), highlight=False, soft_wrap=True)
        self._status: Status | None = None
        self._label = ""
        self._started = 0.0

    def _print(self, text: str) -> None:
        if self.mode != "off":
            self.console.print(text)

    def run_started(self, run: RunReport, plan: list[str]) -> None:
        self._label = _label(run)
        self._started = time.monotonic()
        faults = "; ".join(plan) if plan else "no faults (the reference)"
        if self.mode == "rich":
            self._status = self.console.status(f"{self._label}: {faults}")
            self._status.start()
            self._faults = faults
        elif self.mode == "plain":
            self._print(f"{self._label}: {faults} (seed {run.seed})")

    def tick(self, run: RunReport, now: float) -> None:
        if self._status is not None:
            elapsed = now - self._started
            self._status.update(f"{self._label}: {self._faults}  [{elapsed:.0f} s]")

    def run_finished(self, run: RunReport) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        style = _STYLE.get(run.verdict, "")
        recovery = run.recovery_s
        rec = f", recovery {sum(recovery) / len(recovery):.2f} s" if recovery else ""
        detail = f": {run.detail}" if run.detail else ""
        verdict = f"[{style}]{run.verdict}[/]" if self.mode == "rich" else run.verdict
        self._print(f"{self._label}: {verdict} in {run.wall_s:.1f} s{rec}{detail}")

    def finished(self, report: CampaignReport) -> None:
        if self.mode == "off":
            return
        from rich.table import Table

        table = Table(title="ringtrain chaos", show_lines=False)
        for col in ("W", "run", "seed", "faults (injected)", "verdict", "wall s", "recovery s"):
            table.add_column(col)
        for run in report.runs:
            injected = [f for f in run.faults if f.get("injected")]
            kinds = ", ".join(f"{f['kind']}@{f.get('fired_at_step', f['step'])}" for f in injected)
            rec = run.recovery_s
            table.add_row(
                str(run.world_size),
                str(run.index),
                run.seed,
                kinds or "-",
                f"[{_STYLE.get(run.verdict, '')}]{run.verdict}[/]",
                f"{run.wall_s:.1f}",
                f"{sum(rec) / len(rec):.2f}" if rec else "-",
            )
        self.console.print(table)
        for w in report.config.workers:
            s = report.summary(w)
            mean = "-" if s["mean_recovery_s"] is None else f"{s['mean_recovery_s']:.2f} s"
            self._print(
                f"W={w}: {s['runs']} runs, {s['exact']} exact, {s['diverged']} diverged, "
                f"{s['hung']} hung, {s['errored']} errored, {s['orphans']} with orphans "
                f"({s['orphan_processes']} processes); mean recovery {mean}"
            )
        for run in report.runs:
            if run.verdict != "EXACT":
                self._print(f"{_label(run)} {run.verdict}: {run.detail}  (run dir {run.run_dir})")
        verdict = "every run EXACT" if report.ok else "NOT every run is exact"
        self._print(verdict)


def _label(run: RunReport) -> str:
    if run.index == 0:
        return f"[W={run.world_size} clean]"
    return f"[W={run.world_size} run {run.index}]"
