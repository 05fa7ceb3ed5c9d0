"""Cost of ringtrain.horovod's metadata exchange (the check that turns an invalid call on any
rank into the same exception on every rank) in the steady state.

Every ``hvd.*`` collective first all-gathers a 10 + W int64 descriptor of the call (kind, name,
dtype, shape hash, op/root, duplicate-name flag) over the process set's group, then launches the
data collective. This measures ``hvd.allreduce_`` (in place: no clone) of a small tensor (16
float32, 64 bytes: latency-bound, where the extra round trip shows most) and of a 4 MiB tensor,
with the exchange (``check``) and without it (``nocheck``: ``runtime().check = False``, what the
call would cost if the check were free), plus raw ``dist.all_reduce`` as the floor.

Rounds alternate the variants (raw, check, nocheck, raw, ...) so that load drift hits all of them;
a round times ``--calls`` back-to-back calls after a barrier (the slowest rank's time), and each
figure is the median over ``--rounds`` rounds, per call. Ratio = check / nocheck.

Run::

    python benchmarks/hvd_negotiation.py                 # W=2, gloo
    python benchmarks/hvd_negotiation.py --rounds 5      # quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ringtrain as rt

SIZES = {"small_64B": 16, "4MiB": 1 << 20}


def probe(config):
    import torch
    import torch.distributed as dist

    import ringtrain.horovod as hvd
    from ringtrain.horovod.runtime import runtime

    hvd.init()
    rounds = int(config["rounds"])
    metrics: dict = {"world_size": hvd.size()}
    for label, numel in SIZES.items():
        t = torch.ones(numel)
        calls = int(config["calls"]) if numel < 1024 else max(3, int(config["calls"]) // 20)

        def raw(t=t):
            dist.all_reduce(t)

        def check(t=t):
            runtime().check = True
            hvd.allreduce_(t, op=hvd.Sum)

        def nocheck(t=t):
            runtime().check = False
            hvd.allreduce_(t, op=hvd.Sum)

        variants = {"raw": raw, "check": check, "nocheck": nocheck}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for fn in variants.values():  # warm-up
            for _ in range(3):
                fn()
        for _ in range(rounds):
            for key, fn in variants.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                elapsed = torch.tensor([(time.perf_counter() - start) / calls])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times[key].append(float(elapsed))
        runtime().check = True
        for key, values in times.items():
            metrics[f"{label}_{key}_us"] = statistics.median(values) * 1e6
        metrics[f"{label}_ratio"] = statistics.median(times["check"]) / statistics.median(
            times["nocheck"]
        )
    hvd.shutdown()
    rt.report(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = rt.Trainer(
            probe,
            rt.ScalingConfig(num_workers=args.workers),
            rt.RunConfig(name="hvd_negotiation", storage_path=tmp, progress="off"),
            train_loop_config={"rounds": args.rounds, "calls": args.calls},
        ).fit()
    m = result.metrics
    print(f"W={m['world_size']}, median per call over {args.rounds} rounds (microseconds)")
    print(f"{'tensor':<10} {'raw dist':>10} {'nocheck':>10} {'check':>10} {'check/nocheck':>14}")
    for label in SIZES:
        print(
            f"{label:<10} {m[f'{label}_raw_us']:>10.1f} {m[f'{label}_nocheck_us']:>10.1f} "
            f"{m[f'{label}_check_us']:>10.1f} {m[f'{label}_ratio']:>14.2f}"
        )


if __name__ == "__main__":
    main()
