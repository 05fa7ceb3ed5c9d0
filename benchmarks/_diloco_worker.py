"""One rank of ``benchmarks/diloco.py``: the character-level GPT of ``examples/gpt.py`` trained by
data parallelism (``--mode ddp``) or DiLoCo (``--mode diloco``, streaming with ``--fragments``),
started on one host of the test bed with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...): ``rt.Trainer(...).fit()`` then runs the train function in this process.

Every ``--eval-every`` inner steps the ranks evaluate the model (DiLoCo: the *global* parameters,
the model the replicas agree on) on the first ``--val-windows`` held-out windows, each rank a
disjoint slice, summed with one small all-reduce; the time spent evaluating is left out of the
training clock. Rank ``r`` writes one JSON line per evaluation to ``OUT.r.jsonl``: inner step,
samples seen by all replicas, training seconds, validation loss, and the bytes this host has sent
on ``eth0`` since training began (``/proc/net/dev``: the wire, headers included)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import ringtrain as rt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, lm_loss, load_data


def tx_bytes(ifname: str = "eth0") -> int:
    """Bytes this network namespace has sent on ``ifname`` (``/proc/net/dev``)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    return 0


@torch.no_grad()
def evaluate(net: GPT, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean validation loss over every rank's slice of ``val`` (one all-reduce of two numbers)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(2, dtype=torch.float64)
    mine = val[rank::size]
    net.eval()
    for i in range(0, len(mine), 64):
        xs, ys = zip(*mine[i : i + 64], strict=True)
        y = torch.stack(ys)
        total[0] += lm_loss(net(torch.stack(xs)), y).double() * y.numel()
        total[1] += y.numel()
    net.train()
    dist.all_reduce(total)
    return float(total[0] / total[1])


def build_model(config: dict) -> tuple[torch.nn.Module, GPT, torch.nn.Module]:
    """The prepared model, the module whose parameters are evaluated, and the raw module."""
    torch.manual_seed(config["seed"])
    net = GPT(config["n_layer"], config["n_embd"], config["n_head"], config["block_size"])
    if config["mode"] == "ddp":
        model = rt.prepare_model(net)
        return model, net, net
    diloco = rt.DiLoCoConfig(
        sync_every=config["sync_every"],
        outer_lr=0.7,
        outer_momentum=0.9,
        fragments=config["fragments"],
        sync_delay=config["sync_delay"],
        outer_dtype=config["outer_dtype"],
    )
    model = rt.prepare_model(net, parallel_strategy="diloco", diloco_config=diloco)
    torch.manual_seed(config["seed"])
    shadow = GPT(config["n_layer"], config["n_embd"], config["n_head"], config["block_size"])
    return model, shadow, net


def load_global(shadow: GPT, model: torch.nn.Module) -> None:
    """Copy the DiLoCo global parameters into ``shadow`` (the model that is evaluated)."""
    from ringtrain.parallel.diloco import outer_sync

    sync = outer_sync(model)
    with torch.no_grad():
        for p, g in zip(shadow.parameters(), sync.global_params, strict=True):
            p.copy_(g)


def train_fn(config: dict) -> None:
    torch.set_num_threads(1)
    rank = dist.get_rank()
    train_set, val_set = load_data(config["corpus_bytes"], config["block_size"])
    val = [val_set[i] for i in range(min(config["val_windows"], len(val_set)))]
    model, shadow, _ = build_model(config)
    inner = torch.optim.AdamW(model.parameters(), lr=config["lr"], betas=(0.9, 0.95))
    optimizer = rt.prepare_optimizer(inner)
    loader = rt.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"], shuffle=True, drop_last=True),
        seed=config["seed"],
    )
    steps, horizon, warmup = config["steps"], config["horizon"], config["warmup"]

    def lr_factor(step: int) -> float:  # linear warm-up, cosine to 10% at `horizon`, then 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, horizon - warmup))
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lr_factor)
    out = open(f"{config['out']}.{rank}.jsonl", "w")  # noqa: SIM115
    samples_per_step = config["batch_size"] * dist.get_world_size()
    train_s, step = 0.0, 0

    def record() -> None:
        nonlocal train_s
        if config["mode"] != "ddp":
            load_global(shadow, model)
        began = time.perf_counter()
        loss = evaluate(shadow, val)
        row = {
            "step": step,
            "samples": step * samples_per_step,
            "train_s": train_s,
            "val_loss": loss,
            "tx_bytes": tx_bytes() - tx0,
            "eval_s": time.perf_counter() - began,
        }
        if config["mode"] != "ddp":
            from ringtrain.parallel.diloco import outer_sync

            stats = outer_sync(model).stats
            row.update(
                sync_bytes=stats.bytes_sent,
                peak_bytes=stats.peak_bytes,
                exchanges=stats.exchanges,
                sync_s=stats.seconds,
            )
        out.write(json.dumps(row) + "\n")
        out.flush()
        if rank == 0:
            print(json.dumps(row), flush=True)

    dist.barrier()
    tx0 = tx_bytes()
    record()
    while step < steps:
        for x, y in loader:
            began = time.perf_counter()
            loss = lm_loss(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            train_s += time.perf_counter() - began
            if step % config["eval_every"] == 0 or step == steps:
                record()
            if step >= steps:
                break
    out.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ddp", "diloco"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--horizon", type=int, default=300, help="the LR schedule's length")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-windows", type=int, default=240)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--sync-delay", type=int, default=0)
    p.add_argument("--outer-dtype", default="fp32")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--corpus-bytes", type=int, default=2_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--storage-path", default=os.environ.get("TMPDIR", "/tmp"))
    args = p.parse_args()
    config = {k.replace("-", "_"): v for k, v in vars(args).items()}
    rt.Trainer(
        train_fn,
        train_loop_config=config,
        run_config=rt.RunConfig(storage_path=args.storage_path, name="diloco-bench"),
    ).fit()


if __name__ == "__main__":
    main()
