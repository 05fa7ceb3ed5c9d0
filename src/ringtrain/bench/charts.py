"""The scaling report's charts: PNG bytes drawn with matplotlib (Agg, no display needed) from
the report dict of :func:`~ringtrain.bench.report.build_report`."""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.bench.analysis import (
    PART_LABELS,
    PARTS,
    AlphaBetaFit,
)

MATPLOTLIB_HINT = (
    "the scaling report draws its charts with matplotlib, which is not installed: "
    "pip install 'ringtrain[bench]'"
)
#: What the report says instead of its charts when matplotlib is missing.
NO_CHARTS = (
    "No charts: matplotlib is not installed (pip install 'ringtrain[bench]'); every number "
    "is in the tables above and in scaling.json."
)

CHARTS = {
    "throughput": "Throughput against the number of workers",
    "speedup": "Speedup: measured, ideal, Amdahl fit",
    "efficiency": "Efficiency: measured, Amdahl fit, alpha-beta prediction",
    "step_split": "Where a step's time goes",
    "allreduce": "Allreduce time against message size, with the alpha-beta fit",
}

_PART_COLORS = {
    "data_s": "#f2b134",
    "compute_s": "#4c72b0",
    "comm_exposed_s": "#dd5145",
    "optimizer_s": "#55a868",
    "other_s": "#9a9a9a",
}


def have_matplotlib() -> bool:
    """Whether matplotlib can be imported (the ``bench`` extra): the charts need it, the rest of
    the report does not."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib() -> None:
    """Raise if matplotlib cannot be imported.

    Raises:
        ImportError: with the message :data:`MATPLOTLIB_HINT`.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MATPLOTLIB_HINT) from exc


def _figure() -> Any:
    # The object-oriented API with the Agg canvas: no pyplot, no global backend switch, no
    # display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _workers_axis(ax: Any, workers: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(workers))
    ax.set_xticklabels([str(w) for w in workers])
    ax.set_xlabel("workers W")
    ax.grid(True, alpha=0.3)


def _chart_throughput(report: Mapping[str, Any]) -> bytes:
    points = report["scaling"]
    w = [p["workers"] for p in points]
    t1 = points[0]["throughput"]
    fig = _figure()
    ax = fig.subplots()
    ax.plot(w, [t1 * x for x in w], "--", color="#999999", label="ideal (W x throughput(1))")
    ax.plot(w, [p["throughput"] for p in points], "o-", color="#4c72b0", label="measured")
    _workers_axis(ax, w)
    ax.set_ylabel("samples / s (all workers)")
    ax.set_ylim(bottom=0)
    ax.set_title("Throughput")
    ax.legend()
    return _png(fig)


def _chart_speedup(report: Mapping[str, Any]) -> bytes:
    points = report["scaling"]
    curve = report["amdahl"]["curve"]
    w = [p["workers"] for p in points]
    fig = _figure()
    ax = fig.subplots()
    cw = [c["workers"] for c in curve]
    ax.plot(cw, cw, "--", color="#999999", label="ideal S = W")
    ax.plot(
        cw,
        [c["speedup"] for c in curve],
        "-",
        color="#55a868",
        label=f"Amdahl fit, p = {report['amdahl']['p']:.3f}"
        + (" (clamped: the times do not fit)" if report["amdahl"].get("clamped") else ""),
    )
    pred = report.get("prediction")
    if pred:
        ax.plot(
            [p["workers"] for p in pred["points"]],
            [p["speedup"] for p in pred["points"]],
            ":",
            color="#dd5145",
            marker=".",
            label=f"alpha-beta model, {pred['bandwidth_gbps']:.2f} Gbit/s",
        )
    ax.plot(w, [p["speedup"] for p in points], "o", color="#4c72b0", ms=8, label="measured")
    _workers_axis(ax, cw)
    ax.set_yscale("log", base=2)
    ax.set_ylabel("speedup S(W) = T1 / TW")
    ax.set_title("Speedup")
    ax.legend()
    return _png(fig)


def _chart_efficiency(report: Mapping[str, Any]) -> bytes:
    points = report["scaling"]
    curve = report["amdahl"]["curve"]
    fig = _figure()
    ax = fig.subplots()
    cw = [c["workers"] for c in curve]
    ax.axhline(1.0, ls="--", color="#999999", label="ideal E = 1")
    ax.plot(cw, [c["efficiency"] for c in curve], "-", color="#55a868", label="Amdahl fit")
    pred = report.get("prediction")
    if pred:
        pw = [p["workers"] for p in pred["points"]]
        cw = sorted({*cw, *pw})
        ax.plot(
            pw,
            [p["efficiency"] for p in pred["points"]],
            ":",
            marker=".",
            color="#dd5145",
            label=f"alpha-beta model, {pred['bandwidth_gbps']:.2f} Gbit/s",
        )
    ax.plot(
        [p["workers"] for p in points],
        [p["efficiency"] for p in points],
        "o",
        ms=8,
        color="#4c72b0",
        label="measured",
    )
    _workers_axis(ax, cw)
    ax.set_ylim(0, 1.1 * max(1.0, *(p["efficiency"] for p in points)))
    ax.set_ylabel("efficiency E(W) = S(W) / W")
    ax.set_title("Efficiency")
    ax.legend()
    return _png(fig)


def _chart_step_split(report: Mapping[str, Any]) -> bytes:
    runs = report["runs"]
    labels = [f"W = {r['workers']}" for r in runs]
    fig = _figure()
    ax = fig.subplots()
    bottom = [0.0] * len(runs)
    for part in PARTS:
        ms = [r["parts"][part] * 1e3 for r in runs]
        ax.bar(labels, ms, bottom=bottom, color=_PART_COLORS[part], label=PART_LABELS[part])
        bottom = [b + m for b, m in zip(bottom, ms, strict=True)]
    ax.set_ylabel("ms per step (mean over ranks)")
    ax.set_title("Step time split")
    ax.legend(fontsize="small")
    ax.grid(True, axis="y", alpha=0.3)
    return _png(fig)


def _chart_allreduce(report: Mapping[str, Any]) -> bytes:
    part = report["allreduce"]
    samples = part["samples"]
    n = [s["bytes"] for s in samples]
    fig = _figure()
    ax = fig.subplots()
    median = [s["seconds"] * 1e3 for s in samples]
    if all(s.get("p10_s") is not None and s.get("p90_s") is not None for s in samples):
        below = [m - s["p10_s"] * 1e3 for m, s in zip(median, samples, strict=True)]
        above = [s["p90_s"] * 1e3 - m for m, s in zip(median, samples, strict=True)]
        ax.errorbar(
            n,
            median,
            yerr=[below, above],
            fmt="o",
            color="#4c72b0",
            capsize=3,
            label="measured: median, 10th-90th percentile",
        )
    else:
        ax.plot(n, median, "o", color="#4c72b0", label="measured (median)")
    fit = part.get("fit")
    if fit:
        w = part["workers"]
        model = AlphaBetaFit(fit["alpha_s"], fit["bandwidth_bytes_per_s"], fit["max_rel_error"])
        lo, hi = min(n), max(n)
        xs = [lo * (hi / lo) ** (i / 60) for i in range(61)]
        ax.plot(
            xs,
            [model.time_s(x, w) * 1e3 for x in xs],
            "-",
            color="#dd5145",
            label=(
                f"fit: alpha = {fit['alpha_s'] * 1e6:.1f} us, "
                f"B = {fit['bandwidth_gbps']:.2f} Gbit/s"
            ),
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"message size (bytes, float32), W = {part['workers']}")
    ax.set_ylabel("allreduce time (ms)")
    ax.set_title("Allreduce (ring model: 2(W-1) alpha + 2(W-1)/W n/B)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _png(fig)


def render_charts(report: Mapping[str, Any]) -> dict[str, bytes]:
    """PNG bytes of every chart the report has data for, by chart name (see :data:`CHARTS`).

    Raises:
        ImportError: matplotlib is missing (the message says how to install it).
    """
    require_matplotlib()
    charts = {
        "throughput": _chart_throughput(report),
        "speedup": _chart_speedup(report),
        "efficiency": _chart_efficiency(report),
        "step_split": _chart_step_split(report),
    }
    if report.get("allreduce") and report["allreduce"].get("samples"):
        charts["allreduce"] = _chart_allreduce(report)
    return charts
