"""The scaling report's files: ``scaling.json``, ``scaling.html`` and its PNG charts.

:func:`build_report` turns measurements into one JSON-able dict (every number the report shows);
:func:`write_report` writes that dict as ``scaling.json``, draws the charts from it with
matplotlib (Agg, no display needed) as PNG files next to it, and writes ``scaling.html``, a
single page with the charts embedded as base64 PNG: it renders offline, on its own.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.bench.analysis import (
    PART_LABELS,
    PARTS,
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

__all__ = ["MATPLOTLIB_HINT", "build_report", "require_matplotlib", "write_report"]

MATPLOTLIB_HINT = (
    "the scaling report draws its charts with matplotlib, which is not installed: "
    "pip install 'ringtrain[bench]'"
)

DEFINITION = (
    "Weak scaling: every worker keeps its batch size, so W workers process W times the samples "
    "per step. throughput(W) = global samples per second = the sum over ranks of each rank's "
    "samples divided by the seconds its timed steps took (warm-up steps left out). "
    f"T_W = N / throughput(W) is the time to process a fixed number of samples (N = "
    f"{REFERENCE_SAMPLES:,} here), so the speedup S(W) = T_1 / T_W = throughput(W) / "
    "throughput(1) and the efficiency E(W) = S(W) / W."
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


def require_matplotlib() -> None:
    """Raise if matplotlib cannot be imported.

    Raises:
        ImportError: with the message :data:`MATPLOTLIB_HINT`.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(MATPLOTLIB_HINT) from exc


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
# Charts
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def write_report(report: Mapping[str, Any], out_dir: str) -> dict[str, str]:
    """Write ``scaling.json``, one PNG per chart and ``scaling.html`` into ``out_dir``.

    Args:
        report: the dict from :func:`build_report`.
        out_dir: a local directory (created if missing).

    Returns:
        File kind (``json``, ``html`` and each chart name) -> absolute path written.

    Raises:
        ImportError: matplotlib is missing.
        OSError: ``out_dir`` cannot be written.
    """
    charts = render_charts(report)
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


def _e(value: Any) -> str:
    return html.escape(str(value))


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


_CSS = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; line-height: 1.45; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.2rem; margin-top: 2rem; }
table { border-collapse: collapse; margin: 0.5rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.25rem 0.5rem; text-align: right; }
td { white-space: nowrap; }
th { background: #f3f3f3; font-weight: 600; } td:first-child, th:first-child { text-align: left; }
.conclusions li:first-child { font-weight: bold; }
.meta { color: #555; font-size: 0.9rem; } code { background: #f3f3f3; padding: 0 0.2rem; }
figure { margin: 1rem 0; } figcaption { color: #555; font-size: 0.9rem; }
img { max-width: 100%; border: 1px solid #eee; }
"""


def render_html(report: Mapping[str, Any], charts: Mapping[str, bytes]) -> str:
    """The report as one self-contained HTML page (charts embedded as base64 PNG).

    Args:
        report: the dict from :func:`build_report`.
        charts: PNG bytes by chart name, from :func:`render_charts`.

    Returns:
        The HTML text.
    """
    parts: list[str] = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>ringtrain scaling report</title>",
        f"<style>{_CSS}</style></head><body>",
        "<h1>Scaling report</h1>",
    ]
    meta_rows = [
        (label, report[key])
        for key, label in (
            ("command", "Command"),
            ("date", "Date"),
            ("script", "Script"),
            ("steps", "Steps per run"),
            ("threads_per_worker", "Torch threads per worker (every W)"),
            ("machine", "Machine"),
            ("ringtrain_version", "ringtrain"),
        )
        if report.get(key) not in (None, "")
    ]
    if meta_rows:
        parts.append('<div class="meta">')
        parts.extend(f"<div><b>{_e(k)}:</b> <code>{_e(v)}</code></div>" for k, v in meta_rows)
        parts.append("</div>")

    parts.append("<h2>What limits scaling</h2><ul class='conclusions'>")
    parts.extend(f"<li>{_e(s)}</li>" for s in report["conclusions"])
    parts.append("</ul>")

    parts.append("<h2>Measured</h2>")
    parts.append(f"<p>{_e(report['definition'])}</p>")
    runs = {r["workers"]: r for r in report["runs"]}
    rows = []
    for p in report["scaling"]:
        r = runs[p["workers"]]
        rows.append(
            (
                p["workers"],
                f"{p['throughput']:.1f}",
                f"{p['time_s']:.3f}",
                f"{p['speedup']:.3f}",
                f"{p['efficiency']:.1%}",
                _ms(r["step_s"]),
                f"{r['steps']} (+{r['warmup_steps']} warm-up)",
            )
        )
    parts.append(
        _table(
            (
                "W",
                "samples/s",
                f"T_W (s, {report['reference_samples']:,} samples)",
                "S(W)",
                "E(W)",
                "step (ms)",
                "steps measured per rank",
            ),
            rows,
        )
    )
    parts.append(
        "<p>Where the step goes, in ms per step (mean over ranks) and share of the step. "
        "Compute is forward + backward; exposed communication is the allreduce time not hidden "
        "behind the backward pass (including waits for slower peers); total communication "
        "counts the hidden part too.</p>"
    )
    split_rows = []
    for r in report["runs"]:
        split_rows.append(
            (
                r["workers"],
                *(f"{_ms(r['parts'][part])} ({r['shares'][part]:.0%})" for part in PARTS),
                _ms(r["step_s"]),
                _ms(r["comm_s"]),
                f"{r['comm_bytes'] / 1e6:.3f}",
            )
        )
    parts.append(
        _table(
            (
                "W",
                *(PART_LABELS[p] for p in PARTS),
                "step",
                "communication, total",
                "MB allreduced per step",
            ),
            split_rows,
        )
    )
    amdahl = report["amdahl"]
    parts.append(
        f"<p>Amdahl fit S(W) = 1 / ((1 - p) + p / W): <b>p = {amdahl['p']:.4f}</b> "
        f"(RMS error of S: {amdahl['rmse']:.4f}"
        + ("; the best p lay outside [0, 1] and was clamped" if amdahl["clamped"] else "")
        + "). Amdahl's law describes a fixed total amount of work; here it summarises how far "
        "the measured speedups fall short of W.</p>"
    )

    part = report.get("allreduce")
    if part:
        parts.append("<h2>Allreduce (alpha-beta model)</h2>")
        fit = part.get("fit")
        if fit:
            parts.append(
                f"<p>Fitted at W = {part['workers']} to t(n, W) = 2(W-1)&middot;alpha + "
                f"2(W-1)/W &middot; n/B: <b>alpha = {fit['alpha_s'] * 1e6:.2f} us</b>, "
                f"<b>B = {fit['bandwidth_gbps']:.3f} Gbit/s</b> "
                f"({fit['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s); the largest relative error "
                f"of the fit is {fit['max_rel_error']:.0%}.</p>"
            )
        elif part.get("error"):
            parts.append(f"<p>No fit: {_e(part['error'])}</p>")
        model = AlphaBetaFit(fit["alpha_s"], fit["bandwidth_bytes_per_s"], 0.0) if fit else None
        parts.append(
            _table(
                ("bytes", "median time (ms)", "10th-90th percentile (ms)", "model (ms)"),
                [
                    (
                        f"{s['bytes']:,}",
                        f"{s['seconds'] * 1e3:.3f}",
                        f"{s['p10_s'] * 1e3:.3f} - {s['p90_s'] * 1e3:.3f}"
                        if s.get("p10_s") is not None and s.get("p90_s") is not None
                        else "-",
                        f"{model.time_s(s['bytes'], s['workers']) * 1e3:.3f}" if model else "-",
                    )
                    for s in part["samples"]
                ],
            )
        )
        check = part.get("check")
        if check:
            parts.append(
                f"<p>Check: at W = {check['workers']} a step allreduced "
                f"{check['comm_bytes'] / 1e6:.3f} MB; the model gives "
                f"{_ms(check['model_s'])} ms for one allreduce of that size, the training run "
                f"measured {_ms(check['measured_comm_s'])} ms of communication per step "
                "(several buckets, overlapped with backward, including waits for slower "
                "peers).</p>"
            )

    pred = report.get("prediction")
    if pred:
        parts.append("<h2>Predicted efficiency at larger W</h2>")
        parts.append(
            f"<p>Bandwidth {pred['bandwidth_gbps']:.3f} Gbit/s ({_e(pred['bandwidth_source'])}),"
            f" {pred['comm_bytes'] / 1e6:.3f} MB allreduced per step, "
            f"{pred['exposed_ratio']:.0%} of it exposed, busy step {_ms(pred['busy_s'])} ms. "
            "E(W) = step(1) / step(W), step(W) = busy step + exposed modelled allreduce.</p>"
        )
        parts.append(
            _table(
                ("W", "allreduce (ms)", "exposed (ms)", "step (ms)", "E(W)", "S(W)"),
                [
                    (
                        p["workers"],
                        _ms(p["allreduce_s"]),
                        _ms(p["comm_exposed_s"]),
                        _ms(p["step_s"]),
                        f"{p['efficiency']:.1%}",
                        f"{p['speedup']:.2f}",
                    )
                    for p in pred["points"]
                ],
            )
        )
        parts.append("<p>Assumptions:</p><ul>")
        parts.extend(f"<li>{_e(a)}</li>" for a in pred["assumptions"])
        parts.append("</ul>")

    parts.append("<h2>Charts</h2>")
    for name, title in CHARTS.items():
        png = charts.get(name)
        if png is None:
            continue
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure id="{name}"><img alt="{_e(title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(title)} ({_e(name)}.png)</figcaption></figure>"
        )

    run_dirs = report.get("run_dirs")
    notes = report.get("notes") or []
    if run_dirs or notes:
        parts.append("<h2>Runs and notes</h2><ul>")
        if isinstance(run_dirs, Mapping):
            parts.extend(
                f"<li>{_e(k)}: <code>{_e(v)}</code></li>" for k, v in sorted(run_dirs.items())
            )
        parts.extend(f"<li>{_e(n)}</li>" for n in notes)
        parts.append("</ul>")
    parts.append("</body></html>\n")
    return "\n".join(parts)
