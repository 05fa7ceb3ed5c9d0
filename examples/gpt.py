"""Train a small GPT-style byte-level language model on Python's own standard library, sharded
over N ringtrain workers with FSDP2 (``--strategy fsdp``, the default) or replicated with DDP
(``--strategy ddp``), or on a device mesh (``--tp``, ``--dp-shard``, ``--dp-replicate``: tensor
parallelism inside, FSDP2 or HSDP outside; docs/parallelism.md).

Data (offline, deterministic): the ``*.py`` files directly in the standard library's directory
(``os.path.dirname(os.__file__)``), sorted by name and concatenated, the first
``--corpus-chars`` bytes of that. The last 10% is held out for validation, the rest cut into
non-overlapping windows of ``--block-size + 1`` bytes; each window is one sample (inputs: its first
``block_size`` bytes, targets: the same shifted by one). The vocabulary is the 256 byte values.

Model: the GPT-2 layout (Radford et al., 2019; as in Karpathy's nanoGPT): token and position
embeddings, ``--n-layer`` pre-LayerNorm transformer blocks (causal multi-head self-attention with
``scaled_dot_product_attention``, a 4x GELU MLP), a final LayerNorm and an output head tied to the
token embedding. With FSDP each ``Block`` is its own unit (``FSDPConfig(shard_modules=[Block])``);
the embeddings, final norm and tied head live in the root unit. ``--bf16`` computes in bfloat16
(gradients reduced in float32), ``--activation-checkpointing`` recomputes each block's
activations in backward.

Each epoch ends with the validation loss (mean cross-entropy in nats per byte, and bits per
byte), evaluated by all ranks on disjoint slices of the held-out text and summed with an
allreduce, and a checkpoint: the model and AdamW state as per-rank shards
(``torch.distributed.checkpoint``) under FSDP, in ``train_state.pt`` under DDP, plus the cosine
LR schedule, the data position and the RNG states. Starting the script again with the same
``--name`` resumes from the latest checkpoint (also with another ``--workers``: the shards are
resharded and the data position converted). ``--export model.safetensors`` writes the final
model as one consolidated state dict.

Run it::

    python examples/gpt.py                          # 2 workers, FSDP
    python examples/gpt.py --strategy ddp --name gpt-ddp
    python examples/gpt.py --bf16 --activation-checkpointing --name gpt-bf16
    python examples/gpt.py --export runs/gpt/model.safetensors
    python examples/gpt.py --tp 2 --dp-shard 2 --name gpt-tp   # 4 workers: FSDP x TP
    python examples/gpt.py --dp-replicate 2 --dp-shard 2 --name gpt-hsdp
    python examples/gpt.py --pp 2 --name gpt-pp    # 2 pipeline stages (1F1B, --microbatches 4)

With ``--pp P`` the model is cut into ``P`` pipeline stages (``rt.prepare_pipeline``) at even
block boundaries, trained with the 1F1B schedule; it runs as the chain
:func:`pipeline_chain` (``embed`` (token + position), the blocks, ``ln_f``, ``head``), so its
checkpoints name the embeddings ``embed.tok`` / ``embed.pos``; the tied head's gradient is summed
between the first and the last stage. No sample is generated with ``--pp``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

import ringtrain as rt
from ringtrain.parallel.pipeline_model import PipelineModel

VOCAB = 256  # bytes
VAL_FRACTION = 0.1

# Shapes: B batch, T time (block size), C channels (n_embd), H heads, V vocabulary.


# --------------------------------------------------------------------------------------------- data


def stdlib_corpus(max_bytes: int) -> bytes:
    """The standard library's top-level ``*.py`` files, sorted by name, concatenated (each
    followed by a newline), truncated to ``max_bytes``."""
    root = Path(os.path.dirname(os.__file__))
    chunks, size = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes() + b"\n"
        chunks.append(data)
        size += len(data)
        if size >= max_bytes:
            break
    corpus = b"".join(chunks)[:max_bytes]
    if len(corpus) < 10_000:
        raise RuntimeError(f"only {len(corpus)} bytes of Python source found under {root}")
    return corpus


class Windows(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens: ``(x (T,), y (T,))`` int64."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = self.tokens[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def load_data(corpus_bytes: int, block_size: int) -> tuple[Windows, Windows]:
    tokens = torch.frombuffer(bytearray(stdlib_corpus(corpus_bytes)), dtype=torch.uint8).long()
    split = int(len(tokens) * (1 - VAL_FRACTION))
    return Windows(tokens[:split], block_size), Windows(tokens[split:], block_size)


# -------------------------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused ``qkv`` projection whose output features
    are head-major (``[head][q|k|v][head_dim]``): a contiguous slice of them is whole heads, so
    tensor parallelism can split ``qkv`` column-wise and ``proj`` row-wise by heads (the heads are
    counted with ``-1``: this rank's)."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.head_dim = n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTC.shape
        qkv_BTH3c = self.qkv(x_BTC).view(B, T, -1, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv_BTH3c.unbind(dim=3))
        y_BHTc = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y_BHTc.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """The 4x GELU MLP: ``fc1`` splits column-wise, ``fc2`` row-wise under TP."""

    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_embd, 4 * n_embd)
        self.fc2 = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


TP_PLAN = {
    "blocks.*.attn.qkv": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.mlp.fc1": "colwise",
    "blocks.*.mlp.fc2": "rowwise",
}
"""Megatron-style tensor parallelism of each block: one all-reduce after attention, one after
the MLP (``prepare_model(tp_plan=TP_PLAN)`` on ``--tp`` ranks)."""


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_layer: int, n_embd: int, n_head: int, block_size: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"--n-embd {n_embd} must be a multiple of --n-head {n_head}")
        self.block_size = block_size
        self.tok = nn.Embedding(VOCAB, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied, as in GPT-2
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` -> logits ``(B, T, V)``."""
        T = idx_BT.shape[1]
        x = self.tok(idx_BT) + self.pos(torch.arange(T, device=idx_BT.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Embed(nn.Module):
    """Token plus position embedding: the first unit of :func:`pipeline_chain`."""

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        T = idx_BT.shape[1]
        return self.tok(idx_BT) + self.pos(torch.arange(T, device=idx_BT.device))


def pipeline_chain(gpt: GPT) -> nn.Sequential:
    """``gpt`` as a chain for ``rt.prepare_pipeline`` (the same modules and parameters):
    ``embed -> blocks.0 .. blocks.{n-1} -> ln_f -> head``."""
    units = {"embed": Embed(gpt.tok, gpt.pos), "blocks": gpt.blocks, "ln_f": gpt.ln_f}
    return nn.Sequential(OrderedDict({**units, "head": gpt.head}))


def lm_loss(logits_BTV: torch.Tensor, y_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.reshape(-1, VOCAB).float(), y_BT.reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, val: Windows, batch_size: int, device: torch.device) -> float:
    """Mean validation loss (nats per byte) over the held-out windows. Every data-parallel rank
    evaluates a disjoint, equally long slice (FSDP needs every rank in every forward; TP peers
    evaluate the same slice together) and the sums are allreduced."""
    rank, size = data_parallel_rank()  # TP peers evaluate the same windows together
    n = len(val) // size * size
    mine = list(range(rank, n, size))
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for i in range(0, len(mine), batch_size):
        xs, ys = zip(*(val[j] for j in mine[i : i + batch_size]), strict=True)
        x, y = torch.stack(xs).to(device), torch.stack(ys).to(device)
        if isinstance(model, PipelineModel):  # the last stage holds the losses
            if len(xs) != batch_size:
                continue  # a last partial batch: the stages run batches of one shape
            losses = model.eval_step(x, target=y, loss_fn=lm_loss)
            if losses is not None:
                total[0] += losses.double().mean() * y.numel()
                total[1] += y.numel()
            continue
        total[0] += lm_loss(model(x), y).double() * y.numel()
        total[1] += y.numel()
    model.train()
    if dist.is_initialized():
        dist.all_reduce(total)  # TP peers count their windows tp times, in both sums
    return float(total[0] / total[1])


def data_parallel_rank() -> tuple[int, int]:
    """``(index, count)`` of this rank among the data-parallel ranks (``dp_replicate x dp_shard``
    on the mesh); the whole world without ``--tp``."""
    ctx = rt.get_context()
    if ctx.config.mesh is None:
        return ctx.world_rank, ctx.world_size
    mesh = ctx.mesh
    rep, shard = mesh["dp_replicate"], mesh["dp_shard"]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()


@torch.no_grad()
def sample(model: nn.Module, prompt: bytes, n: int, device: torch.device) -> str:
    """``n`` bytes continuing ``prompt``, drawn at temperature 0.8 from a fixed seed (the same on
    every rank, so that all ranks take part in the same forwards)."""
    g = torch.Generator().manual_seed(0)
    idx = torch.tensor([list(prompt)], device=device)
    model.eval()
    for _ in range(n):
        logits = model(idx[:, -model_block_size(model) :])[0, -1].float().cpu()
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=g)
        idx = torch.cat([idx, nxt.to(device).view(1, 1)], dim=1)
    model.train()
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def model_block_size(model: nn.Module) -> int:
    module = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    assert isinstance(module, GPT)  # FSDP's class (FSDPGPT) is a subclass
    return module.block_size


# ----------------------------------------------------------------------------------- train function


def train_fn(config: dict) -> None:
    ctx = rt.get_context()
    device = ctx.device
    train_set, val_set = load_data(config["corpus_bytes"], config["block_size"])
    torch.manual_seed(config["seed"])  # the same initial weights on every rank
    net = GPT(config["n_layer"], config["n_embd"], config["n_head"], config["block_size"])
    fsdp_config = rt.FSDPConfig(
        shard_modules=[Block],
        mixed_precision="bf16" if config["bf16"] else None,
        activation_checkpointing=config["activation_checkpointing"],
    )
    pp = ctx.config.mesh.pp if ctx.config.mesh is not None else 1
    if pp > 1:  # --pp: pipeline stages at even block boundaries, TP inside with --tp
        splits = [f"blocks.{k * config['n_layer'] // pp}" for k in range(1, pp)]
        model = rt.prepare_pipeline(
            pipeline_chain(net),
            split_points=splits,
            microbatches=config["microbatches"],
            schedule="1F1B",
            tp_plan=TP_PLAN if ctx.config.mesh.tp > 1 else None,
        )
    elif ctx.config.mesh is not None:  # --tp / --dp-shard / --dp-replicate: TP, then FSDP2/HSDP
        model = rt.prepare_model(net, tp_plan=TP_PLAN, fsdp_config=fsdp_config)
    elif config["strategy"] == "fsdp":
        model = rt.prepare_model(net, parallel_strategy="fsdp", fsdp_config=fsdp_config)
    else:
        model = rt.prepare_model(net, precision="bf16-mixed" if config["bf16"] else "32")
    # Built after prepare_model: under FSDP it must hold the sharded parameters.
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config["lr"], betas=(0.9, 0.95), weight_decay=0.1
    )
    loader = rt.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"], shuffle=True, drop_last=True),
        seed=config["seed"],
    )
    total_steps = config["epochs"] * len(loader)
    warmup = max(1, total_steps // 20)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    state = rt.TrainState(
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        data_loader=loader,
        epochs=config["epochs"],
        metrics={},
    )
    if state.restore():
        if ctx.world_rank == 0:
            print(f"resuming at epoch {state.epoch}, step {state.step}", flush=True)
        if state.epoch >= config["epochs"]:  # already trained: report its metrics again
            rt.report(state["metrics"])
            return
    if ctx.world_rank == 0:
        n_params = sum(p.numel() for p in net.parameters())
        print(
            f"{strategy_name(config)}: {n_params / 1e6:.2f}M parameters, {len(train_set)} training "
            f"windows of {config['block_size']} bytes, {len(loader)} steps per epoch per rank",
            flush=True,
        )

    for epoch in state.epochs(config["epochs"]):
        start = time.perf_counter()
        loss_sum, steps = 0.0, 0
        for x, y in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = train_step(model, x, y)
            # Under FSDP the gradients are DTensor shards: the global norm is reduced across ranks.
            clip_grad_norm(model, 1.0)
            optimizer.step()
            scheduler.step()
            state.step += 1
            loss_sum += loss.item()
            steps += 1
        val_loss = evaluate(model, val_set, config["batch_size"], device)
        metrics = {
            "epoch": epoch,
            "train_loss": loss_sum / max(1, steps),
            "val_loss": val_loss,
            "val_bits_per_byte": val_loss / math.log(2),
            "epoch_s": time.perf_counter() - start,
        }
        state["metrics"] = metrics
        if ctx.world_rank == 0:
            print(
                f"epoch {epoch + 1}/{config['epochs']}  train loss {metrics['train_loss']:.3f}  "
                f"val loss {val_loss:.3f} ({metrics['val_bits_per_byte']:.2f} bits/byte)  "
                f"({metrics['epoch_s']:.1f}s)",
                flush=True,
            )
        rt.report(metrics, checkpoint=state)
    if config["sample"] and pp == 1:
        text = sample(model, b"def ", config["sample"], device)
        if ctx.world_rank == 0:
            print("sample:\n" + text, flush=True)


def train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward and backward of one batch; the loss (with ``--pp``: the last stage's, sent to
    every rank, so that rank 0 can print it)."""
    if not isinstance(model, PipelineModel):
        loss = lm_loss(model(x), y)
        loss.backward()
        return loss.detach()
    losses = model.step(x, target=y, loss_fn=lm_loss)
    loss = losses.mean() if losses is not None else torch.zeros((), device=x.device)
    dist.all_reduce(loss)  # the last stage's ranks hold the losses: their mean
    return loss / (dist.get_world_size() // rt.get_context().mesh["pp"].size())


def strategy_name(config: dict) -> str:
    """``"fsdp"``/``"ddp"``, or the mesh (``"mesh dp_shard=2 x tp=2"``)."""
    mesh = rt.get_context().config.mesh
    if mesh is None:
        return str(config["strategy"])
    names = ("pp", "dp_replicate", "dp_shard", "tp")
    return "mesh " + " x ".join(f"{n}={k}" for n, k in zip(names, mesh.sizes, strict=True) if k > 1)


def clip_grad_norm(model: nn.Module, max_norm: float) -> None:
    """``clip_grad_norm_`` over every parameter; on a mesh the gradients are DTensors on two
    meshes (``(dp, tp)`` for TP-split weights, ``dp`` for the rest): each group's norm is made
    a plain tensor (``full_tensor``) before they are combined."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norms = [torch.linalg.vector_norm(g) for g in grads]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if isinstance(model, PipelineModel):  # each stage holds its own parameters' gradients
        squared = total.square()  # (the tied head/embedding counts twice)
        dist.all_reduce(squared, group=rt.get_context().mesh["pp"].get_group())
        total = squared.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale)


# ------------------------------------------------------------------------------------------- driver


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Train a byte-level GPT on the Python standard library with FSDP or DDP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--strategy", choices=("fsdp", "ddp"), default="fsdp")
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="number of workers (default: 2, or the product of the mesh sizes below)",
    )
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel ranks (adjacent)")
    p.add_argument("--dp-shard", type=int, default=None, help="FSDP2 ranks per replica group")
    p.add_argument("--dp-replicate", type=int, default=None, help="replica groups (HSDP)")
    p.add_argument("--pp", type=int, default=None, help="pipeline stages (1F1B schedule)")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per batch (--pp)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument(
        "--batch-size", type=int, default=16, help="windows per data-parallel rank per step"
    )
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128, help="context length in bytes")
    p.add_argument(
        "--corpus-bytes", type=int, default=300_000, help="bytes of stdlib source to use"
    )
    p.add_argument("--bf16", action="store_true", help="bfloat16 compute, float32 reduction")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--sample", type=int, default=120, help="bytes to generate at the end (0: none)")
    p.add_argument("--name", default="gpt", help="run name: the run directory's name")
    p.add_argument("--storage-path", default="./runs", help="where run directories go")
    p.add_argument("--gpu", action="store_true", help="one CUDA device per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-failures", type=int, default=0, help="failures to survive (-1: forever)")
    p.add_argument("--export", default=None, help="write the final model here (.safetensors/.pt)")
    return p.parse_args(argv)


def mesh_from_args(args: argparse.Namespace) -> tuple[int, rt.ParallelConfig | None]:
    """``(num_workers, ParallelConfig or None)`` from ``--workers`` and the mesh flags."""
    sizes = {"tp": args.tp, "dp_shard": args.dp_shard, "dp_replicate": args.dp_replicate}
    sizes["pp"] = args.pp
    given = {k: v for k, v in sizes.items() if v is not None}
    if not given:
        return args.workers or 2, None
    parallel = rt.ParallelConfig(**given)
    # Default: the product of the sizes given (dp_shard then takes what is left: 1).
    return args.workers or math.prod(given.values()), parallel


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workers, parallel = mesh_from_args(args)
    config = {
        "strategy": args.strategy,
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "block_size": args.block_size,
        "corpus_bytes": args.corpus_bytes,
        "bf16": args.bf16,
        "activation_checkpointing": args.activation_checkpointing,
        "sample": args.sample,
        "seed": args.seed,
        "microbatches": args.microbatches,
    }
    start = time.perf_counter()
    result = rt.Trainer(
        train_fn,
        train_loop_config=config,
        scaling_config=rt.ScalingConfig(num_workers=workers, use_gpu=args.gpu, parallel=parallel),
        run_config=rt.RunConfig(
            name=args.name,
            storage_path=args.storage_path,
            checkpoint_config=rt.CheckpointConfig(num_to_keep=2),
            failure_config=rt.FailureConfig(max_failures=args.max_failures),
        ),
    ).fit()
    print(
        f"validation loss {result.metrics['val_loss']:.3f} nats/byte "
        f"({result.metrics['val_bits_per_byte']:.2f} bits/byte) after {args.epochs} epochs, "
        f"{time.perf_counter() - start:.1f}s; run directory {result.path}"
    )
    if args.export and result.checkpoint is not None:
        print(f"exported the model to {rt.export_model(result.checkpoint, args.export)}")


if __name__ == "__main__":
    main()
