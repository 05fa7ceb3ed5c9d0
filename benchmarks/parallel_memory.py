"""Per-rank memory and step time of DDP, FSDP and FSDP x TP (and, once it lands, DeepSpeed ZeRO-3)
for the same GPT at W workers (issue 22).

Every strategy trains ``examples/gpt.py``'s ``GPT`` (~100M parameters with the defaults: 14
blocks of width 768, byte vocabulary) with AdamW on random tokens through ``rt.Trainer``, the same
global batch (``--batch`` sequences per data-parallel rank at W data-parallel ranks, so FSDP x TP
ranks get ``--batch x tp``), one run per strategy, side by side:

- ``ddp``: ``prepare_model(net)`` (DistributedDataParallel), no mesh;
- ``fsdp``: ``ParallelConfig(dp_shard=W)``: FSDP2 over every rank, each ``Block`` a unit;
- ``fsdp_tp``: ``ParallelConfig(dp_shard=W/2, tp=2)``: ``examples/gpt.py``'s ``TP_PLAN`` on
  ``mesh["tp"]``, then FSDP2 over ``mesh["dp_shard"]``;
- ``zero3``: ``rt.prepare_deepspeed`` with ZeRO stage 3, measured when that function exists
  (issue 22's DeepSpeed part; :data:`STRATEGIES` is the hook: it is skipped, with a note, until
  then).

How memory is measured. On a GPU: ``torch.cuda.max_memory_allocated`` (the peak of every tensor
the step allocated). On the CPU (this machine) there is no allocator counter for torch tensors
(``tracemalloc`` sees none of them), so two numbers: (1) the bytes of the tensors the rank owns
after a step: parameters, gradients and optimizer state, each ``DTensor`` counted by its local
shard (``ringtrain.parallel.fsdp.local_state_bytes``); this is what the sharding strategies divide;
(2) the process's peak resident set size (``ru_maxrss``), which adds the interpreter and torch (~300
MiB), activations, DDP's gradient buckets and FSDP's all-gather buffers: the memory the rank really
needed at its peak. Step time: the median of ``--steps`` timed steps after one warm-up, the
slowest rank (a barrier before and after each step).

Run::

    python benchmarks/parallel_memory.py                          # ~100M parameters, W=4
    python benchmarks/parallel_memory.py --layers 2 --dim 128     # a quick check of the script
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ringtrain as rt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from _gpt_args import gpt_arg_parser, gpt_config
from gpt import GPT, TP_PLAN, VOCAB, Block

MiB = 1024 * 1024


def _prepare_ddp(net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = rt.prepare_model(net)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _prepare_mesh(net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = rt.prepare_model(net, tp_plan=TP_PLAN, fsdp_config=rt.FSDPConfig(shard_modules=[Block]))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _prepare_zero3(net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """DeepSpeed ZeRO-3 through ringtrain (``rt.prepare_deepspeed``, issue 22): its engine is the
    model, its ZeRO optimizer the optimizer (torch's AdamW inside: no compiled ops on CPU)."""
    engine, optimizer = rt.prepare_deepspeed(
        net,
        config={
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
            "zero_optimization": {"stage": 3},
        },
    )
    return engine, optimizer


STRATEGIES: dict[str, tuple[Callable[[int], rt.ParallelConfig | None], Callable[..., Any]]] = {
    "ddp": (lambda w: None, _prepare_ddp),
    "fsdp": (lambda w: rt.ParallelConfig(dp_shard=w), _prepare_mesh),
    "fsdp_tp": (lambda w: rt.ParallelConfig(dp_shard=w // 2, tp=2), _prepare_mesh),
    "zero3": (lambda w: None, _prepare_zero3),
}
"""name -> (the ScalingConfig.parallel for W workers, the function that prepares the model and
the optimizer). ``zero3`` runs only where ``rt.prepare_deepspeed`` exists."""


def _max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return _max_over_ranks(time.perf_counter() - start)


def _zero3_bytes(optimizer: Any) -> dict[str, int]:
    """ZeRO-3's partitions on this rank: parameters (the module's flat partitions, and the fp32
    master partitions where they are another tensor: in fp32 training they are the same one),
    the persistent flat gradient-partition buffer, AdamW's moments."""
    flats = {t.data_ptr(): t for t in optimizer.fp16_partitioned_groups_flat}
    flats.update({t.data_ptr(): t for t in optimizer.fp32_partitioned_groups_flat})
    params = sum(t.numel() * t.element_size() for t in flats.values())
    buffer = getattr(optimizer, "grad_partitions_flat_buffer", None)
    grads = buffer.numel() * buffer.element_size() if buffer is not None else 0
    opt = sum(
        v.numel() * v.element_size()
        for state in optimizer.optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}


def _local_bytes(model: nn.Module, optimizer: Any) -> dict[str, int]:
    from ringtrain.parallel.fsdp import local_state_bytes

    if hasattr(optimizer, "fp32_partitioned_groups_flat"):  # DeepSpeed ZeRO-3
        return _zero3_bytes(optimizer)

    return local_state_bytes(model, optimizer)


def bench_fn(config: dict) -> None:
    ctx = rt.get_context()
    torch.manual_seed(0)
    net = GPT(config["layers"], config["dim"], config["heads"], config["seq"])
    n_params = sum(p.numel() for p in net.parameters())
    model, optimizer = STRATEGIES[config["strategy"]][1](net)
    mesh = ctx.config.mesh
    tp = mesh.tp if mesh is not None else 1
    g = torch.Generator().manual_seed(ctx.world_rank // tp)  # TP peers: the same batch
    x = torch.randint(0, VOCAB, (config["batch"] * tp, config["seq"] + 1), generator=g)
    x = x.to(ctx.device)
    if ctx.use_gpu:
        torch.cuda.reset_peak_memory_stats()

    def step() -> None:
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        if config["strategy"] == "zero3":  # the engine reduces, steps and zeroes the gradients
            model.backward(loss)
            model.step()
            return
        optimizer.zero_grad(set_to_none=False)  # keep the gradients: they count as memory
        loss.backward()
        optimizer.step()

    step()  # warm-up: allocates the optimizer state and the buffers
    times = [_timed(step) for _ in range(config["steps"])]
    mem = _local_bytes(model, optimizer)
    rt.report(
        {
            "step_s": statistics.median(times),
            "params_MiB": mem["params"] / MiB,
            "grads_MiB": mem["grads"] / MiB,
            "optimizer_MiB": mem["optimizer"] / MiB,
            "params_optimizer_MiB": (mem["params"] + mem["optimizer"]) / MiB,
            "tensors_MiB": mem["total"] / MiB,
            "n_params": n_params,
            "peak_rss_MiB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "cuda_peak_MiB": torch.cuda.max_memory_allocated() / MiB if ctx.use_gpu else 0.0,
        }
    )


def run(strategy: str, args: argparse.Namespace, storage: str) -> dict[int, dict[str, Any]]:
    config = {"strategy": strategy, **gpt_config(args)}
    result = rt.Trainer(
        bench_fn,
        rt.ScalingConfig(
            num_workers=args.workers,
            use_gpu=args.gpu,
            parallel=STRATEGIES[strategy][0](args.workers),
        ),
        rt.RunConfig(name=f"bench-{strategy}", storage_path=storage, progress="off"),
        train_loop_config=config,
    ).fit()
    if result.error is not None:
        raise result.error
    return result.metrics_per_rank


ROWS = [
    ("parameters MiB", "params_MiB"),
    ("gradients MiB", "grads_MiB"),
    ("optimizer state MiB", "optimizer_MiB"),
    ("params+optimizer MiB", "params_optimizer_MiB"),
    ("params+grads+optimizer MiB", "tensors_MiB"),
    ("peak RSS MiB", "peak_rss_MiB"),
    ("CUDA peak allocated MiB", "cuda_peak_MiB"),
    ("step time s (median)", "step_s"),
]


def print_table(per: dict[str, dict[int, dict[str, Any]]], args: argparse.Namespace) -> None:
    names = list(per)
    n = next(iter(per.values()))[0]["n_params"]
    print(f"\nW={args.workers}, {n / 1e6:.1f}M parameters, AdamW, fp32, global batch "
          f"{args.workers * args.batch} x {args.seq} tokens; max over ranks")  # fmt: skip
    print(f"{'per rank':30s}" + "".join(f"{s:>11s}" for s in names)
          + "".join(f"{s + '/ddp':>12s}" for s in names if s != "ddp"))  # fmt: skip
    for label, key in ROWS:
        if key == "cuda_peak_MiB" and not args.gpu:
            continue
        values = {s: max(m[key] for m in per[s].values()) for s in names}
        ratios = [values[s] / values["ddp"] for s in names if s != "ddp" and values["ddp"]]
        print(f"{label:30s}" + "".join(f"{values[s]:11.2f}" for s in names)
              + "".join(f"{r:12.2f}" for r in ratios))  # fmt: skip


def main() -> None:
    p = gpt_arg_parser(
        __doc__, workers=4, batch=1, steps=3, batch_help="sequences per data-parallel rank"
    )
    p.add_argument("--gpu", action="store_true", help="one CUDA device per worker")
    p.add_argument(
        "--strategies", default="ddp,fsdp,fsdp_tp,zero3", help=f"of {', '.join(STRATEGIES)}"
    )
    args = p.parse_args()
    chosen = args.strategies.split(",")
    if "ddp" not in chosen:
        chosen.insert(0, "ddp")  # the baseline of every ratio
    if "zero3" in chosen and not hasattr(rt, "prepare_deepspeed"):
        print("zero3: skipped (rt.prepare_deepspeed is not in this ringtrain yet)")
        chosen.remove("zero3")
    storage = tempfile.mkdtemp(prefix="ringtrain_bench_parallel_")
    try:
        per = {}
        for s in chosen:
            start = time.perf_counter()
            per[s] = run(s, args, storage)
            print(f"{s}: done in {time.perf_counter() - start:.0f}s", flush=True)
    finally:
        shutil.rmtree(storage, ignore_errors=True)
    print_table(per, args)


if __name__ == "__main__":
    main()
