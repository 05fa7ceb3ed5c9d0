"""DDP communication hooks side by side: step time and bytes on the wire per step.

Trains the same ~10M-parameter MLP with ``prepare_model(comm_hook=None | "bf16" | "fp16" |
"powersgd")`` on W workers (gloo on CPU), and reports per hook the median step time over the
measured steps of each repeat, the median over repeats, its ratio to ``None``, and the bytes each
rank hands to allreduce per step (measured: the sizes of the tensors the Python hooks pass to
``torch.distributed.all_reduce``; for ``None``, DDP's C++ reducer allreduces every fp32
gradient once). PowerSGD is measured after its warm-up (``start_powerSGD_iter=2``).

    python benchmarks/ddp_hooks.py --workers 2 --width 2048 --steps 12 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ddp_hooks_workload import HOOKS, bench_fn

import ringtrain as rt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=2240, help="hidden width (2240: ~10M params)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {str(h): [] for h in HOOKS}
    params = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            result = rt.Trainer(
                bench_fn,
                rt.ScalingConfig(num_workers=args.workers),
                rt.RunConfig(name=f"hooks{i}", storage_path=tmp, progress="off"),
                train_loop_config=vars(args),
            ).fit()
            params = result.metrics["params"]
            for hook, r in json.loads(result.metrics["results"]).items():
                runs[hook].append(r)
    base = statistics.median(r["step_s"] for r in runs["None"])
    print(f"W={args.workers}, {params / 1e6:.1f}M parameters, median of {args.repeats} repeats")
    print(f"{'comm_hook':<10} {'step (ms)':>10} {'vs None':>8} {'wire MB/step':>13} {'vs None':>8}")
    base_wire = runs["None"][0]["wire_bytes"]
    for hook, rs in runs.items():
        step = statistics.median(r["step_s"] for r in rs)
        wire = statistics.median(r["wire_bytes"] for r in rs)
        print(
            f"{hook:<10} {step * 1e3:>10.1f} {step / base:>8.2f} {wire / 1e6:>13.2f} "
            f"{wire / base_wire:>8.3f}"
        )


if __name__ == "__main__":
    main()
