"""Step time of ``hvd.DistributedOptimizer`` (ringtrain's fused asynchronous allreduce) vs DDP on
the same model and data, and the effect of fp16/bf16 compression on bytes and step time.

W workers (gloo on CPU) train an MLP of ``--layers`` square ``--width`` layers. In one job, the
variants run interleaved, ``--rounds`` times ``--steps`` steps each (after warm-up): DDP
(``bucket_cap_mb=25``), hvd none, hvd fp16, hvd bf16. A variant's step time is the median over
rounds of (slowest rank's time for ``--steps`` steps) / steps. Bytes on the wire are per rank per
step: the fused buffers' bytes for hvd, the gradients' bytes for DDP.

(b) target: hvd none / DDP <= 1.10. (c): bytes and step time with compression vs none.

Run::

    python benchmarks/comm_overlap.py                     # width 1024, 4 layers (16 MiB grads)
    python benchmarks/comm_overlap.py --width 512 --rounds 3 --steps 5    # quick
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import ringtrain as rt


def probe(config):
    import torch
    import torch.distributed as dist

    import ringtrain.horovod as hvd

    hvd.init()
    width, layers, batch = int(config["width"]), int(config["layers"]), int(config["batch"])
    steps, rounds = int(config["steps"]), int(config["rounds"])

    def make_model():
        torch.manual_seed(0)
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        return torch.nn.Sequential(*mods)

    g = torch.Generator().manual_seed(hvd.rank())
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    variants = {}
    ddp_model = torch.nn.parallel.DistributedDataParallel(make_model(), bucket_cap_mb=25)
    variants["ddp"] = (ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=1e-4))
    for name, comp in (
        ("hvd_none", hvd.Compression.none),
        ("hvd_fp16", hvd.Compression.fp16),
        ("hvd_bf16", hvd.Compression.bf16),
    ):
        model = make_model()
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-4),
            model.named_parameters(),
            compression=comp,
        )
        variants[name] = (model, opt)

    def run(model, opt, n):
        for _ in range(n):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    for model, opt in variants.values():
        run(model, opt, 2)
    times = {k: [] for k in variants}
    for _ in range(rounds):
        for name, (model, opt) in variants.items():
            dist.barrier()
            start = time.perf_counter()
            run(model, opt, steps)
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item() / steps)
    grad_bytes = sum(p.numel() * p.element_size() for p in ddp_model.parameters())
    metrics = {f"step_{k}": statistics.median(v) for k, v in times.items()}
    total_steps = 2 + rounds * steps
    for name, (_, opt) in variants.items():
        engine = getattr(opt, "_hvd_engine", None)
        metrics[f"bytes_{name}"] = (
            engine.bytes_on_wire / total_steps if engine is not None else grad_bytes
        )
        if engine is not None:
            metrics[f"buckets_{name}"] = len(engine.buckets)
    hvd.shutdown()
    rt.report(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = rt.Trainer(
            probe,
            rt.ScalingConfig(num_workers=args.workers),
            rt.RunConfig(name="overlap", storage_path=tmp, progress="off"),
            train_loop_config=vars(args),
        ).fit()
    m = result.metrics
    ddp = m["step_ddp"]
    print(
        f"W={args.workers} gloo, MLP {args.layers}x{args.width}, batch {args.batch}/rank, "
        f"median of {args.rounds} rounds x {args.steps} steps"
    )
    print(f"{'variant':>9} {'step ms':>8} {'vs DDP':>7} {'MB/step':>8} {'buckets':>7}")
    for name in ("ddp", "hvd_none", "hvd_fp16", "hvd_bf16"):
        step = m[f"step_{name}"]
        print(
            f"{name:>9} {step * 1e3:>8.2f} {step / ddp:>7.2f} "
            f"{m[f'bytes_{name}'] / 1e6:>8.2f} {m.get(f'buckets_{name}', '-')!s:>7}"
        )


if __name__ == "__main__":
    main()
