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

The analysis lives in four modules, re-exported here: :mod:`~ringtrain.bench.windows`
(timing windows -> :class:`RunTiming`), :mod:`~ringtrain.bench.scaling` (speedup, Amdahl),
:mod:`~ringtrain.bench.comm_model` (alpha-beta model, predictions) and
:mod:`~ringtrain.bench.conclusions` (what limits scaling, in words);
:mod:`~ringtrain.bench.core` holds :class:`BenchError` and the shared constants.
"""

from __future__ import annotations

from ringtrain.bench.comm_model import (
    AllreduceSample,
    AlphaBetaFit,
    Prediction,
    PredictionPoint,
    exposed_ratio,
    fit_alpha_beta,
    predict_efficiency,
)
from ringtrain.bench.conclusions import compressed_comm_share, conclusions
from ringtrain.bench.core import (
    DEFAULT_PREDICT_WORKERS,
    NOTABLE_SHARE,
    PART_LABELS,
    REFERENCE_SAMPLES,
    BenchError,
)
from ringtrain.bench.scaling import AmdahlFit, ScalingPoint, fit_amdahl, scaling_points
from ringtrain.bench.windows import RunTiming, aggregate_windows
from ringtrain.monitor.timing import PARTS

__all__ = [
    "DEFAULT_PREDICT_WORKERS",
    "NOTABLE_SHARE",
    "PARTS",
    "PART_LABELS",
    "REFERENCE_SAMPLES",
    "AllreduceSample",
    "AlphaBetaFit",
    "AmdahlFit",
    "BenchError",
    "Prediction",
    "PredictionPoint",
    "RunTiming",
    "ScalingPoint",
    "aggregate_windows",
    "compressed_comm_share",
    "conclusions",
    "exposed_ratio",
    "fit_alpha_beta",
    "fit_amdahl",
    "predict_efficiency",
    "scaling_points",
]
