"""``ringtrain bench``: run a script at several worker counts and write the scaling report.

For every W in ``--workers`` (smallest first) the script runs as a fresh ringtrain job of W local
workers that stops after ``--steps`` timed training steps (``run_workers(max_steps=...)``); its
timing windows (``timing`` events in ``events.jsonl``) give that W's throughput and step split.
Then a short allreduce job at the largest W measures the data the alpha-beta model is fitted to,
and :mod:`ringtrain.bench.report` writes ``scaling.json``, ``scaling.html`` and the PNG charts.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ringtrain.bench.allreduce import measure_allreduce
from ringtrain.bench.analysis import PARTS, BenchError, RunTiming, aggregate_windows
from ringtrain.bench.core import fmt_bytes
from ringtrain.bench.report import MATPLOTLIB_HINT, build_report, have_matplotlib, write_report
from ringtrain.monitor.console_io import whole_writes

__all__ = [
    "BenchConfig",
    "amdahl_line",
    "load_timing_windows",
    "outer_line",
    "parse_workers",
    "run_bench",
]

#: Timing window length of the benchmark runs (seconds): short, so that the warm-up steps can be
#: left out of short runs window by window.
TIMING_INTERVAL_S = 0.1


def parse_workers(text: str) -> tuple[int, ...]:
    """Parse ``--workers``: a comma-separated list of worker counts.

    Args:
        text: e.g. ``"1,2,4"``.

    Returns:
        The counts, sorted, without duplicates.

    Raises:
        ValueError: an entry that is not a whole number >= 1, a repeated count, no 1 (the
            baseline), or no count >= 2.
    """
    entries = [t.strip() for t in str(text).split(",")]
    counts: list[int] = []
    for entry in entries:
        try:
            value = int(entry)
        except ValueError:
            raise ValueError(
                f"--workers: {entry!r} is not a whole number (give a comma-separated list of "
                "worker counts, e.g. --workers 1,2,4)"
            ) from None
        if value < 1:
            raise ValueError(f"--workers: worker counts must be >= 1, got {value}")
        if value in counts:
            raise ValueError(f"--workers: {value} is given twice")
        counts.append(value)
    if 1 not in counts:
        raise ValueError(
            "--workers: include 1, the baseline that speedup is measured against "
            f"(e.g. --workers 1,{','.join(str(c) for c in sorted(counts))})"
        )
    if max(counts) < 2:
        raise ValueError("--workers: give at least one count >= 2 besides 1 (e.g. --workers 1,2)")
    return tuple(sorted(counts))


@dataclass(frozen=True)
class BenchConfig:
    """What ``ringtrain bench`` runs.

    Attributes:
        script: the per-worker training script (a file).
        workers: the worker counts to measure; must include 1 and a count >= 2.
        steps: timed training steps per run (>= 1; the first 20%, at least 2, are warm-up).
        out_dir: where scaling.json, scaling.html and the charts go.
        storage_path: where the runs' directories go (default: ``{out_dir}/runs``).
        bandwidth_gbps: network bandwidth to predict efficiency with (Gbit/s; default: the
            bandwidth fitted to the allreduce measurement).
        script_args: arguments passed to the script.
        threads: torch threads per worker, the same at every W (default: this machine's cores
            divided by the largest W, so that every worker has the same share of the machine at
            every W and S(W) measures data parallelism, not intra-op threading).
        command: the command line, recorded in the report.
    """

    script: str
    workers: tuple[int, ...]
    steps: int
    out_dir: str = "./scaling"
    storage_path: str | None = None
    bandwidth_gbps: float | None = None
    script_args: tuple[str, ...] = ()
    threads: int | None = None
    command: str = ""

    def threads_per_worker(self) -> int:
        """Torch threads of every worker in every run (``threads``, or cores // largest W)."""
        if self.threads is not None:
            return self.threads
        return max(1, (os.cpu_count() or 1) // max(self.workers))

    def __post_init__(self) -> None:
        if not os.path.isfile(self.script):
            raise ValueError(f"SCRIPT {self.script!r} is not a file")
        parse_workers(",".join(str(w) for w in self.workers))
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"--steps must be a whole number >= 1, got {self.steps!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"--threads must be a whole number >= 1, got {self.threads!r}")
        if self.bandwidth_gbps is not None and not self.bandwidth_gbps > 0:
            raise ValueError(f"--bandwidth-gbps must be > 0, got {self.bandwidth_gbps!r}")


def load_timing_windows(run_dir: str) -> list[dict[str, Any]]:
    """The timing windows of a run's last attempt, from its ``events.jsonl``.

    Args:
        run_dir: the run directory (local path or fsspec URL).

    Returns:
        One dict per ``timing`` event: ``rank`` plus the window's fields.

    Raises:
        BenchError: the run directory has no ``events.jsonl``.
    """
    import fsspec

    from ringtrain.rundir.reader import read_events
    from ringtrain.rundir.schema import EVENTS_FILE, TimingEvent

    fs, path = fsspec.core.url_to_fs(run_dir)
    target = path.rstrip("/") + "/" + EVENTS_FILE
    if not fs.exists(target):
        raise BenchError(f"{run_dir}: no {EVENTS_FILE} (not a ringtrain run directory?)")
    events, _ = read_events(fs, target)  # a truncated last line is skipped
    windows: list[dict[str, Any]] = [
        {**ev.window, "rank": ev.rank, "attempt": ev.attempt or 0}
        for ev in events
        if isinstance(ev, TimingEvent)
    ]
    if windows:
        last = max(int(w.get("attempt") or 0) for w in windows)
        windows = [w for w in windows if int(w.get("attempt") or 0) == last]
    return windows


class _StepProgress:
    """Driver callback: moves a progress bar as rank 0's timing windows arrive."""

    def __init__(self, progress: Progress, task: Any) -> None:
        self.progress = progress
        self.task = task
        self.steps: dict[int, int] = {}

    def on_timing(self, rank: int, window: dict[str, Any]) -> None:
        step = window.get("step")
        if isinstance(step, int):
            self.steps[rank] = step
            self.progress.update(self.task, completed=min(self.steps.values()))


def _command(config: BenchConfig) -> str:
    import shlex

    words = ["ringtrain", "bench", config.script, "--workers", ",".join(map(str, config.workers))]
    words += ["--steps", str(config.steps)]
    if config.threads is not None:
        words += ["--threads", str(config.threads)]
    if config.bandwidth_gbps is not None:
        words += ["--bandwidth-gbps", f"{config.bandwidth_gbps:g}"]
    if config.script_args:
        words += ["--", *config.script_args]
    return shlex.join(words)


def _machine() -> str:
    import torch

    cores = os.cpu_count() or 0
    return (
        f"{cores} CPU cores, {platform.machine()} {platform.system()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def run_bench(config: BenchConfig, console: Console | None = None) -> dict[str, str]:
    """Run the script at every worker count, measure the allreduce, write the report.

    Args:
        config: what to run.
        console: where the progress and the summary go (default: stdout).

    Returns:
        The files written: ``json``, ``html`` and one entry per chart -> absolute path.

    Raises:
        BenchError: a run failed (the message names its run directory) or timed no steps.
        RuntimeError, ValueError: from ``run_workers`` (a run directory already in use, ...).
    """
    from ringtrain.config import MonitorConfig, RunConfig, ScalingConfig
    from ringtrain.trainer import run_workers

    console = console or Console(file=whole_writes())
    if not have_matplotlib():  # said before minutes of runs, not after
        console.print(f"{MATPLOTLIB_HINT}; the report comes without them", markup=False)
    script = os.path.abspath(config.script)
    stem = os.path.splitext(os.path.basename(script))[0]
    out_dir = os.path.abspath(config.out_dir)
    storage = config.storage_path or os.path.join(out_dir, "runs")
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    largest = max(config.workers)
    threads = config.threads_per_worker()
    console.print(
        f"[bold]ringtrain bench[/bold] {config.script}: W = "
        f"{', '.join(map(str, config.workers))}, {config.steps} steps each, then an allreduce "
        f"measurement at W = {largest}; {threads} torch thread(s) per worker; runs in {storage}"
    )
    runs: list[RunTiming] = []
    run_dirs: dict[str, str] = {}
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("steps"),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        for i, w in enumerate(config.workers, 1):
            name = f"{stem}_w{w}_{stamp}"
            task = progress.add_task(
                f"[{i}/{len(config.workers)}] W={w} {name}", total=config.steps
            )
            result = run_workers(
                name=name,
                entrypoint=config.script,
                scaling_config=ScalingConfig(num_workers=w, resources_per_worker={"CPU": threads}),
                run_config=RunConfig(
                    name=name,
                    storage_path=storage,
                    progress="off",
                    # Communication timed inside DDP's hook: the report needs total and
                    # exposed communication apart, worth the hook's cost on CPU here.
                    monitor_config=MonitorConfig(
                        timing_interval_s=TIMING_INTERVAL_S,
                        comm_timing="hook",
                        tensorboard=False,
                        csv=False,
                    ),
                    callbacks=[_StepProgress(progress, task)],
                ),
                script=script,
                script_args=tuple(config.script_args),
                max_steps=config.steps,
            )
            run_dir = str(result.path)
            run_dirs[f"W={w}"] = run_dir
            if result.error is not None:
                raise BenchError(f"the run at W={w} failed ({run_dir}): {result.error}")
            timing = aggregate_windows(w, load_timing_windows(run_dir))
            runs.append(timing)
            progress.update(task, completed=config.steps)
            progress.console.print(
                f"  W={w}: {timing.throughput:.1f} samples/s, step {timing.step_s * 1e3:.2f} ms "
                f"({timing.steps} steps per rank measured after {timing.warmup_steps} warm-up)"
            )
        name = f"allreduce_w{largest}_{stamp}"
        task = progress.add_task(f"allreduce W={largest} {name}", total=None)
        samples, run_dirs["allreduce"] = measure_allreduce(
            largest, storage_path=storage, name=name, threads=threads
        )
        progress.update(task, total=1, completed=1)

    bandwidth = config.bandwidth_gbps * 1e9 / 8 if config.bandwidth_gbps else None
    from ringtrain import __version__

    report = build_report(
        runs,
        samples,
        bandwidth=bandwidth,
        cpu_count=os.cpu_count(),
        meta={
            "command": config.command or _command(config),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "script": script,
            "script_args": list(config.script_args),
            "workers": list(config.workers),
            "steps": config.steps,
            "threads_per_worker": threads,
            "machine": _machine(),
            "ringtrain_version": __version__,
            "run_dirs": run_dirs,
        },
    )
    paths = write_report(report, out_dir)
    _print_summary(report, console)
    console.print(f"report: {paths['html']}\n        {paths['json']}")
    return paths


def amdahl_line(amdahl: dict[str, Any]) -> str:
    """The terminal's Amdahl line; says so when the fitted p was clamped to [0, 1].

    Args:
        amdahl: the report's ``amdahl`` entry (``p``, ``rmse``, ``clamped``).
    """
    p = amdahl["p"]
    if not amdahl.get("clamped"):
        return f"Amdahl fit: p = {p:.4f} (RMS error of S: {amdahl['rmse']:.3f})"
    why = "speedups below 1" if p <= 0.5 else "speedups above W"
    return (
        f"Amdahl fit: p clamped to {p:.0f}: the measured times do not fit Amdahl's law "
        f"({why}; the least-squares p lies outside [0, 1])"
    )


def outer_line(run: dict[str, Any]) -> str | None:
    """The terminal's line on DiLoCo's outer loop at one W (``None``: the run is not DiLoCo).

    Args:
        run: one of the report's ``runs`` (``workers``, ``step_s``, ``outer``).
    """
    outer = run.get("outer")
    if not outer:
        return None
    count = outer.get("outer_steps")
    return (
        f"DiLoCo at W={run['workers']}: {fmt_bytes(outer['bytes_per_step'])} sent per inner "
        f"step, {outer['sync_s_per_step'] * 1e3:.2f} ms per inner step in outer syncs "
        f"({outer['sync_frac']:.1%} of the step)"
        + (f", {count} outer steps" if count is not None else "")
    )


def _print_summary(report: dict[str, Any], console: Console) -> None:
    table = Table(
        title="Scaling (weak: per-worker batch fixed)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    short = {
        "data_s": "data",
        "compute_s": "compute",
        "comm_exposed_s": "comm",
        "optimizer_s": "optim",
        "other_s": "other",
    }
    for header in ("W", "samples/s", "S(W)", "E(W)", "step", *(short[p] for p in PARTS)):
        table.add_column(header, justify="right", no_wrap=True)
    runs = {r["workers"]: r for r in report["runs"]}
    for p in report["scaling"]:
        r = runs[p["workers"]]
        table.add_row(
            str(p["workers"]),
            f"{p['throughput']:.1f}",
            f"{p['speedup']:.3f}",
            f"{p['efficiency']:.1%}",
            f"{r['step_s'] * 1e3:.1f}",
            *(f"{r['parts'][part] * 1e3:.1f}" for part in PARTS),
        )
    console.print(table)
    console.print(
        "times in ms per step (mean over ranks); comm = communication not hidden behind "
        "backward; compute = forward + backward"
    )
    for run in report["runs"]:
        line = outer_line(run)
        if line is not None:
            console.print(line)
    console.print(amdahl_line(report["amdahl"]))
    fit = (report.get("allreduce") or {}).get("fit")
    if fit:
        console.print(
            f"Allreduce fit: alpha = {fit['alpha_s'] * 1e6:.2f} us, "
            f"B = {fit['bandwidth_gbps']:.3f} Gbit/s"
        )
    for sentence in report["conclusions"]:
        console.print(f"- {sentence}")
