"""The alpha-beta model of a ring allreduce, and the efficiency it predicts at larger W.

t(n, W) = 2 (W - 1) alpha + 2 (W - 1) / W * n / B (alpha: seconds per message hop, B: bytes per
second), fitted to measured allreduce times; the prediction keeps the measured compute and
scales the exposed share of communication with the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ringtrain.bench.core import (
    DEFAULT_PREDICT_WORKERS,
    BenchError,
    fmt_bytes,
)
from ringtrain.bench.windows import RunTiming


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
        f"Every step allreduces {fmt_bytes(largest.comm_bytes)} (measured at "
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
