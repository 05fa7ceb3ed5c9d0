"""Timing windows -> one :class:`RunTiming` per worker count.

The workers' ``timing`` events (docs/run-directory.md) are summed per rank over the timed steps
(warm-up left out): throughput(W) is the sum over ranks of samples / window seconds, and the
step splits into the parts of :data:`~ringtrain.monitor.timing.PARTS` (they sum to the mean
step time).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringtrain.bench.core import (
    BenchError,
)
from ringtrain.monitor.outer_loop import OuterFigures, summarize_outer
from ringtrain.monitor.timing import PARTS, warmup_steps


@dataclass(frozen=True)
class RunTiming:
    """The timing of one run at one worker count, warm-up left out.

    Attributes:
        workers: W, the number of workers (world size).
        throughput: global samples per second (sum over ranks).
        rank_throughput: each rank's samples per second, by rank.
        step_s: mean step time (seconds), averaged over ranks.
        step_s_median: median step time (seconds): the median of the windows' medians.
        parts: mean seconds per step of each of :data:`PARTS`; they sum to ``step_s``.
        comm_s: mean total communication seconds per step (overlapped + exposed).
        comm_bytes: mean bytes allreduced per step (per rank).
        steps: steps measured per rank (the smallest over ranks).
        warmup_steps: steps left out as warm-up at the start (the fewest over ranks).
        windows: timing windows used (all ranks).
        samples: samples measured (all ranks).
        notes: caveats about the measurement (e.g. warm-up that could not be left out).
        outer: for a DiLoCo model (``parallel_strategy="diloco"``), its outer loop over the
            measured steps, averaged over ranks (:func:`outer_over_ranks`): bytes sent per
            inner step, seconds of outer sync per inner step and their share of the step time;
            ``None`` otherwise.
    """

    workers: int
    throughput: float
    rank_throughput: tuple[float, ...]
    step_s: float
    step_s_median: float
    parts: dict[str, float]
    comm_s: float
    comm_bytes: float
    steps: int
    warmup_steps: int
    windows: int
    samples: int
    notes: tuple[str, ...] = ()
    outer: OuterFigures | None = None

    def share(self, part: str) -> float:
        """``parts[part] / step_s`` (0 when the step time is 0)."""
        return self.parts[part] / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "throughput": self.throughput,
            "rank_throughput": list(self.rank_throughput),
            "step_s": self.step_s,
            "step_s_median": self.step_s_median,
            "parts": dict(self.parts),
            "shares": {p: self.share(p) for p in PARTS},
            "comm_s": self.comm_s,
            "comm_bytes": self.comm_bytes,
            "steps": self.steps,
            "warmup_steps": self.warmup_steps,
            "windows": self.windows,
            "samples": self.samples,
            "notes": list(self.notes),
            "outer": self.outer.to_dict() if self.outer is not None else None,
        }


def outer_over_ranks(per_rank: list[OuterFigures | None]) -> OuterFigures | None:
    """DiLoCo's outer loop of a run from each rank's figures over its measured windows: the mean
    over ranks of bytes per inner step, sync seconds (in all and per inner step) and their
    share of the step time; rank 0's outer-step count and exchanges; the fewest steps. ``None``
    unless every rank has figures (a run that is not DiLoCo)."""
    if not per_rank or any(f is None for f in per_rank):
        return None
    figures = [f for f in per_rank if f is not None]
    return OuterFigures(
        outer_steps=figures[0].outer_steps,
        steps=min(f.steps for f in figures),
        bytes_per_step=float(np.mean([f.bytes_per_step for f in figures])),
        sync_s=float(np.mean([f.sync_s for f in figures])),
        sync_s_per_step=float(np.mean([f.sync_s_per_step for f in figures])),
        sync_frac=float(np.mean([f.sync_frac for f in figures])),
        exchanges=figures[0].exchanges,
    )


def _number(window: Mapping[str, Any], key: str, where: str) -> float:
    value = window.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BenchError(f"{where}: timing window field {key!r} is {value!r}, not a number")
    return float(value)


def aggregate_windows(
    workers: int,
    windows: Iterable[Mapping[str, Any]],
    *,
    warmup_fraction: float = 0.2,
    min_warmup_steps: int = 2,
) -> RunTiming:
    """Combine the timing windows of one run into one :class:`RunTiming`.

    Each rank's first ``max(min_warmup_steps, ceil(warmup_fraction * its steps))`` steps are
    warm-up: only windows that start after them count. When a rank has no such window (windows
    too coarse for the run's length), its windows that end after the warm-up are used and a note
    says so. Per rank, the parts are step-weighted means over its windows and its throughput is
    its samples over the seconds of its steps; ranks then count equally in the means, and their
    throughputs add up.

    Args:
        workers: the run's world size W (>= 1); every rank 0..W-1 must have windows.
        windows: timing windows (dicts with ``rank``, ``steps``, ``step``, ``step_s``, the
            :data:`PARTS`, ``comm_s``, ``comm_bytes``, ``samples``, ``window_s``), as in the
            ``timing`` events of ``events.jsonl``; windows without steps are skipped.
        warmup_fraction: fraction of each rank's steps treated as warm-up.
        min_warmup_steps: at least this many steps are warm-up.

    Returns:
        The run's timing.

    Raises:
        BenchError: no windows, a rank without windows, a window without a needed field, or a
            rank with no step after the warm-up.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BenchError(f"workers must be a whole number >= 1, got {workers!r}")
    by_rank: dict[int, list[Mapping[str, Any]]] = {}
    for window in windows:
        rank = window.get("rank")
        if not isinstance(rank, int) or isinstance(rank, bool):
            raise BenchError(f"W={workers}: timing window without an integer 'rank': {window!r}")
        steps = window.get("steps")
        if isinstance(steps, int) and steps > 0:
            by_rank.setdefault(rank, []).append(window)
    if not by_rank:
        raise BenchError(
            f"W={workers}: no timing windows with steps (the run timed no training step: does the "
            "script iterate over a loader from ringtrain.prepare_data_loader, with timing on?)"
        )
    missing = [r for r in range(workers) if r not in by_rank]
    if missing:
        raise BenchError(f"W={workers}: no timing windows from rank(s) {missing}")
    extra = sorted(r for r in by_rank if r >= workers)
    if extra:
        raise BenchError(f"W={workers}: timing windows from rank(s) {extra}, beyond the world size")

    notes: list[str] = []
    rank_throughput: list[float] = []
    rank_parts: list[dict[str, float]] = []
    rank_comm: list[float] = []
    rank_bytes: list[float] = []
    medians: list[float] = []
    rank_steps: list[int] = []
    warmups: list[int] = []
    used_windows = 0
    samples_total = 0
    rank_outer: list[OuterFigures | None] = []
    for rank in range(workers):
        where = f"W={workers} rank {rank}"
        ends = [int(_number(w, "step", where)) for w in by_rank[rank]]
        rows = [w for _, w in sorted(zip(ends, by_rank[rank], strict=True), key=lambda e: e[0])]
        total = max(ends)
        warm = warmup_steps(total, warmup_fraction, min_warmup_steps)
        if total <= warm:
            raise BenchError(
                f"{where}: only {total} steps timed, all of them warm-up (the first {warm}); "
                f"raise --steps to at least {max(warm + 1, 5)}"
            )
        used = [w for w in rows if int(w["step"]) - int(w["steps"]) + 1 > warm]
        if not used:
            used = [w for w in rows if int(w["step"]) > warm]
        steps = sum(int(w["steps"]) for w in used)
        if total - steps < warm:
            notes.append(
                f"rank {rank}: its timing windows are too coarse to leave out {warm} warm-up "
                f"steps; only the first {total - steps} are left out (a window holds every step "
                "of MonitorConfig.timing_interval_s seconds: run more steps)"
            )
        samples = sum(_number(w, "samples", where) for w in used)
        seconds = sum(_number(w, "window_s", where) for w in used)
        if seconds <= 0 or samples <= 0:
            raise BenchError(
                f"{where}: {samples:g} samples in {seconds:g} s of timed steps, no throughput "
                "(samples are counted from the batches of ringtrain.prepare_data_loader)"
            )
        rank_throughput.append(samples / seconds)
        weights = [int(w["steps"]) / steps for w in used]
        rank_parts.append(
            {
                p: sum(wt * _number(w, p, where) for wt, w in zip(weights, used, strict=True))
                for p in PARTS
            }
        )
        rank_comm.append(
            sum(wt * _number(w, "comm_s", where) for wt, w in zip(weights, used, strict=True))
        )
        rank_bytes.append(
            sum(wt * _number(w, "comm_bytes", where) for wt, w in zip(weights, used, strict=True))
        )
        medians.extend(_number(w, "step_s", where) for w in used)
        rank_outer.append(summarize_outer(used))
        rank_steps.append(steps)
        warmups.append(total - steps)
        used_windows += len(used)
        samples_total += int(samples)

    parts = {p: float(np.mean([rp[p] for rp in rank_parts])) for p in PARTS}
    return RunTiming(
        workers=workers,
        throughput=float(sum(rank_throughput)),
        rank_throughput=tuple(rank_throughput),
        # The parts' sum, not the windows' step_s_mean: the two agree up to rounding, and the
        # report's stacked bars must add up to the step.
        step_s=float(sum(parts.values())),
        step_s_median=float(np.median(medians)),
        parts=parts,
        comm_s=float(np.mean(rank_comm)),
        comm_bytes=float(np.mean(rank_bytes)),
        steps=min(rank_steps),
        warmup_steps=min(warmups),
        windows=used_windows,
        samples=samples_total,
        notes=tuple(notes),
        outer=outer_over_ranks(rank_outer),
    )
