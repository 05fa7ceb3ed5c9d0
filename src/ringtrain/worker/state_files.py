"""The files of a :class:`~ringtrain.TrainState` checkpoint and what fills them: the file names,
the checks of what a ``weights_only`` file can hold, RNG capture and restore, staging to host
memory, the per-rank state attached to a prepared model, and the verified, weights-only loading of
a file (``ringtrain.worker.state`` builds and loads the payload; docs/run-directory.md has the
layout).
"""

from __future__ import annotations

import io
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ringtrain.checkpoint.checkpoint import Checkpoint, CheckpointLoadError
from ringtrain.checkpoint.plain import find_unsavable, weights_only_refusal
from ringtrain.checkpoint.sharded import METADATA

logger = logging.getLogger("ringtrain")

STATE_FILE = "train_state.pt"
"""The shared file, written by rank 0: model, optimizer, ..., step, epoch, extras."""
FORMAT = 1


@runtime_checkable
class PayloadCheckpoint(Protocol):
    """A checkpoint held in memory as a TrainState payload (``{file name: content}``, what
    :meth:`ringtrain.TrainState.to_payload` returns), not on storage: an elastic snapshot."""

    in_memory_files: Mapping[str, Any]


def rank_file(rank: int) -> str:
    """The per-rank file of ``rank`` in a TrainState checkpoint."""
    return f"rank_{rank:05d}.pt"


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` has callable ``state_dict`` and ``load_state_dict``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


RANK_STATE_ATTR = "_ringtrain_rank_state"
PENDING_ATTR = "_ringtrain_pending_rank_state"


def attach_rank_state(model: Any, name: str, obj: Any) -> None:
    """Attach a Stateful ``obj`` that differs across ranks to a prepared ``model`` (a
    communication hook's state, a gradient accumulation counter): a TrainState holding the model
    saves ``obj.state_dict()`` in each rank's file and restores it on resume. An object attached
    after ``TrainState.restore()`` gets the restored state when it is attached."""
    target = unwrap(model)
    target.__dict__.setdefault(RANK_STATE_ATTR, {})[name] = obj
    pending = target.__dict__.get(PENDING_ATTR) or {}
    if name in pending:
        obj.load_state_dict(pending.pop(name))


def model_rank_state(model: Any) -> dict[str, Any]:
    """The per-rank Stateful objects attached to ``model`` (:func:`attach_rank_state`)."""
    if model is None:
        return {}
    return dict(getattr(unwrap(model), RANK_STATE_ATTR, None) or {})


def unwrap(model: Any) -> Any:
    """``model.module`` of a DDP-wrapped model, else ``model``."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def stage(value: Any, reuse: Any = None) -> Any:
    """A copy of ``value`` whose tensors live in host memory the caller owns: safe to write from
    another thread while training goes on mutating the originals.

    ``reuse`` is the previous staged copy (its write has finished): a tensor of the same shape and
    dtype is copied into in place instead of allocated, which is most of the cost of staging
    (fresh pages must be faulted in and zeroed). CUDA tensors are copied into pinned buffers with
    ``non_blocking=True``; the caller synchronises once at the end.
    """
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == t.shape
            and reuse.dtype == t.dtype
            and reuse.device.type == "cpu"
            and reuse.layout == t.layout == torch.strided
        ):
            return reuse.copy_(t, non_blocking=t.is_cuda)
        if t.device.type == "cpu":
            return t.clone()
        if t.is_cuda and t.layout == torch.strided:
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return buffer.copy_(t, non_blocking=True)
        return t.to("cpu")
    if isinstance(value, OrderedDict):
        old = reuse if isinstance(reuse, dict) else {}
        staged = OrderedDict((k, stage(v, old.get(k))) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:  # module versions, kept by a module's state_dict()
            staged._metadata = metadata  # type: ignore[attr-defined]
        return staged
    if isinstance(value, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: stage(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old_seq = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(value) else None
        items = [stage(v, old_seq[i] if old_seq else None) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: Python, NumPy (legacy global), torch CPU, CUDA (if used)."""
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)
    key = np_state["state"]["key"]
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the RNG states :func:`capture_rng` returned."""
    random.setstate(_as_tuple(rng["python"]))
    n = rng["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
            "has_gauss": int(n["has_gauss"]),
            "gauss": float(n["gauss"]),
        }
    )
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d; "
                "CUDA RNG not restored",
                len(states),
                torch.cuda.device_count(),
            )


def _as_tuple(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def torch_writer(obj: Any) -> Callable[[Any], None]:
    """A writer that saves ``obj`` with ``torch.save`` into the file object it is given."""
    return lambda f: torch.save(obj, f)


def is_dcp_file(name: str) -> bool:
    """Whether ``name`` is a file of a ``torch.distributed.checkpoint`` save (sharded state)."""
    return name == METADATA or name.endswith(".distcp")


def reshard_loader_state(state: dict[str, Any], loader: Any) -> dict[str, Any]:
    """A data loader position saved at another world size (or per-rank batch size), converted
    for ``loader``: the same global sample offset into the same epoch's shuffle order (which
    depends only on the seed and the epoch), rounded down to a whole global batch of the new
    run. A loader that is not a ringtrain ``PreparedDataLoader`` gets ``state`` unchanged.
    """
    world = getattr(loader, "world_size", None)
    batch_size = getattr(loader, "batch_size", None)
    if world is None or not batch_size or "samples" not in state:
        return state
    per_step = world * batch_size
    samples = int(state["samples"])
    if samples >= len(loader.dataset):  # the saved epoch was consumed to its end
        batch = len(loader)
    else:
        batch = samples // per_step
        if samples % per_step:
            logger.warning(
                "data position %d is not a multiple of the new global batch (%d workers x %d): "
                "resuming at sample %d of the epoch (%d samples are seen again)",
                samples,
                world,
                batch_size,
                batch * per_step,
                samples - batch * per_step,
            )
    return {
        **state,
        "batch": batch,
        "samples": min(batch * per_step, samples),
        "world_size": world,
        "batch_size": batch_size,
    }


def load_file(ckpt: Checkpoint, name: str) -> Any:
    """File ``name`` of ``ckpt``, or None when its manifest does not list it.

    The bytes are read once, checked against the manifest's size and SHA-256, and only then
    given to ``torch.load(weights_only=True)``: nothing can change between the check and the
    load, and a file that is not listed is never read.

    Raises:
        CheckpointLoadError: the manifest is missing or unsigned, the file is listed but unsafe
            or altered, or ``torch.load`` refuses its content.
    """
    if isinstance(ckpt, PayloadCheckpoint):  # held in memory (an elastic snapshot)
        return ckpt.in_memory_files.get(name)
    try:
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            # Copied and hashed in one pass into a private in-memory file, then memory-mapped:
            # the bytes are held once (no buffer beside the tensors made from it).
            fd = ckpt.verified_fd(name)
            if fd is None:
                return None
            try:
                return torch.load(
                    f"/proc/self/fd/{fd}", weights_only=True, map_location="cpu", mmap=True
                )
            finally:
                os.close(fd)
        data = ckpt.read_file(name)
        if data is None:
            return None
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except CheckpointLoadError:
        raise
    except Exception as exc:
        raise CheckpointLoadError(ckpt.uri, f"{name}: {weights_only_refusal(exc)}") from exc


def require_layout(source: str, name: str, payload: Any, keys: tuple[str, ...]) -> None:
    """Refuse a loaded file whose layout is not a TrainState file's: a checkpoint that loads
    but holds the wrong thing is as unloadable as a corrupt one."""
    if not isinstance(payload, dict) or any(k not in payload for k in keys):
        raise CheckpointLoadError(
            source, f"{name} does not hold a TrainState (expected a dict with {list(keys)})"
        )


def registration_problem(name: str, obj: Any, named: tuple[str, ...]) -> str | None:
    """Why a TrainState cannot save ``obj`` registered as ``name`` (None: it can); ``named``:
    the constructor's named slots (model, optimizer...), which must be Stateful."""
    if isinstance(obj, torch.utils.data.DataLoader):
        return (
            f"{name}: a torch DataLoader has no saved position; pass the loader "
            "returned by ringtrain.prepare_data_loader()"
        )
    if is_stateful(obj):
        target = unwrap(obj) if name == "model" else obj
        try:
            found = find_unsavable(target.state_dict(), f"{name}.state_dict()")
        except Exception as exc:  # a state_dict() that cannot even be built
            found = f"{name}.state_dict() raised {type(exc).__name__}: {exc}"
        return f"{name}: {found}, which a weights_only checkpoint cannot hold" if found else None
    if name in named:
        return f"{name}: a {type(obj).__name__} has no state_dict()/load_state_dict()"
    found = find_unsavable(obj, name)
    if found:
        return (
            f"{name}: {found}; extras must be Stateful (state_dict/load_state_dict) "
            "or plain values (numbers, strings, tensors, lists and dicts of them)"
        )
    return None
