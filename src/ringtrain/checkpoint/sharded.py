"""Sharded checkpoints of FSDP models with ``torch.distributed.checkpoint`` (DCP).

A sharded model and its optimizer are saved as one DCP checkpoint inside the ordinary checkpoint
directory, beside ``train_state.pt`` and the ``rank_NNNNN.pt`` files:

- ``__{r}_0.distcp``: the tensors rank ``r`` holds (its shards of every parameter and of every
  optimizer state tensor; replicated values, such as Adam's step counters, once);
- ``.metadata``: written by rank 0 once all ranks are done: for every tensor, its global shape
  and which byte range of which file holds which slice of it.

Loading reads, on each rank, exactly the slices that rank's new shards cover, from whichever
files hold them: a checkpoint saved by W ranks loads at any world size (resharding).

How the files reach the run directory: DCP writes each rank's files into a local temporary
directory (synchronously, or with ``dcp.async_save`` on a dedicated gloo process group while
training goes on), and ringtrain's own checkpoint writer then copies them into the round's
staging directory like any other checkpoint file: hashed while copied, retried on transient
storage errors, listed in the manifest with size and SHA-256, published by the atomic rename,
on any fsspec storage. DCP never writes into the run directory itself.

Loading never runs code from the checkpoint: DCP reads ``.metadata`` with plain ``pickle`` and
non-tensor values with ``torch.load(weights_only=False)``; the reader and planners here replace
both: ``.metadata`` with :func:`ringtrain.checkpoint.dcp_metadata.load_metadata` (an exact
``(module, qualname)`` allow-list, checked calls, data files confined to the checkpoint
directory), values with ``torch.load(weights_only=True)``. Tensors DCP itself reads with
``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ringtrain.checkpoint.dcp_metadata import load_metadata

METADATA = ".metadata"


def rank_files(rank: int) -> list[str]:
    """The DCP files rank ``rank`` writes (one data file per rank; rank 0 also the metadata)."""
    files = [f"__{rank}_0.distcp"]
    if rank == 0:
        files.append(METADATA)
    return files


# ------------------------------------------------------------------------------ safe loading


def _safe_reader(path: str, fsspec_url: bool) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.storage import StorageReader

    base: type[StorageReader] = FsspecReader if fsspec_url else FileSystemReader

    class SafeReader(base):  # type: ignore[valid-type,misc]
        """DCP's reader, but ``.metadata`` is read by :func:`load_metadata`, never ``pickle``
        (parsed once per path: :func:`_reader_for` checks it before DCP reads it again)."""

        _parsed: tuple[Any, Any] | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            if self._parsed is None or self._parsed[0] != meta_path:
                with self.fs.create_stream(meta_path, "rb") as f:
                    self._parsed = (meta_path, load_metadata(f.read()))
            metadata = self._parsed[1]
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)


def _weights_only(planner_cls: type) -> type:
    class SafePlanner(planner_cls):
        """Reads non-tensor values (step counts, hyperparameters) with ``weights_only=True``."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(
                    self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded
                )
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafePlanner


@contextlib.contextmanager
def _refusals_surface() -> Iterator[None]:
    """DCP wraps whatever a rank raised while loading in a ``CheckpointException``, which is a
    ``BaseException`` that ``except Exception`` misses: re-raise a refusal to unpickle (our
    reader's or ``weights_only``'s) as the ``pickle.UnpicklingError`` it is."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, pickle.UnpicklingError):
                raise pickle.UnpicklingError(f"checkpoint refused: {inner}") from exc
        raise


def _reader_for(location: str, filesystem: Any = None) -> Any:
    """A safe DCP reader of the checkpoint directory ``location`` (a local path, or with a
    non-local ``filesystem`` a path on it).

    Raises:
        pickle.UnpicklingError: the metadata refers to anything but DCP's metadata classes.
        FileNotFoundError: there is no ``.metadata``.
    """
    from ringtrain.checkpoint.storage import is_local_fs

    if filesystem is None or is_local_fs(filesystem):
        reader = _safe_reader(location, fsspec_url=False)
    else:
        reader = _safe_reader(str(filesystem.unstrip_protocol(location)), fsspec_url=True)
    # DCP would catch a refusal and report only that no metadata was found: check it here.
    reader.read_metadata()
    return reader


def has_sharded_state(fs: Any, ckpt_path: str) -> bool:
    """Whether the checkpoint directory holds a DCP checkpoint."""
    return bool(fs.exists(ckpt_path.rstrip("/") + "/" + METADATA))


# ------------------------------------------------------------------------------------ saving


def save_to_local(
    state_dict: dict[str, Any], rank: int, async_group: Any = None
) -> tuple[str, Callable[[], None]]:
    """Save ``state_dict`` (collective: every rank calls it) into a fresh local directory.

    Args:
        state_dict: DCP state dict (``DTensor`` shards and plain values).
        rank: this rank (names the files it writes).
        async_group: a gloo process group for ``dcp.async_save``'s collectives, which run on a
            background thread; ``None`` saves synchronously.

    Returns:
        ``(directory, wait)``: ``wait()`` blocks until this rank's files (and on rank 0 the
        metadata) are complete, and raises what the save raised.
    """
    import torch.distributed.checkpoint as dcp

    directory = tempfile.mkdtemp(prefix=f"ringtrain_dcp_r{rank}_")
    writer = dcp.FileSystemWriter(
        directory, single_file_per_rank=True, sync_files=False, thread_count=1, overwrite=True
    )
    if async_group is None:
        dcp.save(state_dict, storage_writer=writer)
        return directory, lambda: None
    response = dcp.async_save(state_dict, storage_writer=writer, process_group=async_group)
    future: Any = getattr(response, "upload_completion", response)
    return directory, lambda: future.result()


def file_writers(
    directory: str, rank: int, wait: Callable[[], None]
) -> dict[str, Callable[[Any], None]]:
    """``name -> writer(file)`` that copies this rank's DCP files out of ``directory`` (after
    ``wait()``), for :func:`ringtrain.checkpoint.writer.write_files`; the last one removes
    ``directory``."""
    names = rank_files(rank)

    def copier(name: str, last: bool) -> Callable[[Any], None]:
        def write(out: Any) -> None:
            wait()
            path = os.path.join(directory, name)
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"torch.distributed.checkpoint did not write {name} on rank {rank} (found "
                    f"{sorted(os.listdir(directory)) if os.path.isdir(directory) else 'nothing'})"
                )
            with open(path, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 20)
            if last:
                shutil.rmtree(directory, ignore_errors=True)

        return write

    return {name: copier(name, i == len(names) - 1) for i, name in enumerate(names)}


# ----------------------------------------------------------------------------------- loading


def load_into(state_dict: dict[str, Any], location: str, filesystem: Any = None) -> None:
    """Fill ``state_dict`` (DCP layout: ``DTensor`` shards for this rank, plain tensors) in place
    from the DCP checkpoint in directory ``location`` (collective when a process group is
    initialised). Resharding happens here: the saved world size does not matter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    with _refusals_surface():
        dcp.load(
            state_dict,
            storage_reader=_reader_for(location, filesystem),
            planner=_weights_only(DefaultLoadPlanner)(),
        )


def load_full(location: str, filesystem: Any = None) -> dict[str, Any]:
    """Everything in the DCP checkpoint at ``location``, consolidated into full (unsharded) CPU
    tensors, in this process alone (no process group needed)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with _refusals_surface():
        _load_state_dict(
            state,
            storage_reader=_reader_for(location, filesystem),
            planner=_weights_only(_EmptyStateDictLoadPlanner)(),
            no_dist=True,
        )
    return state


# ------------------------------------------------------------------------- TrainState support


def is_sharded_module(obj: Any) -> bool:
    """Whether ``obj`` is a module with ``DTensor`` parameters (sharded by ``fully_shard``)."""
    if not isinstance(obj, torch.nn.Module):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in obj.parameters())


def is_sharded_optimizer(obj: Any) -> bool:
    """Whether ``obj`` is an optimizer over ``DTensor`` parameters."""
    if not isinstance(obj, torch.optim.Optimizer):
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for g in obj.param_groups for p in g["params"])


def sharded_objects(objects: dict[str, Any]) -> tuple[set[str], list[str]]:
    """Which of a TrainState's objects are saved with DCP, and what is wrong with them.

    Returns:
        ``(names, problems)``: ``names`` is ``{"model"}`` or ``{"model", "optimizer"}`` for an
        FSDP model (and its optimizer), else empty; ``problems`` explains each object that
        cannot be saved: another sharded object, an optimizer over sharded parameters without
        its model, or an FSDP model whose optimizer was built before sharding.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return set(), []  # no device mesh, so no DTensor
    names: set[str] = set()
    problems: list[str] = []
    # A pipelined model (ringtrain.parallel.pipeline): each rank holds other stages.
    pipelined = getattr(objects.get("model"), "saves_with_dcp", False) is True
    for name, obj in objects.items():
        sharded = is_sharded_module(obj) or is_sharded_optimizer(obj)
        sharded = sharded or (pipelined and name in ("model", "optimizer"))
        if name in ("model", "optimizer") and sharded:
            names.add(name)
        elif sharded:
            problems.append(
                f"{name}: a sharded (FSDP) object; only model= and optimizer= may be sharded "
                "(they are saved together with torch.distributed.checkpoint)"
            )
    if "optimizer" in names and "model" not in names:
        problems.append(
            "optimizer: it holds sharded (FSDP) parameters, whose state is saved by parameter "
            "name: register the FSDP model too, TrainState(model=model, optimizer=optimizer)"
        )
    if "model" in names and "optimizer" in objects and "optimizer" not in names:
        opt = objects["optimizer"]
        if isinstance(opt, torch.optim.Optimizer):
            problems.append(
                "optimizer: it was built over the model's parameters before sharding (they are "
                "no longer the model's): build it after prepare_model(parallel_strategy='fsdp')"
            )
    return names, problems


def state_dict_of(model: Any, optimizer: Any = None) -> dict[str, Any]:
    """The DCP state dict ``{"model": ..., "optimizer": ...}`` of an FSDP model (keys are
    parameter names, values this rank's ``DTensor`` shards) and its optimizer (state keyed by
    parameter name, so that it reshards)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=_options(model))
    return state


def _options(model: Any) -> Any:
    """A pipelined model's optimizer state is keyed by parameter name throughout (its
    param_groups too): each pp rank's groups hold other parameters, which DCP would otherwise
    save once under the same key (torchtitan's choice for pipelines)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    pipelined = getattr(model, "saves_with_dcp", False) is True
    return StateDictOptions(flatten_optimizer_state_dict=pipelined)


def restore_objects(model: Any, optimizer: Any, location: str, filesystem: Any = None) -> None:
    """Load an FSDP model (and optimizer) from the DCP checkpoint in ``location``, at whatever
    world size it was saved (collective)."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = state_dict_of(model, optimizer)
    load_into(state, location, filesystem)
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=_options(model))
