r"""Training over slow links: DDP against DiLoCo and streaming DiLoCo on three hosts whose links
carry 10 Mbit/s (docs/slow-links.md; docs/benchmarks.md, "Training over slow links (DiLoCo)").

The hosts are network namespaces on a private bridge (:mod:`ringtrain.testing.netbed`, root
only), each link limited both ways by a token bucket; one rank runs on each host, started with
torchrun's variables, and the ranks talk over the bed's network (gloo). Every run trains the
character-level GPT of ``examples/gpt.py`` (a smaller configuration: 4 layers, 64 channels,
context 64, 0.22 M parameters) with the same inner optimizer (AdamW, lr 3e-3, betas 0.9/0.95,
warm-up then cosine over ``--steps``, clipping at 1.0), the same batch (16 windows per rank per
step) and the same seed, so the same number of samples per inner step; the runs ``diloco`` and
``streaming`` go on for ``--extra`` times as many steps (the LR held at its floor after
``--steps``) so that the time at which they reach DDP's final validation loss is seen even when
they reach it late.

Measured (``benchmarks/_diloco_worker.py`` writes one JSON line per evaluation and rank):

* **time to DDP's final validation loss**: training seconds (evaluation left out) until a run's
  validation loss first is at most DDP's loss after ``--steps`` steps, linearly interpolated
  between evaluations; the speed-up is DDP's time over the run's;
* **validation loss at equal samples**: after ``--steps`` inner steps, against DDP's;
* **bytes on the wire per inner step**: what each host sent on its link during training
  (``/proc/net/dev``, TCP/IP headers included), averaged over hosts, over ``--steps`` steps;
* **peak bytes per exchange** (DiLoCo): the largest single outer exchange of one rank (what a
  link must carry within one sync window), from the outer loop's own count.

Writes ``OUT_DIR/results.json`` and a figure (validation loss against training seconds and
against samples) to ``--figure``; prints a Markdown table.

Usage (as root; the figures in docs/benchmarks.md)::

    python benchmarks/diloco.py --steps 200 --sync-every 50 --fragments 4 --delay 5 \
        --eval-every 25 --out-dir /tmp/dl41full --figure docs/diloco-slow-links.svg
    python benchmarks/diloco.py --steps 200 --sync-every 10 --fragments 4 --delay 1 \
        --eval-every 20 --extra 1.25 --runs diloco,streaming --baseline /tmp/dl41full \
        --out-dir /tmp/dl41h10 --figure docs/diloco-slow-links-h10.svg
    python benchmarks/diloco.py --steps 200 --sync-every 50 --eval-every 25 \
        --runs diloco,diloco-cut --cut-after 50 --cut-for-s 30 --baseline /tmp/dl41full \
        --out-dir /tmp/dl41cut
    python benchmarks/diloco.py --steps 20 --sync-every 10 --runs ddp,diloco   # a quick look
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ringtrain.testing.netbed import NetBed, unavailable

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "_diloco_worker.py")

RUNS: dict[str, list[str]] = {
    "ddp": ["--mode", "ddp"],
    "diloco": ["--mode", "diloco"],
    "diloco-bf16": ["--mode", "diloco", "--outer-dtype", "bf16"],
    "diloco-int8": ["--mode", "diloco", "--outer-dtype", "int8"],
    "streaming": ["--mode", "diloco", "--fragments", "{fragments}", "--sync-delay", "{delay}"],
    "streaming-int8": [
        "--mode",
        "diloco",
        "--fragments",
        "{fragments}",
        "--sync-delay",
        "{delay}",
        "--outer-dtype",
        "int8",
    ],
}
RUNS["diloco-cut"] = RUNS["diloco"]
"""The runs (``--runs`` picks some); ``{fragments}``/``{delay}`` are ``--fragments``/``--delay``.
``diloco-cut`` is ``diloco`` with the last host's link cut (:func:`cut_link`)."""


def cut_link(bed: NetBed, out: Path, after_step: int, for_s: float, log: dict[str, Any]) -> None:
    """Once the last host's rank has recorded step ``after_step``, cut its link for ``for_s``
    seconds, then heal it; ``log`` gets the step and the seconds the cut lasted."""
    host = bed.hosts[-1]
    rows = Path(f"{out}.{len(bed.hosts) - 1}.jsonl")
    while True:
        if rows.exists():
            seen = [json.loads(line) for line in rows.read_text().splitlines() if line]
            if seen and seen[-1]["step"] >= after_step:
                break
        time.sleep(0.2)
    began = time.monotonic()
    bed.cut(host)
    try:
        time.sleep(for_s)
    finally:
        bed.heal(host)
    log.update(cut_at_step=seen[-1]["step"], cut_s=time.monotonic() - began, host=host.name)


def launch(bed: NetBed, name: str, argv: list[str], out: Path, port: int, timeout_s: float) -> None:
    """One rank per host of ``bed`` running the worker with ``argv``; wait for all of them.

    Raises:
        RuntimeError: a rank failed or ran past ``timeout_s`` (its output is in the message).
    """
    procs = []
    world = len(bed.hosts)
    for rank, host in enumerate(bed.hosts):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank),
            MASTER_ADDR=bed.hosts[0].address,
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        log = open(out.parent / f"{name}.{rank}.log", "w")  # noqa: SIM115
        cmd = [sys.executable, WORKER, *argv, "--out", str(out), "--storage-path", str(out.parent)]
        procs.append((bed.popen(host, cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    failed = []
    for rank, (proc, log) in enumerate(procs):
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        if rc != 0:
            failed.append(rank)
    if failed:
        tail = (out.parent / f"{name}.{failed[0]}.log").read_text()[-3000:]
        raise RuntimeError(f"run {name}: ranks {failed} failed; rank {failed[0]}:\n{tail}")


def load(out: Path, world: int) -> list[list[dict[str, Any]]]:
    """Each rank's evaluation rows."""
    return [
        [json.loads(line) for line in Path(f"{out}.{r}.jsonl").read_text().splitlines()]
        for r in range(world)
    ]


def time_to(rows: list[dict[str, Any]], target: float) -> float | None:
    """Training seconds at which the validation loss first reaches ``target`` (interpolated
    linearly between evaluations), or ``None``."""
    for prev, row in itertools.pairwise(rows):
        if row["val_loss"] <= target:
            drop = prev["val_loss"] - row["val_loss"]
            frac = 1.0 if drop <= 0 else (prev["val_loss"] - target) / drop
            return float(prev["train_s"] + frac * (row["train_s"] - prev["train_s"]))
    return None


def summarize(per_rank: dict[str, list[list[dict[str, Any]]]], steps: int) -> dict[str, Any]:
    """The figures of every run (see the module's docstring)."""
    curves = {
        name: [
            {**row, "train_s": max(r[i]["train_s"] for r in ranks)}
            for i, row in enumerate(ranks[0])
        ]
        for name, ranks in per_rank.items()
    }
    ddp = curves.get("ddp")
    target = _at(ddp, steps)["val_loss"] if ddp else None
    ddp_time = _at(ddp, steps)["train_s"] if ddp else None
    runs = {}
    for name, ranks in per_rank.items():
        at = [_at(r, steps) for r in ranks]
        fig: dict[str, Any] = {
            "val_loss": at[0]["val_loss"],
            "train_s": max(a["train_s"] for a in at),
            "wire_bytes_per_step": sum(a["tx_bytes"] for a in at) / len(at) / steps,
            # with evaluation: a stall in an evaluation's all-reduce (a cut link) counts here
            "wall_s": max(
                a["train_s"] + sum(row["eval_s"] for row in r if row["step"] <= steps)
                for a, r in zip(at, ranks, strict=True)
            ),
        }
        if "peak_bytes" in at[0]:
            fig["peak_bytes"] = max(a["peak_bytes"] for a in at)
            fig["exchanges"] = at[0]["exchanges"]
            fig["sync_bytes_per_step"] = sum(a["sync_bytes"] for a in at) / len(at) / steps
        if target is not None and ddp_time is not None:
            fig["loss_vs_ddp"] = fig["val_loss"] / target - 1.0
            reached = time_to(curves[name], target)
            fig["time_to_ddp_loss_s"] = reached
            fig["speedup"] = None if not reached else ddp_time / reached
        runs[name] = fig
    if "ddp" in runs:
        base = runs["ddp"]["wire_bytes_per_step"]
        for fig in runs.values():
            fig["wire_reduction"] = base / fig["wire_bytes_per_step"]
    if "diloco" in runs:
        for fig in runs.values():
            if "peak_bytes" in fig:
                fig["peak_reduction"] = runs["diloco"]["peak_bytes"] / fig["peak_bytes"]
    return {"target_loss": target, "runs": runs, "curves": curves}


def _at(rows: list[dict[str, Any]] | None, step: int) -> dict[str, Any]:
    assert rows is not None
    return next(r for r in rows if r["step"] == step)


def plot(summary: dict[str, Any], path: str, title: str) -> None:
    """Validation loss against training seconds and against samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "ringtrain"  # the same figure gives the same file
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in summary["curves"].items():
        t = [r["train_s"] for r in rows]
        left.plot(t, [r["val_loss"] for r in rows], marker=".", label=name)
        right.plot([r["samples"] for r in rows], [r["val_loss"] for r in rows], marker=".")
    if summary["target_loss"] is not None:
        for ax in (left, right):
            ax.axhline(summary["target_loss"], color="grey", lw=0.8, ls="--")
    left.set_xlabel("training time (s, evaluation left out)")
    right.set_xlabel("samples (windows of 64 bytes, all replicas)")
    for ax in (left, right):
        ax.set_ylabel("validation loss (nats/byte)")
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| run | val loss @ equal samples | vs DDP | time to DDP's loss (s) | speed-up | "
        "wire bytes / inner step / host | fewer than DDP | peak bytes / exchange | "
        "peak lower than diloco |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, f in summary["runs"].items():
        tt = f.get("time_to_ddp_loss_s")
        sp = f.get("speedup")
        peak = f.get("peak_bytes")
        lines.append(
            f"| {name} | {f['val_loss']:.4f} | {f.get('loss_vs_ddp', 0.0):+.2%} | "
            f"{'not reached' if tt is None else f'{tt:.1f}'} | "
            f"{'-' if sp is None else f'{sp:.1f}x'} | {f['wire_bytes_per_step']:,.0f} | "
            f"{f.get('wire_reduction', 1.0):.1f}x | {'-' if peak is None else f'{peak:,}'} | "
            f"{f.get('peak_reduction', float('nan')):.2f}x |".replace("nanx", "-")
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {list(RUNS)}")
    p.add_argument("--steps", type=int, default=300, help="inner steps of DDP (equal samples)")
    p.add_argument(
        "--extra", type=float, default=1.5, help="steps / --steps of the runs diloco, streaming"
    )
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--delay", type=int, default=5, help="streaming's sync_delay")
    p.add_argument("--eval-every", type=int, default=None, help="default: --sync-every")
    p.add_argument("--hosts", type=int, default=3)
    p.add_argument("--rate-mbit", type=float, default=10.0)
    p.add_argument("--out-dir", default=None, help="default: a new temporary directory")
    p.add_argument("--figure", default=None, help="an .svg or .png to write")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    p.add_argument("--cut-after", type=int, default=50, help="diloco-cut: cut after this step")
    p.add_argument("--cut-for-s", type=float, default=30.0, help="diloco-cut: for this long")
    p.add_argument(
        "--baseline",
        default=None,
        help="an earlier --out-dir whose ddp run (same --steps) to compare with instead of "
        "running ddp again",
    )
    args = p.parse_args()
    why = unavailable()
    if why is not None:
        sys.exit(f"benchmarks/diloco.py needs a network test bed: {why}")
    names = [n for n in args.runs.split(",") if n]
    unknown = set(names) - set(RUNS)
    if unknown:
        sys.exit(f"--runs: unknown {sorted(unknown)}; choose from {list(RUNS)}")
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="diloco-bench-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    every = args.eval_every or args.sync_every
    extra = math.ceil(args.steps * args.extra / args.sync_every) * args.sync_every
    per_rank, cuts = {}, {}
    # A SIGTERM (or a timeout's kill of the whole job) still tears the bed down.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("benchmarks/diloco.py: terminated"))
    # self_resolves="address": each host's name resolves to its bed address, as on a machine
    # whose /etc/hosts is set up for a cluster; torchrun's variables bypass ringtrain's own
    # interface choice (ringtrain.cluster.netif), which this benchmark does not measure.
    with NetBed(hosts=args.hosts, rate_mbit=args.rate_mbit, self_resolves="address") as bed:
        for i, name in enumerate(names):
            argv = [a.format(fragments=args.fragments, delay=args.delay) for a in RUNS[name]]
            steps = extra if name in ("diloco", "streaming") else args.steps
            if name == "diloco-cut":
                steps = extra if "diloco" not in names else args.steps
            argv += ["--steps", str(steps), "--horizon", str(args.steps)]
            argv += ["--eval-every", str(every), "--sync-every", str(args.sync_every)]
            out = out_dir / name
            began = time.monotonic()
            cut: dict[str, Any] = {}
            if name == "diloco-cut":
                threading.Thread(
                    target=cut_link,
                    args=(bed, out, args.cut_after, args.cut_for_s, cut),
                    daemon=True,
                ).start()
            launch(bed, name, argv, out, 29500 + i, args.timeout_s)
            if cut:
                cuts[name] = cut
            print(f"{name}: {time.monotonic() - began:.0f} s", flush=True)
            per_rank[name] = load(out, args.hosts)
    if args.baseline and "ddp" not in per_rank:
        per_rank = {"ddp": load(Path(args.baseline) / "ddp", args.hosts), **per_rank}
    summary = summarize(per_rank, args.steps)
    summary["args"] = vars(args)
    summary["cuts"] = cuts
    if cuts:
        print(f"cuts: {cuts}")
    (out_dir / "results.json").write_text(json.dumps(summary, indent=1))
    print(table(summary))
    print(f"results: {out_dir / 'results.json'}")
    if args.figure:
        plot(summary, args.figure, figure_title(args))
        print(f"figure: {args.figure}")


def figure_title(args: argparse.Namespace) -> str:
    return (
        f"GPT 0.22 M params, {args.hosts} hosts at {args.rate_mbit:g} Mbit/s, "
        f"H={args.sync_every}, streaming F={args.fragments} tau={args.delay}"
    )


if __name__ == "__main__":
    main()
