"""``ringtrain bench``: the scaling report's analysis on synthetic measurements (the real command
on a tiny script: tests/e2e/test_bench_cli.py)."""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from rich.console import Console

from ringtrain import cli
from ringtrain.bench.analysis import (
    PARTS,
    AllreduceSample,
    AlphaBetaFit,
    BenchError,
    RunTiming,
    aggregate_windows,
    conclusions,
    fit_alpha_beta,
    fit_amdahl,
    predict_efficiency,
    scaling_points,
)
from ringtrain.bench.report import build_report, render_html, write_report
from ringtrain.bench.runner import (
    _print_summary,
    amdahl_line,
    load_timing_windows,
    outer_line,
    parse_workers,
)
from ringtrain.monitor.timing import StepLimitReached, StepTimer, warmup_steps

# --------------------------------------------------------------------------------------------
# Synthetic timing windows, as the workers send them (docs/run-directory.md, "timing")
# --------------------------------------------------------------------------------------------


def make_windows(
    workers: int,
    *,
    steps: int = 40,
    per_window: int = 5,
    batch: int = 32,
    parts: dict[str, float] | None = None,
    comm_s: float | None = None,
    comm_bytes: float = 0.0,
    warmup_factor: float = 5.0,
    rank_slowdown: Sequence[float] | None = None,
    outer_bytes: float | None = None,
) -> list[dict[str, Any]]:
    """Windows of ``per_window`` steps for every rank; the first window's steps are
    ``warmup_factor`` times slower (what a real first step looks like). ``outer_bytes``: a
    DiLoCo run's windows, sending that many bytes per inner step (as many times more in the
    first window) and spending ``other_s`` in outer syncs."""
    parts = dict(parts or {"data_s": 0.002, "compute_s": 0.010, "optimizer_s": 0.001})
    full = {p: float(parts.get(p, 0.0)) for p in PARTS}
    windows = []
    for rank in range(workers):
        slow = rank_slowdown[rank] if rank_slowdown else 1.0
        done = 0
        while done < steps:
            n = min(per_window, steps - done)
            done += n
            scale = slow * (warmup_factor if done == n else 1.0)
            w = {p: v * scale for p, v in full.items()}
            step = sum(w.values())
            windows.append(
                {
                    "rank": rank,
                    "attempt": 0,
                    "steps": n,
                    "step": done,
                    "step_s": step,
                    "step_s_mean": step,
                    **w,
                    "comm_s": full["comm_exposed_s"] if comm_s is None else comm_s,
                    "comm_bytes": comm_bytes,
                    "busy_s": step - w["comm_exposed_s"],
                    "samples": n * batch,
                    "samples_per_s": batch / step,
                    "window_s": n * step,
                }
            )
            if outer_bytes is not None:
                windows[-1] |= {
                    "outer_steps": done // 5,
                    "outer_bytes": outer_bytes * scale,
                    "outer_sync_s": n * w["other_s"],
                    "outer_sync_frac": w["other_s"] / step,
                    "outer_exchanges": 1,
                }
    return windows


def timing(workers: int, **kwargs: Any) -> RunTiming:
    return aggregate_windows(workers, make_windows(workers, **kwargs))


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------


def test_aggregate_leaves_out_warmup_and_sums_rank_throughput() -> None:
    run = timing(2, steps=40, per_window=5, batch=32)
    # 40 steps: warm-up = ceil(0.2 * 40) = 8 steps, so windows starting at steps 1 and 6 go.
    assert run.warmup_steps == 10
    assert run.steps == 30
    assert run.notes == ()
    assert run.step_s == pytest.approx(0.013)
    assert run.rank_throughput == pytest.approx((32 / 0.013, 32 / 0.013))
    assert run.throughput == pytest.approx(2 * 32 / 0.013)
    assert sum(run.parts.values()) == pytest.approx(run.step_s)
    assert run.parts["compute_s"] == pytest.approx(0.010)
    assert run.windows == 2 * 6


def test_a_diloco_runs_outer_loop_is_measured_after_the_warmup_and_reported(
    tmp_path: Any,
) -> None:
    parts = {**BASE, "other_s": 0.002}
    run = timing(2, parts=parts, outer_bytes=3000.0)  # 40 steps, 10 of them warm-up
    outer = run.outer
    assert outer is not None
    assert outer.bytes_per_step == pytest.approx(3000.0)  # the 5x warm-up window left out
    assert outer.sync_s_per_step == pytest.approx(0.002) and outer.steps == 30
    assert outer.sync_frac == pytest.approx(0.002 / run.step_s)
    assert (outer.outer_steps, outer.exchanges) == (8, 6)  # rank 0's count; its windows
    assert timing(2, parts=parts).outer is None  # not DiLoCo
    runs = [timing(1, parts=parts, outer_bytes=0.0), run]
    report = build_report(runs, allreduce_times(30e-6, 3e9, [2]))
    assert report["runs"][1]["outer"]["bytes_per_step"] == pytest.approx(3000.0)
    assert json.loads(json.dumps(report))["runs"][0]["outer"]["outer_steps"] == 8
    line = outer_line(report["runs"][1])
    assert line == (
        "DiLoCo at W=2: 3.00 KB sent per inner step, 2.00 ms per inner step in outer syncs "
        f"({0.002 / run.step_s:.1%} of the step), 8 outer steps"
    )
    assert outer_line(timing(2).to_dict()) is None
    console = Console(record=True, width=200)
    _print_summary(report, console)
    assert line in console.export_text()  # what `ringtrain bench` prints
    page = render_html(report, {})
    assert "KB sent per inner step" in page and "<td>3.000</td>" in page
    assert "sent per inner step" not in render_html(
        build_report([timing(1), timing(2)], allreduce_times(30e-6, 3e9, [2])), {}
    )


def test_aggregate_with_coarse_windows_keeps_what_it_can_and_says_so() -> None:
    # One window per rank holds every step: nothing can be left out.
    run = timing(1, steps=10, per_window=10, warmup_factor=1.0)
    assert run.steps == 10 and run.warmup_steps == 0
    assert run.notes and "too coarse" in run.notes[0]


def test_aggregate_slow_rank_counts_in_the_sum() -> None:
    run = timing(2, rank_slowdown=(1.0, 2.0))
    assert run.rank_throughput[1] == pytest.approx(run.rank_throughput[0] / 2)
    assert run.throughput == pytest.approx(sum(run.rank_throughput))


@pytest.mark.parametrize(
    ("workers", "windows", "match"),
    [
        (1, [], "no timing windows"),
        (2, make_windows(1), r"rank\(s\) \[1\]"),
        (1, make_windows(2), "beyond the world size"),
        (1, make_windows(1, steps=2, per_window=1), "all of them warm-up"),
        (1, [{**make_windows(1)[-1], "samples": "many"}], "'samples'"),
        (0, make_windows(1), "workers must be"),
    ],
)
def test_aggregate_bad_input_says_why(workers: int, windows: list[Any], match: str) -> None:
    with pytest.raises(BenchError, match=match):
        aggregate_windows(workers, windows)


# --------------------------------------------------------------------------------------------
# Speedup, efficiency, Amdahl
# --------------------------------------------------------------------------------------------


def test_speedup_and_efficiency_are_consistent() -> None:
    runs = [
        timing(4, parts={"compute_s": 0.010, "comm_exposed_s": 0.006}),
        timing(1, parts={"compute_s": 0.010}),
        timing(2, parts={"compute_s": 0.010, "comm_exposed_s": 0.004}),
    ]
    points = scaling_points(runs)
    assert [p.workers for p in points] == [1, 2, 4]
    assert points[0].speedup == 1.0 and points[0].efficiency == 1.0
    for p, run in zip(points, sorted(runs, key=lambda r: r.workers), strict=True):
        assert p.efficiency == pytest.approx(p.speedup / p.workers)
        assert p.speedup == pytest.approx(run.throughput / points[0].throughput)
        assert p.time_s == pytest.approx(points[0].time_s / p.speedup)
    # Weak scaling with a fixed per-worker batch: S(W) = W * step(1) / step(W).
    assert points[1].speedup == pytest.approx(2 * 0.010 / 0.014)
    assert points[2].efficiency == pytest.approx(0.010 / 0.016)


def test_scaling_needs_a_baseline() -> None:
    with pytest.raises(BenchError, match="no run at W = 1"):
        scaling_points([timing(2), timing(4)])
    with pytest.raises(BenchError, match="no runs"):
        scaling_points([])
    with pytest.raises(BenchError, match="more than one run"):
        scaling_points([timing(1), timing(1)])


@pytest.mark.parametrize("p", [0.0, 0.5, 0.93, 1.0])
def test_amdahl_recovers_p(p: float) -> None:
    workers = [1, 2, 4, 8, 16]
    speedups = [1.0 / ((1 - p) + p / w) for w in workers]
    fit = fit_amdahl(workers, speedups)
    assert fit.p == pytest.approx(p, abs=1e-6)
    assert fit.rmse == pytest.approx(0.0, abs=1e-6)
    assert fit.speedup(8) == pytest.approx(speedups[3], rel=1e-5)


def test_amdahl_one_point_is_exact_and_noise_is_tolerated() -> None:
    assert fit_amdahl([1, 2], [1.0, 1.6]).p == pytest.approx((1 - 1 / 1.6) / 0.5)
    rng = random.Random(0)
    workers = [2, 4, 8, 16, 32]
    speedups = [rng.uniform(0.98, 1.02) / (0.1 + 0.9 / w) for w in workers]
    assert fit_amdahl(workers, speedups).p == pytest.approx(0.9, abs=0.01)


def test_amdahl_clamps_and_rejects() -> None:
    slower = fit_amdahl([1, 2], [1.0, 0.8])  # W = 2 slower than W = 1
    assert slower.p == 0.0 and slower.clamped
    faster = fit_amdahl([2], [2.5])  # superlinear
    assert faster.p == 1.0 and faster.clamped
    with pytest.raises(BenchError, match="W >= 2"):
        fit_amdahl([1], [1.0])
    with pytest.raises(BenchError, match="> 0"):
        fit_amdahl([1, 2], [1.0, 0.0])


def test_amdahl_says_clamped_whenever_the_least_squares_p_is_outside_0_1() -> None:
    # W = 2 slower than W = 1, W = 4 barely faster: one point alone would give p > 0, but the
    # least-squares p is below 0, so the p = 0 shown is a bound, not a fit.
    mixed = fit_amdahl([1, 2, 4], [1.0, 0.8, 1.05])
    assert mixed.p == 0.0 and mixed.clamped
    superlinear = fit_amdahl([1, 2, 4], [1.0, 1.9, 4.5])
    assert superlinear.p == 1.0 and superlinear.clamped
    inside = fit_amdahl([1, 2, 4], [1.0, 1.5, 2.5])
    assert 0.0 < inside.p < 1.0 and not inside.clamped
    line = amdahl_line(mixed.to_dict())
    assert "p clamped to 0" in line and "do not fit Amdahl's law" in line, line
    assert "p clamped to 1" in amdahl_line(superlinear.to_dict())
    assert "clamped" not in amdahl_line(inside.to_dict())
    assert f"p = {inside.p:.4f}" in amdahl_line(inside.to_dict())


def test_step_timer_ends_a_window_at_the_documented_warmup() -> None:
    # 20 steps in one heartbeat interval: the warm-up (max(2, ceil(0.2 * 20)) = 4 steps) still
    # comes as a window of its own, so the bench measures the other 16.
    for max_steps, warm in ((20, 4), (5, 2), (50, 10)):
        assert warmup_steps(max_steps) == warm
        timer = StepTimer(max_steps=max_steps)
        with pytest.raises(StepLimitReached):
            while True:
                timer.loader_fetch_start()
                timer.loader_fetch_end(8)
        first, second = timer.take_window(), timer.take_window()
        assert first is not None and second is not None, max_steps
        assert (first["steps"], first["step"]) == (warm, warm)
        assert (second["steps"], second["step"]) == (max_steps - warm, max_steps)
        assert second["samples"] == 8 * (max_steps - warm)
        assert timer.take_window() is None
        run = aggregate_windows(1, [{"rank": 0, **first}, {"rank": 0, **second}])
        assert (run.steps, run.warmup_steps) == (max_steps - warm, warm)


# --------------------------------------------------------------------------------------------
# Alpha-beta model
# --------------------------------------------------------------------------------------------

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]


def allreduce_times(
    alpha: float, bandwidth: float, workers: Sequence[int], noise: float = 0.0, seed: int = 0
) -> list[AllreduceSample]:
    rng = random.Random(seed)
    model = AlphaBetaFit(alpha, bandwidth, 0.0)
    return [
        AllreduceSample(n, w, model.time_s(n, w) * (1 + rng.uniform(-noise, noise)))
        for w in workers
        for n in SIZES
    ]


@pytest.mark.parametrize("workers", [[2], [4], [2, 4, 8]])
def test_alpha_beta_recovers_alpha_and_bandwidth(workers: list[int]) -> None:
    fit = fit_alpha_beta(allreduce_times(25e-6, 5e9, workers))
    assert fit.alpha_s == pytest.approx(25e-6, rel=1e-6)
    assert fit.bandwidth == pytest.approx(5e9, rel=1e-6)
    assert fit.max_rel_error == pytest.approx(0.0, abs=1e-9)
    # The ring model: 2(W-1) latency hops and a 2(W-1)/W bandwidth factor.
    assert fit.time_s(1e6, 4) == pytest.approx(6 * 25e-6 + 1.5 * 1e6 / 5e9)


def test_alpha_beta_with_noise_and_zero_latency() -> None:
    fit = fit_alpha_beta(allreduce_times(40e-6, 2e9, [2, 4], noise=0.05, seed=3))
    assert fit.alpha_s == pytest.approx(40e-6, rel=0.15)
    assert fit.bandwidth == pytest.approx(2e9, rel=0.1)
    no_latency = fit_alpha_beta(allreduce_times(0.0, 1e9, [2], noise=0.02, seed=1))
    assert no_latency.alpha_s >= 0.0
    assert no_latency.bandwidth == pytest.approx(1e9, rel=0.05)


def test_alpha_beta_bad_input() -> None:
    with pytest.raises(BenchError, match="no allreduce"):
        fit_alpha_beta([])
    with pytest.raises(BenchError, match="W >= 2"):
        fit_alpha_beta([AllreduceSample(1024, 1, 1e-4), AllreduceSample(2048, 1, 2e-4)])
    with pytest.raises(BenchError, match="two message sizes"):
        fit_alpha_beta([AllreduceSample(1024, 2, 1e-4)])
    flat = [AllreduceSample(n, 2, 1e-3 * (1 - n / 1e8)) for n in SIZES]
    with pytest.raises(BenchError, match="do not grow"):
        fit_alpha_beta(flat)


def test_prediction_uses_busy_step_bytes_and_exposed_ratio() -> None:
    base = timing(1, parts={"compute_s": 0.010, "data_s": 0.002})
    two = timing(
        2,
        parts={"compute_s": 0.010, "data_s": 0.002, "comm_exposed_s": 0.003},
        comm_s=0.006,  # half of the communication hidden behind backward
        comm_bytes=4e6,
    )
    fit = AlphaBetaFit(alpha_s=20e-6, bandwidth=1e9, max_rel_error=0.0)
    pred = predict_efficiency([base, two], fit, workers=[8, 64])
    assert pred.busy_s == pytest.approx(0.012)
    assert pred.exposed_ratio == pytest.approx(0.5)
    assert pred.comm_bytes == pytest.approx(4e6)
    assert [p.workers for p in pred.points] == [1, 2, 8, 64]
    at8 = pred.points[2]
    allreduce = 14 * 20e-6 + 2 * 7 / 8 * 4e6 / 1e9
    assert at8.allreduce_s == pytest.approx(allreduce)
    assert at8.step_s == pytest.approx(0.012 + 0.5 * allreduce)
    assert at8.efficiency == pytest.approx(0.012 / at8.step_s)
    assert at8.speedup == pytest.approx(8 * at8.efficiency)
    assert pred.points[0].efficiency == 1.0
    # Efficiency falls with W; a faster stated network predicts better efficiency.
    assert pred.points[3].efficiency < at8.efficiency < 1.0
    fast = predict_efficiency([base, two], fit, workers=[64], bandwidth=100e9)
    assert fast.bandwidth_source == "stated"
    assert fast.points[-1].efficiency > pred.points[-1].efficiency
    assert any("alpha" in a for a in pred.assumptions)
    with pytest.raises(BenchError, match="W = 1"):
        predict_efficiency([two], fit)
    with pytest.raises(BenchError, match="W >= 2"):
        predict_efficiency([base], fit)


# --------------------------------------------------------------------------------------------
# Conclusions
# --------------------------------------------------------------------------------------------

BASE = {"data_s": 0.001, "compute_s": 0.010, "optimizer_s": 0.0005, "other_s": 0.0005}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"comm_exposed_s": 0.008}, "Communication is 40% of the step at W = 2"),
        ({"data_s": 0.006}, "Data loading is"),
        ({"optimizer_s": 0.005}, "The optimizer step is"),
        ({"other_s": 0.006}, "is outside data, compute, communication and the optimizer"),
        ({}, "The step is compute-bound"),
    ],
)
def test_conclusions_name_the_dominant_part(extra: dict[str, float], expected: str) -> None:
    base = timing(1, parts=BASE)
    two = timing(2, parts={**BASE, **extra}, comm_bytes=2e6 if extra else 0.0)
    sentences = conclusions([base, two])
    assert sentences[0].startswith(expected) or expected in sentences[0], sentences
    assert any("speedup S = " in s for s in sentences)


def test_conclusions_compression_halves_the_bandwidth_term() -> None:
    base = timing(1, parts=BASE)
    two = timing(2, parts={**BASE, "comm_exposed_s": 0.012}, comm_s=0.012, comm_bytes=8e6)
    # Bandwidth-bound (alpha = 0): half the bytes, half the exposed time.
    text = conclusions([base, two], AlphaBetaFit(0.0, 1e9, 0.0))[0]
    step = 0.012 + 0.012
    assert f"{0.012 / step:.0%} of the step" in text
    assert f"would cut it to ~{0.006 / (step - 0.006):.0%}" in text
    # Latency-bound: compression barely helps, and the sentence says so in that order.
    latency = conclusions([base, two], AlphaBetaFit(5e-3, 1e12, 0.0))[0]
    assert "would help little (to ~" in latency and "latency-bound" in latency, latency
    assert ": little" not in latency and "would cut it" not in latency, latency


def test_conclusions_flag_communication_slower_than_the_allreduce_alone() -> None:
    base = timing(1, parts=BASE)
    two = timing(2, parts={**BASE, "comm_exposed_s": 0.004}, comm_s=0.012, comm_bytes=1e6)
    fit = AlphaBetaFit(10e-6, 1e9, 0.0)  # 1 MB alone: 0.02 + 1.0 ms
    sentences = conclusions([base, two], fit)
    assert any("took 12.00 ms per step at W = 2, 11.8x what the allreduce" in s for s in sentences)
    fast = timing(2, parts={**BASE, "comm_exposed_s": 0.001}, comm_s=0.0015, comm_bytes=1e6)
    assert not any("what the allreduce" in s for s in conclusions([base, fast], fit))


def test_conclusions_report_compute_growth_and_prediction() -> None:
    base = timing(1, parts=BASE)
    two = timing(2, parts={**BASE, "compute_s": 0.018}, comm_bytes=1e6)
    fit = AlphaBetaFit(10e-6, 1e9, 0.0)
    pred = predict_efficiency([base, two], fit, workers=[64])
    sentences = conclusions([base, two], fit, cpu_count=2, prediction=pred)
    assert sentences[0].startswith("The step is compute-bound")
    assert "efficiency lost here (E = 60%) comes from the step growing" in sentences[0]
    assert any("Compute per step grew 1.80x" in s and "2 CPU cores" in s for s in sentences)
    assert any("+8.00 ms compute" in s for s in sentences)
    assert any("at W = 64" in s for s in sentences)
    with pytest.raises(BenchError, match="W >= 2"):
        conclusions([base])
    faster = timing(2, parts={**BASE, "compute_s": 0.005})
    assert any("Compute per step shrank 2.00x" in s for s in conclusions([base, faster]))


# --------------------------------------------------------------------------------------------
# Report files (synthetic data)
# --------------------------------------------------------------------------------------------


def test_report_files_from_synthetic_runs(tmp_path: Any) -> None:
    runs = [
        timing(1, parts=BASE),
        timing(2, parts={**BASE, "comm_exposed_s": 0.004}, comm_s=0.006, comm_bytes=2e6),
        timing(4, parts={**BASE, "comm_exposed_s": 0.006}, comm_s=0.008, comm_bytes=2e6),
    ]
    report = build_report(
        runs, allreduce_times(30e-6, 3e9, [4]), bandwidth=12.5e9, meta={"command": "x <y>"}
    )
    paths = write_report(report, str(tmp_path / "out"))
    data = json.loads((tmp_path / "out" / "scaling.json").read_text())
    assert data["command"] == "x <y>"
    assert data["allreduce"]["fit"]["alpha_s"] == pytest.approx(30e-6, rel=1e-6)
    assert data["prediction"]["bandwidth_gbps"] == pytest.approx(100.0)
    assert data["prediction"]["bandwidth_source"] == "stated"
    assert [p["workers"] for p in data["scaling"]] == [1, 2, 4]
    assert 0 < data["amdahl"]["p"] < 1
    for name in ("throughput", "speedup", "efficiency", "step_split", "allreduce"):
        with open(paths[name], "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "out" / "scaling.html").read_text()
    assert page.count("data:image/png;base64,") == 5
    assert "x &lt;y&gt;" in page  # escaped
    # Renders offline, on its own: no scripts, every image inline.
    assert "<script" not in page and not re.search(r'(src|href)="(?!data:)', page)
    assert data["conclusions"][0] in page.replace("&#x27;", "'")


def test_report_needs_w1_and_a_larger_w() -> None:
    with pytest.raises(BenchError, match="no run at W = 1"):
        build_report([timing(2), timing(4)], None)
    with pytest.raises(BenchError, match="W >= 2"):
        build_report([timing(1)], None)


def test_report_without_allreduce_fit_still_renders() -> None:
    runs = [timing(1), timing(2, parts={**BASE, "comm_exposed_s": 0.002}, comm_bytes=1e6)]
    flat = [AllreduceSample(n, 2, 1e-3) for n in SIZES]
    report = build_report(runs, flat)
    assert report["prediction"] is None
    assert "do not grow" in report["allreduce"]["error"]
    assert "No fit" in render_html(report, {})


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1,x", "'x' is not a whole number"),
        ("1,,2", "'' is not a whole number"),
        ("0,1,2", "must be >= 1, got 0"),
        ("-1,2", "must be >= 1, got -1"),
        ("2,4", "include 1"),
        ("1", "at least one count >= 2"),
        ("1,2,2", "2 is given twice"),
    ],
)
def test_bad_workers_error_clearly(text: str, message: str, capsys: Any, tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=message):
        parse_workers(text)
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", str(script), f"--workers={text}", "--steps", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --workers" in err and message in err


def test_parse_workers_sorts() -> None:
    assert parse_workers(" 4, 1,2 ") == (1, 2, 4)


def test_bench_cli_other_bad_arguments(capsys: Any, tmp_path: Any) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", str(tmp_path / "none.py"), "--workers", "1,2", "--steps", "0"])
    assert "--steps: must be >= 1" in capsys.readouterr().err
    assert cli.main(["bench", str(tmp_path / "none.py"), "--workers", "1,2"]) == 2
    assert "is not a file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", str(tmp_path / "none.py"), "--workers", "1,2", "--bandwidth-gbps", "0"])
    assert "must be a number > 0" in capsys.readouterr().err


def test_bench_without_matplotlib_writes_the_report_without_charts(
    monkeypatch: Any, tmp_path: Any
) -> None:
    """``ringtrain bench`` works on the base install (issue 40): without matplotlib (the
    ``bench`` extra) the report has every number, table and conclusion, and says that its
    charts need ``pip install 'ringtrain[bench]'``."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    runs = [timing(1), timing(2, parts={**BASE, "comm_exposed_s": 0.002}, comm_bytes=1e6)]
    report = build_report(runs, allreduce_times(30e-6, 3e9, [2]))
    paths = write_report(report, str(tmp_path / "out"))
    assert sorted(paths) == ["html", "json"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["scaling.html", "scaling.json"]
    page = (tmp_path / "out" / "scaling.html").read_text()
    assert "data:image/png" not in page
    assert "pip install &#x27;ringtrain[bench]&#x27;" in page
    assert json.loads((tmp_path / "out" / "scaling.json").read_text())["scaling"]


def test_load_timing_windows_reads_the_last_attempt(tmp_path: Any) -> None:
    events = [
        {"type": "run_start", "time": 1.0, "world_size": 1, "attempt": 0},
        {"type": "timing", "time": 2.0, "rank": 0, "attempt": 0, "steps": 3, "step": 3},
        {"type": "timing", "time": 3.0, "rank": 0, "attempt": 1, "steps": 4, "step": 4},
    ]
    text = "".join(json.dumps(e) + "\n" for e in events) + '{"type": "timi'  # truncated line
    (tmp_path / "events.jsonl").write_text(text)
    windows = load_timing_windows(str(tmp_path))
    assert [(w["rank"], w["attempt"], w["steps"]) for w in windows] == [(0, 1, 4)]
    with pytest.raises(BenchError, match=r"no events\.jsonl"):
        load_timing_windows(str(tmp_path / "missing"))
