"""FSDP vs DDP at W workers: per-rank memory, step time, and sharded vs rank-0 full checkpoints.

Both runs train the same GPT-style model (``examples/gpt.py``'s ``GPT``; ~100M parameters with
the defaults: 14 blocks of width 768) with AdamW on random tokens, through ``rt.Trainer``:

- memory per rank, after a training step: tensor bytes of parameters, gradients and optimizer
  state held by the rank (``ringtrain.parallel.fsdp.local_state_bytes``: a shard counts its local
  part), and the process's peak resident set size (``ru_maxrss``; includes the interpreter, torch,
  DDP's gradient buckets, activations and FSDP's all-gather buffers), after training and again at
  the end (then including the checkpoint experiments: staging, rank 0's full-state gather);
- step time: median over ``--steps`` timed steps (after one warm-up step), the slowest rank;
- checkpoints (FSDP run; ``--repeats`` times each, median, slowest rank):
  ``report``: ``rt.report(checkpoint=TrainState)`` written synchronously (DCP shards into a local
  temporary directory, copied and hashed into the run directory; DDP run: rank 0 writes the full
  ``train_state.pt``); ``dcp save``/``dcp load``: ``torch.distributed.checkpoint`` alone, every
  rank its shard (load reshards in general; here the same world size); ``full save``/``full
  load``: the rank-0 alternative: gather the full model and optimizer state on rank 0,
  ``torch.save``; load on rank 0 and broadcast (``broadcast_from_rank0``).

Run::

    python benchmarks/fsdp.py                         # ~100M parameters, W=2 (a few minutes)
    python benchmarks/fsdp.py --layers 2 --dim 256    # a quick check of the script
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringtrain as rt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from _gpt_args import gpt_arg_parser, gpt_config
from gpt import GPT, VOCAB, Block

MiB = 1024 * 1024


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn) -> float:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    fn()
    if dist.is_initialized():
        dist.barrier()
    return _max_over_ranks(time.perf_counter() - start)


def bench_fn(config: dict) -> None:
    from ringtrain.parallel.fsdp import local_state_bytes

    ctx = rt.get_context()
    torch.manual_seed(0)
    net = GPT(config["layers"], config["dim"], config["heads"], config["seq"])
    if config["strategy"] == "fsdp":
        model = rt.prepare_model(
            net, parallel_strategy="fsdp", fsdp_config=rt.FSDPConfig(shard_modules=[Block])
        )
    else:
        model = rt.prepare_model(net)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(ctx.world_rank)
    x = torch.randint(0, VOCAB, (config["batch"], config["seq"] + 1), generator=g)

    def step() -> None:
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: they count as memory
        loss.backward()
        optimizer.step()

    step()  # warm-up: allocates optimizer state and buffers
    times = [_timed(step) for _ in range(config["steps"])]
    mem = local_state_bytes(model, optimizer)
    metrics: dict = {
        "step_s": statistics.median(times),
        "params_MiB": mem["params"] / MiB,
        "grads_MiB": mem["grads"] / MiB,
        "optimizer_MiB": mem["optimizer"] / MiB,
        "tensors_MiB": mem["total"] / MiB,
        "n_params": sum(p.numel() for p in net.parameters()),
        # Peak RSS over model building and training only (before the checkpoint experiments,
        # whose rank-0 full-state gather would dominate it).
        "train_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    state = rt.TrainState(model=model, optimizer=optimizer)
    ckpt_times: dict[str, list[float]] = {"report": []}
    if config["strategy"] == "fsdp":
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from ringtrain.checkpoint import sharded

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        for name in ("dcp save", "dcp load", "full save", "full load"):
            ckpt_times[name] = []
        for repeat in range(config["repeats"]):
            holder: dict = {}
            # A fresh file each time: overwriting one that loaded tensors still map is a SIGBUS.
            full_path = os.path.join(config["tmp"], f"full_{repeat}.pt")

            def dcp_save(holder: dict = holder) -> None:
                directory, wait = sharded.save_to_local(
                    sharded.state_dict_of(model, optimizer), ctx.world_rank
                )
                wait()
                holder["dir"] = directory

            ckpt_times["dcp save"].append(_timed(dcp_save))
            # Every rank reads the shards of all ranks: give each the same directory.
            shared = [holder["dir"]]
            dist.broadcast_object_list(shared, src=0)
            if ctx.world_rank != 0:
                for name in os.listdir(holder["dir"]):
                    shutil.copy(os.path.join(holder["dir"], name), shared[0])
            dist.barrier()
            ckpt_times["dcp load"].append(
                _timed(lambda d=shared[0]: sharded.restore_objects(model, optimizer, d))
            )
            dist.barrier()
            shutil.rmtree(holder["dir"], ignore_errors=True)

            def full_save(full_path: str = full_path) -> None:
                msd = get_model_state_dict(model, options=full)
                osd = get_optimizer_state_dict(model, optimizer, options=full)
                if ctx.world_rank == 0:
                    torch.save({"model": msd, "optimizer": osd}, full_path)

            def full_load(full_path: str = full_path) -> None:
                opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
                loaded = (
                    torch.load(full_path, weights_only=True)
                    if ctx.world_rank == 0
                    else {"model": {}, "optimizer": {}}
                )
                set_model_state_dict(model, loaded["model"], options=opts)
                set_optimizer_state_dict(model, optimizer, loaded["optimizer"], options=opts)

            ckpt_times["full save"].append(_timed(full_save))
            ckpt_times["full load"].append(_timed(full_load))
    for _ in range(config["repeats"]):
        ckpt_times["report"].append(_timed(lambda: rt.report({}, checkpoint=state)))
    for name, values in ckpt_times.items():
        metrics[f"{name}_s"] = statistics.median(values)
    metrics["peak_rss_MiB"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rt.report(metrics)


def run(strategy: str, args: argparse.Namespace, storage: str) -> dict:
    config = {"strategy": strategy, **gpt_config(args), "repeats": args.repeats, "tmp": storage}
    result = rt.Trainer(
        bench_fn,
        rt.ScalingConfig(num_workers=args.workers),
        rt.RunConfig(
            name=f"bench-{strategy}",
            storage_path=storage,
            checkpoint_config=rt.CheckpointConfig(async_save=False, num_to_keep=1),
            progress="off",
        ),
        train_loop_config=config,
    ).fit()
    if result.error is not None:
        raise result.error
    return result.metrics_per_rank


def main() -> None:
    p = gpt_arg_parser(
        __doc__, workers=2, batch=2, steps=4, batch_help="sequences per rank per step"
    )
    p.add_argument("--repeats", type=int, default=2, help="repeats of each checkpoint timing")
    p.add_argument("--strategies", default="ddp,fsdp", help="comma-separated: ddp, fsdp")
    args = p.parse_args()
    storage = tempfile.mkdtemp(prefix="ringtrain_bench_fsdp_")
    try:
        per = {s: run(s, args, storage) for s in args.strategies.split(",")}
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    if len(per) < 2:
        print(per)
        return
    n = per["ddp"][0]["n_params"]
    print(f"\nFSDP vs DDP, W={args.workers}, {n / 1e6:.1f}M parameters, AdamW, fp32, CPU/gloo")
    print(f"{'per rank (max over ranks)':32s}{'DDP':>12s}{'FSDP':>12s}{'FSDP/DDP':>10s}")
    rows = [
        ("parameters MiB", "params_MiB"),
        ("gradients MiB", "grads_MiB"),
        ("optimizer state MiB", "optimizer_MiB"),
        ("params+grads+optimizer MiB", "tensors_MiB"),
        ("peak RSS MiB, training", "train_rss_MiB"),
        ("peak RSS MiB, incl. checkpoints", "peak_rss_MiB"),
        ("step time s (median)", "step_s"),
        ("TrainState checkpoint s", "report_s"),
    ]
    for label, key in rows:
        d = max(m[key] for m in per["ddp"].values())
        f = max(m[key] for m in per["fsdp"].values())
        print(f"{label:32s}{d:12.2f}{f:12.2f}{f / d:10.2f}")
    f0 = per["fsdp"][0]
    print("\nFSDP checkpoint of model + optimizer, seconds (median, slowest rank):")
    print(f"  sharded DCP save {f0['dcp save_s']:.2f}   rank-0 full save {f0['full save_s']:.2f}")
    print(f"  sharded DCP load {f0['dcp load_s']:.2f}   rank-0 full load {f0['full load_s']:.2f}")


if __name__ == "__main__":
    main()
