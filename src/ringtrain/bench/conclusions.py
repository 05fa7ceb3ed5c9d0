"""What limits scaling, in words: the sentences of the report from the measured parts, the
Amdahl fit and the alpha-beta prediction."""

from __future__ import annotations

from collections.abc import Sequence

from ringtrain.bench.comm_model import AlphaBetaFit, Prediction
from ringtrain.bench.core import (
    NOTABLE_SHARE,
    PART_LABELS,
    BenchError,
    fmt_bytes,
)
from ringtrain.bench.scaling import scaling_points
from ringtrain.bench.windows import RunTiming
from ringtrain.monitor.timing import PARTS


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
                    f"(to ~{_pct(after)} of the step): at {fmt_bytes(big.comm_bytes)} per step "
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
                f"{big.comm_s / alone:.1f}x what the allreduce of its {fmt_bytes(big.comm_bytes)} "
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
