"""``ringtrain export``: a checkpoint's model as one consolidated state dict
(:mod:`ringtrain.export`)."""

from __future__ import annotations

import argparse
from typing import Any

from ringtrain.cli.common import say


def add_export_parser(sub: Any) -> None:
    """Add the ``export`` subcommand to ``sub`` (an ``add_subparsers()`` result)."""
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model as one consolidated state dict (safetensors)",
        description="Write the model of a TrainState checkpoint (DDP or FSDP-sharded) as one "
        "unsharded state dict file for inference: safetensors for *.safetensors (and any other "
        "name when safetensors is installed), torch.save for *.pt/*.pth/*.bin. No process group "
        "or GPU is needed. RUN_OR_CHECKPOINT is a checkpoint directory, or a run directory (its "
        "newest valid checkpoint).",
    )
    export.add_argument("source", metavar="RUN_OR_CHECKPOINT")
    export.add_argument("out", metavar="OUT")
    export.add_argument(
        "--dtype",
        choices=("bf16", "fp16", "fp32"),
        default=None,
        help="cast floating-point tensors (default: keep the saved dtype)",
    )


def cmd_export(args: argparse.Namespace) -> int:
    """``ringtrain export``: write a checkpoint's model as one state dict file."""
    from ringtrain.export import export_model, find_checkpoint

    try:
        ckpt = find_checkpoint(args.source)
        out = export_model(ckpt, args.out, dtype=args.dtype)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        say(f"ringtrain export: {exc}", err=True)
        return 1
    say(f"exported the model of {ckpt.uri} to {out}")
    return 0
