"""The scaling report's files: ``scaling.json``, ``scaling.html`` and its PNG charts.

:func:`build_report` turns measurements into one JSON-able dict (every number the report shows);
:func:`write_report` writes that dict as ``scaling.json``, draws the charts from it with
matplotlib (Agg, no display needed) as PNG files next to it, and writes ``scaling.html``, a
single page with the charts embedded as base64 PNG: it renders offline, on its own. Without
matplotlib (the ``bench`` extra) the report is written without its charts, and says so. The charts
are drawn by :mod:`~ringtrain.bench.charts`, the page by :mod:`~ringtrain.bench.page`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.bench.analysis import (
    REFERENCE_SAMPLES,
    AllreduceSample,
    AlphaBetaFit,
    BenchError,
    Prediction,
    RunTiming,
    conclusions,
    fit_alpha_beta,
    fit_amdahl,
    predict_efficiency,
    scaling_points,
)
from ringtrain.bench.charts import (
    MATPLOTLIB_HINT,
    NO_CHARTS,
    have_matplotlib,
    render_charts,
    require_matplotlib,
)
from ringtrain.bench.page import render_html

__all__ = [
    "MATPLOTLIB_HINT",
    "NO_CHARTS",
    "build_report",
    "have_matplotlib",
    "render_charts",
    "render_html",
    "require_matplotlib",
    "write_report",
]

DEFINITION = (
    "Weak scaling: every worker keeps its batch size, so W workers process W times the samples "
    "per step. throughput(W) = global samples per second = the sum over ranks of each rank's "
    "samples divided by the seconds its timed steps took (warm-up steps left out). "
    f"T_W = N / throughput(W) is the time to process a fixed number of samples (N = "
    f"{REFERENCE_SAMPLES:,} here), so the speedup S(W) = T_1 / T_W = throughput(W) / "
    "throughput(1) and the efficiency E(W) = S(W) / W."
)


# --------------------------------------------------------------------------------------------
# The numbers
# --------------------------------------------------------------------------------------------


def build_report(
    runs: Sequence[RunTiming],
    allreduce: Sequence[AllreduceSample] | None,
    *,
    bandwidth: float | None = None,
    predict_workers: Sequence[int] = (4, 8, 16, 32, 64),
    cpu_count: int | None = None,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Every number of the scaling report, as one JSON-able dict (the content of scaling.json).

    Args:
        runs: one timing per measured worker count; must include W = 1 and a W >= 2.
        allreduce: the allreduce measurement (``None``: no alpha-beta model, no prediction).
        bandwidth: bytes per second to predict with instead of the fitted bandwidth.
        predict_workers: the W to predict efficiency at.
        cpu_count: CPU cores of the machine (for the conclusions).
        meta: command, date, machine, script, run directories: copied into the report.

    Returns:
        The report dict: ``definition``, ``runs``, ``scaling``, ``amdahl``, ``allreduce``,
        ``prediction``, ``conclusions``, ``notes`` and the ``meta`` keys.

    Raises:
        BenchError: the runs cannot give S and E (no W = 1, no W >= 2, ...).
    """
    runs = sorted(runs, key=lambda r: r.workers)
    if not any(r.workers >= 2 for r in runs):
        raise BenchError("the scaling report needs a run at W = 1 and at least one W >= 2")
    points = scaling_points(runs)
    amdahl = fit_amdahl([p.workers for p in points], [p.speedup for p in points])
    fit: AlphaBetaFit | None = None
    prediction: Prediction | None = None
    allreduce_part: dict[str, Any] | None = None
    notes = [f"W = {r.workers}: {n}" for r in runs for n in r.notes]
    if allreduce:
        allreduce_part = {
            "workers": allreduce[0].workers,
            "samples": [
                {
                    "bytes": s.nbytes,
                    "workers": s.workers,
                    "seconds": s.seconds,
                    "p10_s": s.low_s,
                    "p90_s": s.high_s,
                }
                for s in allreduce
            ],
        }
        try:
            fit = fit_alpha_beta(allreduce)
        except BenchError as exc:
            allreduce_part["error"] = str(exc)
            notes.append(f"alpha-beta fit: {exc}")
        else:
            allreduce_part["fit"] = fit.to_dict()
            prediction = predict_efficiency(runs, fit, workers=predict_workers, bandwidth=bandwidth)
            largest = max(runs, key=lambda r: r.workers)
            if largest.comm_bytes > 0:
                allreduce_part["check"] = {
                    "workers": largest.workers,
                    "comm_bytes": largest.comm_bytes,
                    "model_s": fit.time_s(largest.comm_bytes, largest.workers),
                    "measured_comm_s": largest.comm_s,
                }
    report: dict[str, Any] = dict(meta or {})
    report.update(
        {
            "format": 1,
            "definition": DEFINITION,
            "reference_samples": REFERENCE_SAMPLES,
            "runs": [r.to_dict() for r in runs],
            "scaling": [p.to_dict() for p in points],
            "amdahl": {
                **amdahl.to_dict(),
                "curve": [
                    {
                        "workers": w,
                        "speedup": amdahl.speedup(w),
                        "efficiency": amdahl.speedup(w) / w,
                    }
                    for w in sorted({*(p.workers for p in points), *predict_workers})
                ],
            },
            "allreduce": allreduce_part,
            "prediction": prediction.to_dict() if prediction is not None else None,
            "conclusions": conclusions(runs, fit, cpu_count=cpu_count, prediction=prediction),
            "notes": notes,
        }
    )
    return report


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def write_report(report: Mapping[str, Any], out_dir: str) -> dict[str, str]:
    """Write ``scaling.json``, one PNG per chart and ``scaling.html`` into ``out_dir`` (no PNG
    without matplotlib: the page then says how to get the charts).

    Args:
        report: the dict from :func:`build_report`.
        out_dir: a local directory (created if missing).

    Returns:
        File kind (``json``, ``html`` and each chart name) -> absolute path written.

    Raises:
        OSError: ``out_dir`` cannot be written.
    """
    charts = render_charts(report) if have_matplotlib() else {}
    out_dir = os.path.abspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths: dict[str, str] = {}
    json_path = os.path.join(out_dir, "scaling.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)
        f.write("\n")
    paths["json"] = json_path
    for name, png in charts.items():
        path = os.path.join(out_dir, f"{name}.png")
        with open(path, "wb") as f:
            f.write(png)
        paths[name] = path
    html_path = os.path.join(out_dir, "scaling.html")
    with open(html_path, "w") as f:
        f.write(render_html(report, charts))
    paths["html"] = html_path
    return paths
