"""The numbers of the scaling report, as pure functions of measurements.

Weak scaling: every worker keeps its batch, so W workers process W times the samples per step.

* throughput(W): global samples per second, the sum over ranks of each rank's samples divided by
  the seconds its timed steps took (``samples / window_s`` of its timing windows, warm-up left out).
* T_W = N / throughput(W), the time to process a fixed number N of samples; hence
  S(W) = T_1 / T_W = throughput(W) / throughput(1) and E(W) = S(W) / W.
* Amdahl: S(W) = 1 / ((1 - p) + p / W), with p in [0, 1] fitted by least squares.
* Alpha-beta model of a ring allreduce of n bytes over W ranks:
  t(n, W) = 2 (W - 1) alpha + 2 (W - 1) / W * n / B  (alpha: seconds per message hop,
  B: bytes per second), fitted to measured allreduce times.

Everything here takes plain numbers or timing-window dicts (the ``timing`` events of
``events.jsonl``, see docs/run-directory.md) and raises :class:`BenchError` with the reason when
the input cannot give a meaningful number.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringtrain.monitor.timing import (  # a step's parts; they sum to the mean step time
    PARTS,
    warmup_steps,
)

__all__ = [
    "PARTS",
    "PART_LABELS",
    "AllreduceSample",
    "AlphaBetaFit",
    "AmdahlFit",
    "BenchError",
    "Prediction",
    "PredictionPoint",
    "RunTiming",
    "ScalingPoint",
    "aggregate_windows",
    "conclusions",
    "fit_alpha_beta",
    "fit_amdahl",
    "predict_efficiency",
    "scaling_points",
]

PART_LABELS = {
    "data_s": "data wait",
    "compute_s": "compute (forward + backward)",
    "comm_exposed_s": "communication (exposed)",
    "optimizer_s": "optimizer",
    "other_s": "other",
}
#: Worker counts the alpha-beta model predicts efficiency for (besides the measured ones).
DEFAULT_PREDICT_WORKERS = (4, 8, 16, 32, 64)
#: A part of the step at least this large (fraction of the step) is worth a sentence.
NOTABLE_SHARE = 0.10
#: Reference amount of work for T_W (samples).
REFERENCE_SAMPLES = 10_000


class BenchError(ValueError):
    """Measurements that cannot give the requested number; the message says why and what to do."""


# --------------------------------------------------------------------------------------------
# Timing windows -> one row per worker count
# --------------------------------------------------------------------------------------------


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
        }


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
    )


# --------------------------------------------------------------------------------------------
# Speedup, efficiency, Amdahl
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Alpha-beta model of the ring allreduce
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllreduceSample:
    """One measured allreduce time.

    Attributes:
        nbytes: message size (bytes) per rank.
        workers: W, the number of ranks (>= 2).
        seconds: the allreduce time (seconds): the median of the timed calls.
        low_s: the 10th percentile of the timed calls (seconds), if known.
        high_s: the 90th percentile of the timed calls (seconds), if known.
    """

    nbytes: int
    workers: int
    seconds: float
    low_s: float | None = None
    high_s: float | None = None


@dataclass(frozen=True)
class AlphaBetaFit:
    """t(n, W) = 2 (W - 1) alpha + 2 (W - 1) / W * n / B, fitted to measured allreduces.

    Attributes:
        alpha_s: latency per message hop (seconds), >= 0.
        bandwidth: B (bytes per second), > 0.
        max_rel_error: the largest |model - measured| / measured over the samples.
    """

    alpha_s: float
    bandwidth: float
    max_rel_error: float

    def latency_s(self, workers: int) -> float:
        """The latency term 2 (W - 1) alpha (seconds)."""
        return 2.0 * (workers - 1) * self.alpha_s

    def transfer_s(self, nbytes: float, workers: int, bandwidth: float | None = None) -> float:
        """The bandwidth term 2 (W - 1) / W * n / B (seconds); ``bandwidth`` overrides B."""
        b = self.bandwidth if bandwidth is None else bandwidth
        return 2.0 * (workers - 1) / workers * nbytes / b

    def time_s(self, nbytes: float, workers: int, bandwidth: float | None = None) -> float:
        """Predicted allreduce time (seconds) of ``nbytes`` over ``workers`` ranks."""
        return self.latency_s(workers) + self.transfer_s(nbytes, workers, bandwidth)

    def to_dict(self) -> dict[str, Any]:
        return {
            "alpha_s": self.alpha_s,
            "bandwidth_bytes_per_s": self.bandwidth,
            "bandwidth_gbps": self.bandwidth * 8 / 1e9,
            "max_rel_error": self.max_rel_error,
        }


def fit_alpha_beta(samples: Sequence[AllreduceSample]) -> AlphaBetaFit:
    """Fit alpha >= 0 and B > 0 of the ring allreduce model to measured times.

    Least squares on relative residuals, (model - t) / t, so that the small messages (which
    determine alpha) weigh as much as the large ones (which determine B). When the unconstrained
    optimum has alpha < 0, alpha is 0 and B is refitted alone.

    Args:
        samples: measured allreduce times at W >= 2, at least two different sizes.

    Returns:
        The fit.

    Raises:
        BenchError: fewer than two sizes, a sample at W < 2 or with a time <= 0, or times that do
            not grow with the message size (the bandwidth term of the largest message would be
            under 5% of its time: no bandwidth can be fitted).
    """
    if not samples:
        raise BenchError("no allreduce measurements to fit")
    for sample in samples:
        if sample.workers < 2:
            raise BenchError(f"allreduce sample at W={sample.workers}: the model needs W >= 2")
        if not (sample.seconds > 0 and math.isfinite(sample.seconds)) or sample.nbytes <= 0:
            raise BenchError(f"allreduce sample {sample} needs bytes > 0 and seconds > 0")
    if len({(s.nbytes, s.workers) for s in samples}) < 2 or len({s.nbytes for s in samples}) < 2:
        raise BenchError("the alpha-beta fit needs allreduce times of at least two message sizes")
    w = np.array([s.workers for s in samples], dtype=float)
    n = np.array([s.nbytes for s in samples], dtype=float)
    t = np.array([s.seconds for s in samples], dtype=float)
    x1 = 2.0 * (w - 1.0) / t
    x2 = 2.0 * (w - 1.0) / w * n / t
    # Scale the columns so that lstsq is well conditioned (x2 is ~1e9 times x1).
    c1, c2 = float(np.max(x1)), float(np.max(x2))
    a = np.column_stack([x1 / c1, x2 / c2])
    (u1, u2), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    alpha, beta = u1 / c1, u2 / c2
    if alpha < 0:
        alpha = 0.0
        beta = float(np.sum(x2) / np.sum(x2 * x2))
    biggest = max(samples, key=lambda s: (s.nbytes, s.seconds))
    transfer = 2.0 * (biggest.workers - 1) / biggest.workers * biggest.nbytes * beta
    if not beta > 0 or transfer < 0.05 * biggest.seconds:
        # A bandwidth term under 5% of the largest message's time is noise, not a measurement.
        raise BenchError(
            "the measured allreduce times do not grow with the message size "
            f"({', '.join(f'{int(b)} B: {s * 1e3:.3f} ms' for b, s in zip(n, t, strict=True))}); "
            "no bandwidth can be fitted"
        )
    fit = AlphaBetaFit(alpha_s=float(alpha), bandwidth=float(1.0 / beta), max_rel_error=0.0)
    errors = [abs(fit.time_s(s.nbytes, s.workers) - s.seconds) / s.seconds for s in samples]
    return AlphaBetaFit(fit.alpha_s, fit.bandwidth, float(max(errors)))


@dataclass(frozen=True)
class PredictionPoint:
    """Predicted step at one worker count.

    Attributes:
        workers: W.
        allreduce_s: modelled allreduce time of one step's bytes (seconds).
        comm_exposed_s: the part of it the step waits for (seconds).
        step_s: busy time at W = 1 plus ``comm_exposed_s`` (seconds).
        efficiency: E(W) = step(1) / step(W).
        speedup: S(W) = W * E(W).
    """

    workers: int
    allreduce_s: float
    comm_exposed_s: float
    step_s: float
    efficiency: float
    speedup: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "allreduce_s": self.allreduce_s,
            "comm_exposed_s": self.comm_exposed_s,
            "step_s": self.step_s,
            "efficiency": self.efficiency,
            "speedup": self.speedup,
        }


@dataclass(frozen=True)
class Prediction:
    """Efficiency predicted by the alpha-beta model for a stated bandwidth.

    Attributes:
        bandwidth: the bandwidth used (bytes per second).
        bandwidth_source: ``"fitted"`` or ``"stated"``.
        alpha_s: the latency per hop used (seconds).
        busy_s: the step without communication, measured at W = 1 (seconds).
        comm_bytes: bytes allreduced per step (measured at ``from_workers``).
        exposed_ratio: exposed / total communication, measured at ``from_workers``.
        from_workers: the measured W the bytes and the exposed ratio come from.
        points: one per predicted W.
        assumptions: the model's assumptions, in words.
    """

    bandwidth: float
    bandwidth_source: str
    alpha_s: float
    busy_s: float
    comm_bytes: float
    exposed_ratio: float
    from_workers: int
    points: list[PredictionPoint]
    assumptions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "bandwidth_bytes_per_s": self.bandwidth,
            "bandwidth_gbps": self.bandwidth * 8 / 1e9,
            "bandwidth_source": self.bandwidth_source,
            "alpha_s": self.alpha_s,
            "busy_s": self.busy_s,
            "comm_bytes": self.comm_bytes,
            "exposed_ratio": self.exposed_ratio,
            "from_workers": self.from_workers,
            "points": [p.to_dict() for p in self.points],
            "assumptions": list(self.assumptions),
        }


def exposed_ratio(run: RunTiming) -> float:
    """Exposed / total communication time of a run, in [0, 1]; 1 (nothing hidden) when the run
    measured no communication time."""
    if run.comm_s <= 0:
        return 1.0
    return min(1.0, max(0.0, run.parts["comm_exposed_s"] / run.comm_s))


def predict_efficiency(
    runs: Sequence[RunTiming],
    fit: AlphaBetaFit,
    *,
    workers: Iterable[int] = DEFAULT_PREDICT_WORKERS,
    bandwidth: float | None = None,
) -> Prediction:
    """Predict E(W) at larger W from the W = 1 step and the allreduce model.

    step(W) = busy(1) + r * t(bytes, W), where busy(1) is the step time at W = 1 without its
    (zero) communication, bytes the bytes allreduced per step and r the exposed / total
    communication ratio, both measured at the largest measured W; E(W) = step(1) / step(W).

    Args:
        runs: the measured runs; must include W = 1 and one W >= 2.
        fit: the allreduce model.
        workers: the W to predict (the measured ones are added, for comparison).
        bandwidth: bytes per second to assume instead of the fitted B (e.g. a target network).

    Returns:
        The prediction, with its assumptions in words.

    Raises:
        BenchError: no W = 1 run, no W >= 2 run, or a bandwidth <= 0.
    """
    base = next((r for r in runs if r.workers == 1), None)
    if base is None:
        raise BenchError("the prediction needs the W = 1 run (the step without communication)")
    multi = [r for r in runs if r.workers >= 2]
    if not multi:
        raise BenchError("the prediction needs a run at some W >= 2 (bytes per step)")
    if bandwidth is not None and not bandwidth > 0:
        raise BenchError(f"bandwidth must be > 0 bytes/s, got {bandwidth!r}")
    largest = max(multi, key=lambda r: r.workers)
    busy = base.step_s - base.parts["comm_exposed_s"]
    ratio = exposed_ratio(largest)
    b = fit.bandwidth if bandwidth is None else bandwidth
    targets = sorted({int(w) for w in workers if int(w) >= 1} | {r.workers for r in runs})
    points = []
    for w in targets:
        allreduce = fit.time_s(largest.comm_bytes, w, b) if w > 1 and largest.comm_bytes > 0 else 0
        exposed = ratio * allreduce
        step = busy + exposed
        eff = busy / step if step > 0 else 1.0
        points.append(PredictionPoint(w, allreduce, exposed, step, eff, eff * w))
    gbps = b * 8 / 1e9
    assumptions = [
        f"Each worker keeps its per-worker batch and runs a step as fast as the single worker "
        f"did at W = 1 ({busy * 1e3:.2f} ms without communication): its own cores or GPU, data "
        "loading that scales with it. Contention between workers on one machine is not modelled.",
        f"Every step allreduces {_fmt_bytes(largest.comm_bytes)} (measured at "
        f"W = {largest.workers}) as one ring allreduce: t = 2(W-1)*alpha + 2(W-1)/W * bytes/B, "
        f"alpha = {fit.alpha_s * 1e6:.1f} us (fitted), B = {gbps:.2f} Gbit/s "
        f"({'stated' if bandwidth is not None else 'fitted on this machine'}). DDP's gradient "
        "buckets add one latency term per bucket, not counted here.",
        f"The step waits for {ratio:.0%} of that time (exposed / total communication measured "
        f"at W = {largest.workers}); the rest stays hidden behind the backward pass at every W.",
        "Stragglers, the network topology (a ring over several hosts and switches) and "
        "congestion are not modelled: at large W a real cluster does worse than this.",
    ]
    return Prediction(
        bandwidth=b,
        bandwidth_source="fitted" if bandwidth is None else "stated",
        alpha_s=fit.alpha_s,
        busy_s=busy,
        comm_bytes=largest.comm_bytes,
        exposed_ratio=ratio,
        from_workers=largest.workers,
        points=points,
        assumptions=assumptions,
    )


# --------------------------------------------------------------------------------------------
# What limits scaling, in words
# --------------------------------------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _pct(x: float) -> str:
    return f"{x * 100:.0f}%"


def compressed_comm_share(run: RunTiming, fit: AlphaBetaFit | None, factor: float = 0.5) -> float:
    """The exposed-communication share of the step if the allreduced bytes shrank by ``factor``.

    Only the bandwidth term shrinks: with a fit, the exposed time scales by
    (latency + factor * transfer) / (latency + transfer) at the run's bytes and W; without one,
    all of it is taken as bandwidth-bound.
    """
    exposed = run.parts["comm_exposed_s"]
    scale = factor
    if fit is not None and run.comm_bytes > 0 and run.workers > 1:
        lat = fit.latency_s(run.workers)
        tr = fit.transfer_s(run.comm_bytes, run.workers)
        scale = (lat + factor * tr) / (lat + tr)
    new = exposed * scale
    rest = run.step_s - exposed
    return new / (rest + new) if rest + new > 0 else 0.0


def conclusions(
    runs: Sequence[RunTiming],
    fit: AlphaBetaFit | None = None,
    *,
    cpu_count: int | None = None,
    prediction: Prediction | None = None,
) -> list[str]:
    """What limits scaling, in plain words, derived from the largest measured W.

    The first sentence names the part of the step that dominates besides compute (exposed
    communication, data wait, optimizer, other) when it is at least 10% of the step, with what
    would help; otherwise it says the step is compute-bound. Then: how the step grew from W = 1,
    whether compute per step grew (workers sharing one machine's cores), the measured efficiency,
    and the prediction.

    Args:
        runs: the measured runs; must include W = 1 and one W >= 2.
        fit: the allreduce model, for what compression would save (optional).
        cpu_count: CPU cores of the machine the runs shared (optional).
        prediction: the alpha-beta prediction to summarise (optional).

    Returns:
        Sentences, the most important first.

    Raises:
        BenchError: no W = 1 run or no W >= 2 run.
    """
    points = {p.workers: p for p in scaling_points(runs)}
    base = next(r for r in runs if r.workers == 1)
    multi = [r for r in runs if r.workers >= 2]
    if not multi:
        raise BenchError("conclusions need a run at some W >= 2")
    big = max(multi, key=lambda r: r.workers)
    w = big.workers
    out: list[str] = []

    overheads = ("comm_exposed_s", "data_s", "optimizer_s", "other_s")
    top = max(overheads, key=big.share)
    share = big.share(top)
    if share >= NOTABLE_SHARE:
        if top == "comm_exposed_s":
            after = compressed_comm_share(big, fit)
            sentence = (
                f"Communication is {_pct(share)} of the step at W = {w} "
                f"({_ms(big.parts[top])} of {_ms(big.step_s)} waiting for the gradient allreduce, "
                "not hidden behind the backward pass); "
            )
            lat = total = 0.0
            if fit is not None and big.comm_bytes > 0:
                lat = fit.latency_s(w)
                total = fit.time_s(big.comm_bytes, w)
            if total > 0 and lat >= 0.5 * total:
                sentence += (
                    "bf16 gradient compression (half the bytes) would help little "
                    f"(to ~{_pct(after)} of the step): at {_fmt_bytes(big.comm_bytes)} per step "
                    f"the allreduce is latency-bound ({_ms(lat)} of the modelled {_ms(total)} is "
                    "the 2(W-1)*alpha latency term, which compression does not shorten)"
                )
            else:
                sentence += (
                    "bf16 gradient compression (half the bytes) would cut it to "
                    f"~{_pct(after)} of the step"
                )
            out.append(sentence + ".")
        elif top == "data_s":
            out.append(
                f"Data loading is {_pct(share)} of the step at W = {w} ({_ms(big.parts[top])} "
                "per step waiting for the next batch): add DataLoader workers (num_workers), "
                "pin_memory, or move preprocessing out of the training loop."
            )
        elif top == "optimizer_s":
            out.append(
                f"The optimizer step is {_pct(share)} of the step at W = {w} "
                f"({_ms(big.parts[top])}): a fused or foreach optimizer implementation would "
                "shorten it."
            )
        else:
            out.append(
                f"{_pct(share)} of the step at W = {w} ({_ms(big.parts[top])}) is outside data, "
                "compute, communication and the optimizer (Python between batches: logging, "
                ".item() synchronisations, evaluation or checkpoints inside the loop): do that "
                "work less often or outside the timed steps."
            )
    else:
        efficiency = points[w].efficiency
        out.append(
            f"The step is compute-bound: forward + backward is "
            f"{_pct(big.share('compute_s'))} of the step at W = {w}, and no other part reaches "
            f"{_pct(NOTABLE_SHARE)} (largest: {PART_LABELS[top]}, {_pct(share)}): more workers "
            "add throughput as long as each has its own cores or GPU"
            + (
                f"; the efficiency lost here (E = {_pct(efficiency)}) comes from the step "
                "growing with W (below)."
                if efficiency < 0.95
                else "."
            )
        )

    growth = big.step_s - base.step_s
    deltas = sorted(((p, big.parts[p] - base.parts[p]) for p in PARTS), key=lambda kv: -abs(kv[1]))
    listed = [
        f"{d * 1e3:+.2f} ms {PART_LABELS[p]}" for p, d in deltas if abs(d) >= 0.05 * abs(growth)
    ]
    out.append(
        f"From W = 1 to W = {w} the mean step went from {_ms(base.step_s)} to "
        f"{_ms(big.step_s)} ({growth * 1e3:+.2f} ms"
        + (f": {', '.join(listed)}" if listed and growth != 0 else "")
        + ")."
    )

    c1, cw = base.parts["compute_s"], big.parts["compute_s"]
    if c1 > 0 and cw > 1.1 * c1:
        cores = f" with {cpu_count} CPU cores" if cpu_count else ""
        out.append(
            f"Compute per step grew {cw / c1:.2f}x from W = 1 to W = {w} for the same per-worker "
            f"batch: {'both' if w == 2 else f'all {w}'} workers run on this one machine{cores} "
            "and share its cores and "
            "memory bandwidth, so each computes slower. Workers with their own hardware would "
            "not pay this."
        )

    elif cw > 0 and c1 > 1.1 * cw:
        out.append(
            f"Compute per step shrank {c1 / cw:.2f}x from W = 1 to W = {w} for the same "
            f"per-worker batch: the single worker computed slower than each of the {w} (other "
            "load on the machine during the W = 1 run, or a different number of threads), so "
            "the speedups and efficiencies here are flattered."
        )

    if fit is not None and big.comm_bytes > 0:
        alone = fit.time_s(big.comm_bytes, w)
        if big.comm_s > 2 * alone:
            out.append(
                f"The training run's communication took {_ms(big.comm_s)} per step at W = {w}, "
                f"{big.comm_s / alone:.1f}x what the allreduce of its {_fmt_bytes(big.comm_bytes)} "
                f"takes on its own ({_ms(alone)}, alpha-beta model): during training it competes "
                "with the backward pass for the machine's cores and waits for slower peers. The "
                "prediction for larger W uses the allreduce on its own."
            )

    point = points[w]
    out.append(
        f"Measured at W = {w}: speedup S = {point.speedup:.2f}, efficiency E = "
        f"{_pct(point.efficiency)} (throughput {big.throughput:.0f} samples/s against "
        f"{base.throughput:.0f} at W = 1)."
    )
    if prediction is not None:
        far = [p for p in prediction.points if p.workers > w]
        if far:
            last = far[-1]
            out.append(
                f"At {prediction.bandwidth * 8 / 1e9:.2f} Gbit/s "
                f"({prediction.bandwidth_source}), the alpha-beta model predicts E = "
                f"{_pct(last.efficiency)} at W = {last.workers} "
                f"({_ms(last.comm_exposed_s)} exposed communication per "
                f"{_ms(last.step_s)} step), if each worker had its own hardware."
            )
    return out
