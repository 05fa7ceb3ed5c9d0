"""Warm pool vs cold start: SIGKILL -> first step after restart, and a fresh run's time to first
step, side by side with ``torchrun`` (issue 19).

For each world size, ``--repeats`` rounds; each round runs, in turn: a ringtrain run with the warm
pool (``ScalingConfig(warm_start=True)``, the default), one cold (``warm_start=False``), both
SIGKILLing their last rank right after the first DDP step, and ``torchrun`` doing one DDP step.
Reported (medians): time to first step of a fresh run (from the call, ``fit()`` or starting
``torchrun``, to the last rank's first step) and SIGKILL -> the last rank's first step of the
restarted attempt.

    python benchmarks/restart.py                       # W=2 and 4, 5 rounds
    python benchmarks/restart.py --workers 2 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import _restart_workload  # noqa: E402

import ringtrain as rt  # noqa: E402


def _times(out: str, attempt: int) -> list[float]:
    names = [n for n in os.listdir(out) if n.endswith(f".attempt{attempt}")]
    found = []
    for name in names:
        with open(os.path.join(out, name)) as f:
            found.append(float(f.read()))
    return found


def ringtrain_run(workers: int, warm: bool, storage: str) -> tuple[float, float]:
    """(time to first step, SIGKILL -> first step after restart), seconds."""
    out = tempfile.mkdtemp(dir=storage)
    t0 = time.time()
    rt.Trainer(
        _restart_workload.train_fn,
        rt.ScalingConfig(num_workers=workers, warm_start=warm),
        rt.RunConfig(
            name=os.path.basename(out),
            storage_path=storage,
            progress="off",
            failure_config=rt.FailureConfig(max_failures=1),
        ),
        train_loop_config={"out": out, "kill": True},
    ).fit()
    with open(os.path.join(out, "killed")) as f:
        killed = float(f.read())
    return max(_times(out, 0)) - t0, max(_times(out, 1)) - killed


def torchrun(workers: int, storage: str) -> float:
    out = tempfile.mkdtemp(dir=storage)
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={workers}",
         "--standalone", os.path.join(HERE, "_restart_workload.py"), out],
        check=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    done = _times(out, 0)  # a failed torchrun round (it happens under load) is left out
    return max(done) - t0 if len(done) == workers else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{'W':>2} {'measure':<28} {'warm':>7} {'cold':>7} {'torchrun':>8} {'warm/cold':>9}")
    for w in args.workers:
        got: dict[str, list[float]] = {k: [] for k in ("wf", "wr", "cf", "cr", "tr")}
        with tempfile.TemporaryDirectory() as storage:
            for _ in range(args.repeats):
                first, restart = ringtrain_run(w, True, storage)
                got["wf"].append(first)
                got["wr"].append(restart)
                first, restart = ringtrain_run(w, False, storage)
                got["cf"].append(first)
                got["cr"].append(restart)
                got["tr"].append(torchrun(w, storage))
        got["tr"] = [t for t in got["tr"] if t == t] or [float("nan")]
        med = {k: statistics.median(v) for k, v in got.items()}
        print(
            f"{w:>2} {'fresh run -> first step (s)':<28} {med['wf']:7.2f} {med['cf']:7.2f} "
            f"{med['tr']:8.2f} {med['wf'] / med['cf']:9.2f}"
        )
        print(
            f"{w:>2} {'SIGKILL -> first step (s)':<28} {med['wr']:7.2f} {med['cr']:7.2f} "
            f"{'':>8} {med['wr'] / med['cr']:9.2f}"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
