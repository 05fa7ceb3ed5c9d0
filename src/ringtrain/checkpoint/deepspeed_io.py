"""DeepSpeed's own checkpoint inside ringtrain's verified checkpoint directory.

A :class:`ringtrain.TrainState` whose ``model`` is a DeepSpeed engine (from
:func:`ringtrain.prepare_deepspeed`) saves it with ``engine.save_checkpoint`` (collective) into a
local temporary directory; ringtrain's checkpoint writer then copies this rank's files from there
into the round's staging directory as ``deepspeed__<file>``: hashed while copied, listed in the
signed manifest, published by the atomic rename, on any fsspec storage. DeepSpeed's recovery
script (``zero_to_fp32.py``) and its ``latest`` file are never copied: a checkpoint holds no code.

Loading never runs code from the checkpoint. DeepSpeed reads its files with
``torch.load(weights_only=False)``; here it gets a private copy of the files the signed manifest
lists (each checked against its SHA-256 while copied, before any byte is unpickled), and reads
them with ``torch.load(weights_only=True)`` under an exact allow-list of DeepSpeed's own
data-only classes (:data:`SAFE_GLOBALS`): anything else in a file is refused.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

PREFIX = "deepspeed__"
"""Checkpoint file names of DeepSpeed's files: ``deepspeed__mp_rank_00_model_states.pt``..."""
TAG = "ringtrain"
"""The DeepSpeed checkpoint tag (its sub-directory) ringtrain saves and loads."""

_LOAD_LOCK = threading.Lock()


class DeepSpeedEngineLike(Protocol):
    """What ringtrain uses of a ``deepspeed.DeepSpeedEngine``."""

    checkpoint_engine: Any

    def save_checkpoint(self, save_dir: str, tag: str | None = ..., **kwargs: Any) -> Any: ...

    def load_checkpoint(self, load_dir: str, tag: str | None = ..., **kwargs: Any) -> Any: ...


def is_engine(obj: object) -> bool:
    """Whether ``obj`` is a DeepSpeed engine (without importing DeepSpeed when nothing did)."""
    if "deepspeed" not in sys.modules:
        return False
    from deepspeed.runtime.engine import DeepSpeedEngine

    return isinstance(obj, DeepSpeedEngine)


def engine_names(named: dict[str, Any]) -> set[str]:
    """The names of a TrainState's named slots that DeepSpeed's checkpoint covers: ``model``
    when it is an engine, and ``optimizer`` / ``lr_scheduler`` when they are the engine's."""
    engine = named.get("model")
    if not is_engine(engine):
        return set()
    names = {"model"}
    for name, part in (("optimizer", "optimizer"), ("lr_scheduler", "lr_scheduler")):
        if named.get(name) is not None and named.get(name) is getattr(engine, part, None):
            names.add(name)
    return names


def is_deepspeed_file(name: str) -> bool:
    """Whether checkpoint file ``name`` is one of DeepSpeed's files."""
    return name.startswith(PREFIX)


def _safe_globals() -> list[Any]:
    """DeepSpeed's data-only classes that its checkpoints pickle: the loss scalers, the ZeRO
    stage enum and a partition's ``(numel, start)`` dataclass; the only globals a DeepSpeed
    file may name beyond what ``weights_only`` allows."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def safe_load(path: Any, map_location: Any = None, **kwargs: Any) -> Any:
    """``torch.load`` with ``weights_only=True`` and :func:`_safe_globals` allowed, whatever the
    caller asked for (``weights_only=False`` is ignored)."""
    kwargs.pop("weights_only", None)
    with torch.serialization.safe_globals(_safe_globals()):
        return torch.load(path, map_location=map_location, weights_only=True, **kwargs)


@contextlib.contextmanager
def weights_only_torch_load() -> Iterator[None]:
    """Within the block, every ``torch.load`` of this process is :func:`safe_load` (DeepSpeed's
    ``zero_to_fp32`` calls ``torch.load`` itself, with ``weights_only=False``). One block at a
    time; the original is put back on exit."""
    with _LOAD_LOCK:
        original = torch.load

        def forced(path: Any, map_location: Any = None, **kwargs: Any) -> Any:
            kwargs.pop("weights_only", None)
            with torch.serialization.safe_globals(_safe_globals()):
                return original(path, map_location=map_location, weights_only=True, **kwargs)

        torch.load = forced  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.load = original


# ------------------------------------------------------------------------------------ saving


def save_writers(engine: DeepSpeedEngineLike, rank: int) -> dict[str, Callable[[Any], None]]:
    """Save ``engine`` (collective: every rank calls it at the same report) into a fresh local
    directory and return ``name -> writer(file)`` copying this rank's files out of it (the last
    one removes the directory)."""
    directory = tempfile.mkdtemp(prefix=f"ringtrain_ds_r{rank}_")
    os.makedirs(os.path.join(directory, TAG), exist_ok=True)
    engine.save_checkpoint(directory, tag=TAG, save_latest=False)
    tag_dir = os.path.join(directory, TAG)
    names = sorted(n for n in os.listdir(tag_dir) if os.path.isfile(os.path.join(tag_dir, n)))
    if not names:
        shutil.rmtree(directory, ignore_errors=True)
        return {}

    def copier(name: str, last: bool) -> Callable[[Any], None]:
        def write(out: Any) -> None:
            with open(os.path.join(tag_dir, name), "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            if last:
                shutil.rmtree(directory, ignore_errors=True)

        return write

    return {PREFIX + n: copier(n, i == len(names) - 1) for i, n in enumerate(names)}


# ----------------------------------------------------------------------------------- loading


def _layout(verified: str) -> str:
    """Move the verified ``deepspeed__*`` files of ``verified`` into DeepSpeed's layout
    (``verified/TAG/<file>``) and return the directory to give DeepSpeed."""
    tag_dir = os.path.join(verified, TAG)
    os.makedirs(tag_dir, exist_ok=True)
    for name in os.listdir(verified):
        if is_deepspeed_file(name):
            os.replace(os.path.join(verified, name), os.path.join(tag_dir, name[len(PREFIX) :]))
    return verified


def restore_engine(engine: DeepSpeedEngineLike, verified: str, uri: str = "checkpoint") -> None:
    """Load ``engine`` (collective) from the verified copy ``verified`` of a checkpoint's
    DeepSpeed files: module, ZeRO optimizer partitions, LR scheduler, DeepSpeed's step counters.

    Raises:
        ValueError: DeepSpeed found no checkpoint in the files.
        CheckpointLoadError: a file names a global outside the allow-list (on a worker, the
            driver then sets the checkpoint aside and resumes from the one before).
    """
    from ringtrain.checkpoint.checkpoint import CheckpointLoadError

    directory = _layout(verified)
    checkpoint_engine = engine.checkpoint_engine
    original = checkpoint_engine.load
    checkpoint_engine.load = safe_load  # DeepSpeed's loads all go through its checkpoint engine
    try:
        path, _client = engine.load_checkpoint(
            directory,
            tag=TAG,
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
    except pickle.UnpicklingError as exc:
        lines = str(exc).strip().splitlines() or [""]
        why = next((ln.strip() for ln in lines if "WeightsUnpickler error" in ln), lines[0])
        raise CheckpointLoadError(uri, f"a DeepSpeed file: {why}") from exc
    finally:
        checkpoint_engine.load = original
    if path is None:
        raise ValueError(f"DeepSpeed found no checkpoint in {sorted(os.listdir(directory))}")


def consolidate(verified: str) -> dict[str, Any]:
    """The full fp32 model state dict of the ZeRO checkpoint in the verified copy ``verified``,
    in this process alone (DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``, with every
    ``torch.load`` made ``weights_only``)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    directory = _layout(verified)
    with weights_only_torch_load():
        state = get_fp32_state_dict_from_zero_checkpoint(directory, tag=TAG)
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
