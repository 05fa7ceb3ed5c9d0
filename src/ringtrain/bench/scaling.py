"""Speedup, efficiency and Amdahl's law from the per-worker-count throughputs.

S(W) = throughput(W) / throughput(1), E(W) = S(W) / W; Amdahl: S(W) = 1 / ((1 - p) + p / W),
with p in [0, 1] fitted by least squares.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ringtrain.bench.core import (
    REFERENCE_SAMPLES,
    BenchError,
)
from ringtrain.bench.windows import RunTiming


@dataclass(frozen=True)
class ScalingPoint:
    """Speedup and efficiency at one worker count.

    Attributes:
        workers: W.
        throughput: global samples per second.
        time_s: T_W, seconds to process ``reference_samples`` samples at this throughput.
        speedup: S(W) = T_1 / T_W = throughput(W) / throughput(1).
        efficiency: E(W) = S(W) / W.
    """

    workers: int
    throughput: float
    time_s: float
    speedup: float
    efficiency: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "throughput": self.throughput,
            "time_s": self.time_s,
            "speedup": self.speedup,
            "efficiency": self.efficiency,
        }


def scaling_points(
    runs: Sequence[RunTiming], reference_samples: int = REFERENCE_SAMPLES
) -> list[ScalingPoint]:
    """S(W) and E(W) for every run, sorted by W.

    Args:
        runs: one timing per worker count; must include W = 1, the baseline.
        reference_samples: N in T_W = N / throughput(W) (samples).

    Returns:
        One point per run, by increasing W; the W = 1 point has S = E = 1.

    Raises:
        BenchError: no runs, two runs with the same W, no W = 1 run, or a throughput <= 0.
    """
    if not runs:
        raise BenchError("no runs to compare: measure at least W = 1 and one W >= 2")
    counts = [r.workers for r in runs]
    duplicates = sorted({w for w in counts if counts.count(w) > 1})
    if duplicates:
        raise BenchError(f"more than one run at W = {duplicates}")
    base = next((r for r in runs if r.workers == 1), None)
    if base is None:
        raise BenchError(
            f"no run at W = 1 (got W = {sorted(counts)}): S(W) = T_1 / T_W needs the one-worker "
            "baseline; add 1 to --workers"
        )
    for run in runs:
        if not run.throughput > 0:
            raise BenchError(f"W={run.workers}: throughput {run.throughput!r} is not > 0")
    points = []
    for run in sorted(runs, key=lambda r: r.workers):
        speedup = run.throughput / base.throughput
        points.append(
            ScalingPoint(
                workers=run.workers,
                throughput=run.throughput,
                time_s=reference_samples / run.throughput,
                speedup=speedup,
                efficiency=speedup / run.workers,
            )
        )
    return points


@dataclass(frozen=True)
class AmdahlFit:
    """Amdahl's law fitted to measured speedups.

    Attributes:
        p: the parallel fraction, in [0, 1].
        rmse: root-mean-square error of the fitted speedups against the measured ones.
        clamped: the unconstrained least-squares p lay outside [0, 1] (speedups below 1, or
            above W: the measured times do not follow Amdahl's law), so ``p`` is the bound.
    """

    p: float
    rmse: float
    clamped: bool

    def speedup(self, workers: float) -> float:
        """S(W) = 1 / ((1 - p) + p / W)."""
        return 1.0 / ((1.0 - self.p) + self.p / workers)

    def to_dict(self) -> dict[str, Any]:
        return {"p": self.p, "rmse": self.rmse, "clamped": self.clamped}


def _amdahl_sse(p: float, w: np.ndarray, s: np.ndarray) -> float:
    return float(np.sum((s - 1.0 / ((1.0 - p) + p / w)) ** 2))


def fit_amdahl(workers: Sequence[int], speedups: Sequence[float]) -> AmdahlFit:
    """Least-squares fit of p in S(W) = 1 / ((1 - p) + p / W) over p in [0, 1].

    One point with W > 1 determines p exactly: p = (1 - 1/S) / (1 - 1/W) (clamped to [0, 1]).

    Args:
        workers: the measured W (points at W = 1 carry no information and are allowed).
        speedups: the measured S(W), same length.

    Returns:
        The fit.

    Raises:
        BenchError: different lengths, no W > 1, or a non-positive or non-finite speedup.
    """
    if len(workers) != len(speedups):
        raise BenchError(f"{len(workers)} worker counts but {len(speedups)} speedups")
    w = np.asarray(workers, dtype=float)
    s = np.asarray(speedups, dtype=float)
    if not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise BenchError(f"speedups must be finite and > 0, got {list(speedups)}")
    keep = w > 1
    if not np.any(keep):
        raise BenchError("the Amdahl fit needs a speedup measured at some W >= 2")
    w, s = w[keep], s[keep]
    raw = (1.0 - 1.0 / s) / (1.0 - 1.0 / w)
    if len(w) == 1:
        p = float(min(1.0, max(0.0, raw[0])))
        clamped = not 0.0 <= float(raw[0]) <= 1.0
    else:
        grid = np.linspace(0.0, 1.0, 2001)
        sse = np.array([_amdahl_sse(float(g), w, s) for g in grid])
        i = int(np.argmin(sse))
        lo, hi = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
        # Golden-section search in the bracket around the grid minimum.
        ratio = (math.sqrt(5.0) - 1.0) / 2.0
        a, b = float(lo), float(hi)
        for _ in range(60):
            c, d = b - ratio * (b - a), a + ratio * (b - a)
            if _amdahl_sse(c, w, s) <= _amdahl_sse(d, w, s):
                b = d
            else:
                a = c
        p = (a + b) / 2.0
        # The least-squares p lies outside [0, 1] when the error still falls past a bound.
        step = 1e-6
        if i == 0 and _amdahl_sse(-step, w, s) < _amdahl_sse(0.0, w, s):
            p, clamped = 0.0, True
        elif i == len(grid) - 1 and _amdahl_sse(1.0 + step, w, s) < _amdahl_sse(1.0, w, s):
            p, clamped = 1.0, True
        else:
            clamped = False
    rmse = math.sqrt(_amdahl_sse(p, w, s) / len(w))
    return AmdahlFit(p=p, rmse=rmse, clamped=clamped)
