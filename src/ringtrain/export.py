"""``export_model``: a checkpoint's model as one consolidated state dict file, for inference.

Works on checkpoints of DDP/unsharded models (the model's state dict in ``train_state.pt``) and of
FSDP models (the DCP shards, consolidated in this process: no process group, no GPU, any number
of ranks at save time). The result loads with ``model.load_state_dict(...)`` into the plain,
unwrapped model class: keys are the original parameter names (no ``module.`` prefix, no FSDP or
activation-checkpointing wrappers).
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any

import torch

from ringtrain.checkpoint import storage
from ringtrain.checkpoint.checkpoint import Checkpoint

logger = logging.getLogger("ringtrain")

_DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}
_TORCH_SUFFIXES = (".pt", ".pth", ".bin")


def find_checkpoint(location: str | os.PathLike[str] | Checkpoint) -> Checkpoint:
    """The checkpoint at ``location``: a checkpoint directory itself, or a run directory, whose
    newest checkpoint with a valid, signed manifest is taken (paths and sizes checked; every
    file's SHA-256 is checked as it is read).

    Raises:
        FileNotFoundError: nothing there, or a run directory without a valid checkpoint.
        ValueError: a checkpoint directory whose manifest is missing, not signed with your key,
            or does not match its files.
    """
    if isinstance(location, Checkpoint):
        return location
    ckpt = Checkpoint(location)
    fs, path = ckpt.filesystem, ckpt.path
    if not fs.exists(path):
        raise FileNotFoundError(f"{location}: no such checkpoint or run directory")
    if fs.exists(storage.join(fs, path, storage.MANIFEST)):
        ckpt.set_verified_files(storage.read_manifest(fs, path)["files"])
        return ckpt
    rounds = []
    for entry in fs.ls(path, detail=False):
        round_ = storage.parse_round(entry.rstrip("/").rsplit("/", 1)[-1])
        if round_ is not None:
            rounds.append((round_, entry))
    for round_, entry in sorted(rounds, reverse=True):
        try:
            manifest = storage.read_manifest(fs, entry, run=storage.run_name(path), round_=round_)
        except (ValueError, OSError) as exc:
            logger.warning("skipping %s: %s", entry, exc)
            continue
        found = Checkpoint(entry, fs)
        found.set_verified_files(manifest["files"])
        return found
    raise FileNotFoundError(
        f"{location}: neither a checkpoint directory (no {storage.MANIFEST}) nor a run directory "
        "with a valid checkpoint_NNNNNN"
    )


def load_model_state(checkpoint: str | os.PathLike[str] | Checkpoint) -> dict[str, Any]:
    """The full, unsharded model state dict held by a TrainState checkpoint (CPU tensors).

    Reads only files the checkpoint's signed manifest lists, each checked against its SHA-256
    as it is read (the DCP shards into a private verified copy).

    Raises:
        FileNotFoundError / ValueError: see :func:`find_checkpoint`; a checkpoint that holds no
            model (a user's own file checkpoint, or a TrainState without ``model=``).
        CheckpointLoadError: a file does not match the manifest, or ``torch.load`` refuses it.
    """
    from ringtrain.checkpoint.sharded import METADATA, load_full
    from ringtrain.worker.state_files import STATE_FILE, is_dcp_file, load_file

    ckpt = find_checkpoint(checkpoint)
    if ckpt.has_file(METADATA):
        with ckpt.verified_directory(is_dcp_file) as local:
            state = load_full(local, None)
        model = state.get("model")
        if not isinstance(model, dict):
            raise ValueError(f"{ckpt.uri}: its sharded checkpoint holds no 'model'")
        return model
    shared = load_file(ckpt, STATE_FILE)
    if shared is None:
        raise ValueError(
            f"{ckpt.uri} holds no {STATE_FILE}: it was not saved from a ringtrain.TrainState, so "
            "there is no model to export (load your own files with Checkpoint.as_directory())"
        )
    if isinstance(shared, dict) and "model" in (shared.get("deepspeed") or ()):
        from ringtrain.checkpoint import deepspeed_io

        with ckpt.verified_directory(deepspeed_io.is_deepspeed_file) as local:
            return deepspeed_io.consolidate(local)
    model = shared.get("objects", {}).get("model") if isinstance(shared, dict) else None
    if model is None:
        raise ValueError(f"{ckpt.uri}: the TrainState was saved without a model")
    return dict(model)


def export_model(
    checkpoint: str | os.PathLike[str] | Checkpoint,
    path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
) -> str:
    """Write the model of a TrainState checkpoint as one consolidated state dict file.

    Args:
        checkpoint: a :class:`ringtrain.Checkpoint` (e.g. ``result.checkpoint``), a checkpoint
            directory, or a run directory (its newest valid checkpoint); local or fsspec URL.
        path: the output file (local or fsspec URL). ``*.safetensors``: safetensors;
            ``*.pt``/``*.pth``/``*.bin``: ``torch.save``; any other name: safetensors when the
            package is installed (``pip install 'ringtrain[export]'``), else ``torch.save``.
        dtype: cast floating-point tensors (``"bf16"``, ``"fp16"``, ``"fp32"`` or a
            ``torch.dtype``); ``None`` keeps the saved dtype (float32 for FSDP's sharded
            parameters, also under mixed precision).

    Returns:
        The path written.

    Raises:
        FileNotFoundError / ValueError: see :func:`load_model_state`; an unknown ``dtype``.
        ImportError: a ``.safetensors`` path without the safetensors package.
    """
    cast = _dtype(dtype)
    state = load_model_state(checkpoint)
    out = os.fspath(path)
    use_safetensors = _wants_safetensors(out)
    tensors: dict[str, Any] = {}
    seen: set[int] = set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            if use_safetensors:
                logger.warning("export_model: %s is not a tensor; safetensors leaves it out", key)
                continue
            tensors[key] = value
            continue
        t = value.detach()
        if cast is not None and t.is_floating_point():
            t = t.to(cast)
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and t.numel():  # tied weights: safetensors refuses shared storage
            t = t.clone()
        seen.add(ptr)
        tensors[key] = t
    import fsspec

    fs, target = fsspec.core.url_to_fs(out)
    parent = os.path.dirname(target)
    if parent:
        fs.makedirs(parent, exist_ok=True)
    if storage.is_local_fs(fs):  # straight to disk, then an atomic rename
        tmp = target + ".tmp"
        if use_safetensors:
            from safetensors.torch import save_file

            save_file(tensors, tmp, metadata={"format": "pt"})
        else:
            torch.save(tensors, tmp)
        os.replace(tmp, target)
    else:
        if use_safetensors:
            from safetensors.torch import save

            data = save(tensors, metadata={"format": "pt"})
        else:
            buf = io.BytesIO()
            torch.save(tensors, buf)
            data = buf.getvalue()
        fs.pipe_file(target, data)
    logger.info("exported %d tensors to %s", len(tensors), out)
    return out


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(
            f"export_model(dtype={dtype!r}) is not supported (use 'bf16', 'fp16', 'fp32' or None "
            "to keep the saved dtype)"
        )
    return _DTYPES[dtype]


def _wants_safetensors(path: str) -> bool:
    lower = path.lower()
    if lower.endswith(".safetensors"):
        import importlib.util

        if importlib.util.find_spec("safetensors") is None:
            raise ImportError(
                f"export_model: {path} asks for safetensors, which is not installed: "
                "pip install 'ringtrain[export]' (or write a .pt file)"
            )
        return True
    if lower.endswith(_TORCH_SUFFIXES):
        return False
    import importlib.util

    return importlib.util.find_spec("safetensors") is not None
