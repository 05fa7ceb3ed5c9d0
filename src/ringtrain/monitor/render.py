"""Rendering run directories for people: ``ringtrain ls``, ``ringtrain show`` and the formatting
helpers the live progress display shares.

Everything here takes what :mod:`ringtrain.monitor.runs` read (``RunSummary``, ``RunDetails``,
``SweepSummary``) and prints it with rich, fitting the console's width: at 80 columns a run's name
is cut in the middle (its end, the default name's timestamp, stays), failed runs show their reason
in place of their metrics, and a sweep is one row with its trial counts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ringtrain.monitor.format import (
    fit_metrics,
    format_bytes,
    format_duration,
    format_metrics,
    format_timestamp,
    format_value,
    status_text,
    truncate_middle,
)
from ringtrain.monitor.records import RunDetails, RunSummary
from ringtrain.monitor.runs import worker_range
from ringtrain.monitor.storage import as_dict, basename
from ringtrain.monitor.sweeps import SweepSummary
from ringtrain.rundir.schema import EVENTS_FILE

__all__ = [
    "fit_metrics",
    "format_bytes",
    "format_duration",
    "format_metrics",
    "format_timestamp",
    "format_value",
    "render_run",
    "render_runs",
    "truncate_middle",
]


def _reason(run: RunSummary) -> str:
    """A failed run's reason in one line: the first line of its error (or its status)."""
    if not run.error:
        return "driver gone" if run.status == "ABORTED" else ""
    first = run.error.strip().splitlines()[0] if run.error.strip() else run.error
    return first


def render_runs(
    runs: Sequence[RunSummary], console: Console, sweeps: Sequence[SweepSummary] = ()
) -> None:
    """Prints the ``ringtrain ls`` table: one row per run and one per sweep, fitting the
    console's width (no row wraps at 80 columns).

    The name is cut in the middle when it does not fit beside the last column (which keeps up
    to 32 columns of what it has to show, 48 from 100 columns up); the last column shows the
    most useful metrics that fit, a failed run's reason (its error's first line, in red)
    instead, and for a sweep its trial counts (completed, pruned, failed) and best value; its
    Rounds column counts trials ended / planned; the Workers column adds a run's hot spares
    (``3+1``). Under 100 columns the start time and
    checkpoint count are left out (a default run name ends in its start time; ``show`` has
    both).

    Args:
        runs: The runs, as :func:`ringtrain.monitor.runs.list_runs` returns them.
        console: Where to print (its ``width`` is the room).
        sweeps: The sweeps, as :func:`ringtrain.monitor.sweeps.list_sweeps` returns them.
    """
    if not runs and not sweeps:
        console.print("No runs found.")
        return
    narrow = console.width < 100
    stamp = "%Y-%m-%d %H:%M"
    headers = ["Status", "Started", "Time", "Workers", "Rounds", "Ckpts"]
    if narrow:  # a default name ends in its start time; the checkpoints are in `show`
        headers = ["Status", "Time", "W", "Rounds"]

    def started(t: float | None) -> str:
        return "-" if t is None or not math.isfinite(t) else time.strftime(stamp, time.localtime(t))

    # One row: name, status, the fixed cells, and how to fill the last column in a given width.
    rows: list[tuple[str, str, list[str], Any]] = []
    any_failed = False
    for run in runs:
        cells = [
            started(run.start_time),
            format_duration(run.duration_s),
            _world_cell(run.world_size, run.spares),
            "-" if run.rounds is None else str(run.rounds),
            str(run.num_checkpoints),
        ]
        reason = _reason(run) if run.status in ("ERRORED", "ABORTED") else ""
        any_failed = any_failed or bool(reason)
        if reason:
            last: Any = lambda w, reason=reason: Text(reason, style="red")
        else:
            last = lambda w, m=run.metrics: Text(fit_metrics(m, w))
        rows.append((run.name, run.status, cells, last))
    for sweep in sweeps:
        cells = [
            started(sweep.start_time),
            format_duration(sweep.duration_s),
            "-" if sweep.world_size is None else str(sweep.world_size),
            f"{sweep.done}/{'?' if sweep.total is None else sweep.total}",  # trials, not rounds
            "-",
        ]
        rows.append((sweep.name, sweep.status, cells, lambda w, sw=sweep: _sweep_text(sw, w)))
    if narrow:
        rows = [(n, st, [c[1], c[2], c[3]], last) for n, st, c, last in rows]
    widths = [len(h) for h in headers]
    for _, status, cells, _ in rows:
        for i, cell in enumerate([status_text(status).plain, *cells]):
            widths[i] = max(widths[i], len(cell))
    last_header = (
        ("Metrics / reason" if narrow else "Last metrics / reason")
        if any_failed
        else ("Last metrics")
    )
    # Each column is followed by 2 spaces (collapse_padding); the table has no edges.
    room = max(0, console.width - sum(w + 2 for w in widths) - 1)
    longest = max(len("Name"), *(len(r[0]) for r in rows))
    # The last column keeps up to 32 columns (48 when wide) of what it would show at full
    # room; the name gets the rest, so it is cut only when the metrics need the room.
    wanted = max(len(last_header), *(r[3](room).cell_len for r in rows))
    if narrow:  # at 80 columns and long metrics: a name of 18
        name_width = max(12, min(longest, room - min(wanted, 32) - 1))
    else:
        name_width = max(8, min(longest, max(room // 2, room - min(wanted, 47) - 1)))
    last_room = max(len(last_header), room - name_width - 1)
    lasts = [r[3](last_room) for r in rows]
    last_width = max(len(last_header), *(t.cell_len for t in lasts))
    last_width = min(last_width, last_room)

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True, show_edge=False)
    table.add_column("Name", style="bold", no_wrap=True, width=name_width)
    for header, width in zip(headers, widths, strict=True):
        justify: Literal["left", "right"] = "left" if header in ("Status", "Started") else "right"
        table.add_column(header, justify=justify, no_wrap=True, width=width)
    table.add_column(last_header, no_wrap=True, overflow="ellipsis", width=last_width)
    for (name, status, cells, _), last_text in zip(rows, lasts, strict=True):
        table.add_row(
            Text(truncate_middle(name, name_width)),
            status_text(status),
            *cells,
            last_text,
        )
    console.print(table)


def _sweep_text(sweep: SweepSummary, width: int) -> Text:
    """A sweep's last cell: ``sweep 6/6 trials: 4 completed, 1 pruned, 1 failed, best ...``;
    the best value only when it fits (the rest is cut at its end)."""
    text = "sweep " + sweep.counts_text()
    if len(text) > width:
        text = "sweep: " + sweep.counts_text(short=True)
    if sweep.best is not None and sweep.best_trial is not None:
        best = f", best {sweep.metric}={format_value(sweep.best)} (#{sweep.best_trial})"
        text += best if len(text) + len(best) <= width else ""
    return Text(text)


def _metric_columns(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    keys: dict[str, None] = {}
    for row in rows:
        for key in row:
            keys.setdefault(key, None)
    return list(keys)


def render_run(
    details: RunDetails,
    console: Console,
    *,
    max_rounds: int = 30,
    max_columns: int = 12,
) -> None:
    """Prints the ``ringtrain show`` report: summary, metrics per round, workers, checkpoints,
    an elastic run's resizes, and failures.

    Args:
        details: The run, as :func:`load_run` returns it.
        console: Where to print.
        max_rounds: Show at most the last this many rounds of the metrics table; a note says how
            many were hidden.
        max_columns: Show at most this many metric columns; a note names the hidden ones.
    """
    s = details.summary
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    header.add_row("Run", Text(s.name))
    header.add_row("Path", Text(s.path))
    header.add_row("Status", status_text(s.status))
    header.add_row("Started", format_timestamp(s.start_time))
    header.add_row("Duration", format_duration(s.duration_s))
    header.add_row("Workers", _workers_text(details))
    header.add_row("Rounds", "-" if s.rounds is None else str(s.rounds))
    config = details.config or {}
    scaling = as_dict(config.get("scaling_config"))
    if scaling:
        header.add_row("Scaling", Text(format_metrics(scaling)))
    loop_config = config.get("train_loop_config")
    if isinstance(loop_config, dict) and loop_config:
        header.add_row("Config", Text(format_metrics(loop_config)))
    if s.metrics:
        metrics_text = format_metrics(s.metrics, max_items=max_columns, first=("epoch",))
        header.add_row("Metrics", Text(metrics_text))
    result = details.result or {}
    if isinstance(result.get("checkpoint"), str):
        header.add_row("Checkpoint", Text(result["checkpoint"]))
    if s.error:
        header.add_row("Error", Text(s.error, style="red"))
    console.print(header)

    if details.skipped_event_lines:
        n = details.skipped_event_lines
        console.print(
            Text(f"({n} unreadable line{'s' if n != 1 else ''} in {EVENTS_FILE} skipped)", "dim")
        )

    _render_metrics_table(details, console, max_rounds=max_rounds, max_columns=max_columns)
    if len(details.rank_metrics) > 1:
        _render_rank_table(details, console, max_columns=max_columns)
    _render_checkpoints(details, console)
    _render_resizes(details, console)
    _render_spares(details, console)
    _render_corruption(details, console)
    _render_failures(details, console)


def _world_cell(world_size: int | None, spares: int) -> str:
    """``ls``'s Workers cell: the world size, and ``+K`` for K hot spares (``3+1``)."""
    text = "-" if world_size is None else str(world_size)
    return f"{text}+{spares}" if spares > 0 else text


def _workers_text(details: RunDetails) -> str:
    """The header's world size: the current one, and an elastic run's range and history."""
    s = details.summary
    text = "-" if s.world_size is None else str(s.world_size)
    notes = []
    limits = worker_range(details.config)
    if limits is not None:
        notes.append(f"elastic {limits[0]}-{limits[1]}")
    if s.spares > 0:  # read once from config.json (RunSummary.spares)
        notes.append(f"+{s.spares} hot spare{'s' if s.spares != 1 else ''}")
    sizes = [c.world_size for c in details.world_sizes]
    steps = [n for i, n in enumerate(sizes) if i == 0 or n != sizes[i - 1]]
    if len(steps) > 1:
        notes.append(" -> ".join(map(str, steps)))
    return text + (f" ({'; '.join(notes)})" if notes else "")


def _render_metrics_table(
    details: RunDetails, console: Console, *, max_rounds: int, max_columns: int
) -> None:
    console.print()
    if not details.rounds:
        console.print(Text("No metrics reported yet.", style="dim"))
        return
    keys = _metric_columns([r.metrics for r in details.rounds])
    shown_keys = keys[: max(0, max_columns)]
    hidden_keys = keys[len(shown_keys) :]
    rows = details.rounds[-max_rounds:] if max_rounds > 0 else []
    hidden_rounds = len(details.rounds) - len(rows)
    start = details.summary.start_time

    table = Table(title="Metrics (rank 0)", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("Round", justify="right", no_wrap=True)
    table.add_column("Time", justify="right", no_wrap=True)
    for key in shown_keys:
        table.add_column(key, justify="right", no_wrap=True, overflow="ellipsis")
    for row in rows:
        elapsed = None if row.time is None or start is None else row.time - start
        table.add_row(
            str(row.round),
            format_duration(elapsed),
            *(format_value(row.metrics[k]) if k in row.metrics else "" for k in shown_keys),
        )
    console.print(table)
    notes = []
    if hidden_rounds:
        notes.append(f"{hidden_rounds} earlier round{'s' if hidden_rounds != 1 else ''} hidden")
    if hidden_keys:
        notes.append(
            f"{len(hidden_keys)} metric column{'s' if len(hidden_keys) != 1 else ''} hidden: "
            + ", ".join(hidden_keys)
        )
    if notes:
        console.print(Text("(" + "; ".join(notes) + ")", style="dim"))


def _render_rank_table(details: RunDetails, console: Console, *, max_columns: int) -> None:
    keys = _metric_columns([r.metrics for r in details.rank_metrics.values()])
    shown_keys = keys[: max(0, max_columns)]
    table = Table(title="Last report per rank", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("Rank", justify="right", no_wrap=True)
    table.add_column("Round", justify="right", no_wrap=True)
    for key in shown_keys:
        table.add_column(key, justify="right", no_wrap=True, overflow="ellipsis")
    for rank, row in details.rank_metrics.items():
        table.add_row(
            str(rank),
            str(row.round),
            *(format_value(row.metrics[k]) if k in row.metrics else "" for k in shown_keys),
        )
    console.print(table)


def _render_checkpoints(details: RunDetails, console: Console) -> None:
    console.print()
    if not details.checkpoints:
        console.print(Text("No checkpoints.", style="dim"))
        return
    result = details.result or {}
    latest = result.get("checkpoint")
    latest_name = basename(latest) if isinstance(latest, str) else None
    best_names = {
        basename(b["path"])
        for b in result.get("best_checkpoints") or []
        if isinstance(b, dict) and isinstance(b.get("path"), str)
    }
    table = Table(title="Checkpoints", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("Checkpoint", no_wrap=True)
    table.add_column("Round", justify="right", no_wrap=True)
    table.add_column("Size", justify="right", no_wrap=True)
    table.add_column("Created", no_wrap=True)
    table.add_column("Metrics", overflow="fold")
    table.add_column("", no_wrap=True)
    for ckpt in details.checkpoints:
        tags = []
        if ckpt.name == latest_name:
            tags.append("latest")
        if ckpt.name in best_names:
            tags.append("best")
        table.add_row(
            Text(ckpt.name),
            str(ckpt.round),
            format_bytes(ckpt.size_bytes),
            format_timestamp(ckpt.created),
            Text(format_metrics(ckpt.metrics, first=("epoch",))),
            ", ".join(tags),
        )
    console.print(table)


def _render_spares(details: RunDetails, console: Console) -> None:
    """The hot spares that took a rank or were lost (``ScalingConfig.spares``)."""
    if not details.spares:
        return
    console.print()
    console.print(Text(f"Spares ({len(details.spares)})", style="bold"))
    for line in details.spares:
        console.print(Text(f"  {line}"))


def _render_corruption(details: RunDetails, console: Console) -> None:
    """What the replica checks found (nothing printed when they found nothing)."""
    if not details.corruption:
        return
    console.print(Text(f"Silent data corruption ({len(details.corruption)})", style="bold red"))
    for line in details.corruption:
        console.print(Text(f"  {line}"))


def _render_resizes(details: RunDetails, console: Console) -> None:
    """The ``Resizes`` table: an elastic run's resizes in place and fallbacks to a restart."""
    if not details.resizes:
        if worker_range(details.config) is not None:
            console.print()
            console.print(Text("No resizes.", style="dim"))
        return
    console.print()
    table = Table(
        title=f"Resizes ({len(details.resizes)})", title_justify="left", box=box.SIMPLE_HEAD
    )
    table.add_column("Time", no_wrap=True)
    table.add_column("Change", no_wrap=True)
    table.add_column("Cause", overflow="fold")
    table.add_column("Resumed after", justify="right", no_wrap=True)
    table.add_column("Rolled back", justify="right", no_wrap=True)
    for r in details.resizes:
        if r.kind == "fallback":
            change = Text("restart from disk", style="yellow")
        else:
            old = "?" if r.old_world_size is None else str(r.old_world_size)
            new = "?" if r.new_world_size is None else str(r.new_world_size)
            change = Text(f"{old} -> {new} workers")
            if r.spare_ranks:
                change.append(f" (spare took rank {', '.join(map(str, r.spare_ranks))})")
        resumed = "-" if r.resume_s is None else f"{r.resume_s:.2f} s"
        if r.steps_rolled_back is None:
            rolled = "-"
        else:
            rolled = f"{r.steps_rolled_back} step{'s' if r.steps_rolled_back != 1 else ''}"
            if r.snapshot_step is not None:
                rolled += f" (to step {r.snapshot_step})"
        table.add_row(format_timestamp(r.time), change, Text(r.cause), resumed, rolled)
    console.print(table)


def _render_failures(details: RunDetails, console: Console) -> None:
    """Root causes in a ``Failures (N)`` table, follow-on errors (a peer's error caused by
    another rank's failure, ``follow_on: true``) folded below it, one line each, so that N
    agrees with the count in the Error field."""
    if not details.failures:
        return
    roots = [f for f in details.failures if not f.follow_on]
    follow = [f for f in details.failures if f.follow_on]
    console.print()
    title = f"Failures ({len(roots)})"
    if follow:
        title += f" + {len(follow)} follow-on"
    table = Table(title=title, title_justify="left", title_style="bold red", box=box.SIMPLE_HEAD)
    table.add_column("Time", no_wrap=True)
    table.add_column("Rank", justify="right", no_wrap=True)
    table.add_column("Kind", no_wrap=True)
    table.add_column("Message", overflow="fold")
    for failure in roots:
        table.add_row(
            format_timestamp(failure.time),
            "-" if failure.rank is None else str(failure.rank),
            failure.kind,
            Text(failure.message),
        )
    if roots:
        console.print(table)
    else:
        console.print(Text(title, style="bold red"))
    for failure in follow:
        who = "a rank" if failure.rank is None else f"rank {failure.rank}"
        message = failure.message.strip().splitlines()[0] if failure.message.strip() else ""
        console.print(
            Text.assemble(("  ", ""), (f"{who}: {message} (follow-on)", "dim")), overflow="fold"
        )
