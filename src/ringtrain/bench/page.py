"""``scaling.html``: one self-contained page (charts embedded as base64 PNG) from the report
dict of :func:`~ringtrain.bench.report.build_report`."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.bench.analysis import (
    PART_LABELS,
    PARTS,
    AlphaBetaFit,
)
from ringtrain.bench.charts import CHARTS, NO_CHARTS


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
    outer_rows = [
        (
            r["workers"],
            f"{r['outer']['bytes_per_step'] / 1e3:.3f}",
            _ms(r["outer"]["sync_s_per_step"]),
            f"{r['outer']['sync_frac']:.1%}",
            r["outer"]["outer_steps"] if r["outer"]["outer_steps"] is not None else "-",
        )
        for r in report["runs"]
        if r.get("outer")
    ]
    if outer_rows:
        parts.append(
            "<p>DiLoCo's outer loop (mean over ranks, measured steps): the bytes its exchanges "
            "sent per inner step, and the time the training thread spent in outer syncs per "
            "inner step (outer gradients, exchanges, the outer step; counted in "
            "&ldquo;other&rdquo;) and its share of the step.</p>"
        )
        parts.append(
            _table(
                ("W", "KB sent per inner step", "outer sync (ms per step)", "share", "outer steps"),
                outer_rows,
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
    if not charts:
        parts.append(f"<p>{_e(NO_CHARTS)}</p>")
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
