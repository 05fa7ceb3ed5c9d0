"""In-memory TrainState snapshots.

A snapshot is what a disk checkpoint of a :class:`~ringtrain.TrainState` holds, kept in host
memory instead of written: the shared payload (model, optimizer, LR scheduler, ... , step, epoch,
extras; identical on every DDP rank, so any survivor's copy will do) and this rank's payload (its
RNG states, data position and per-rank model state). Tensors are copied into buffers the snapshot
owns and reuses from one snapshot to the next (:func:`~ringtrain.worker.state_files.stage`, as for
the payload a disk checkpoint writes), so a snapshot costs one host-memory copy of the state, no
serialisation, no storage I/O and no communication.

Nothing of a rank that dies is needed by the survivors: the shared payload is every survivor's
own, the data position in it is global (re-partitioned over the new world size on restore), each
survivor keeps its own RNG streams and per-rank state, and a worker that joins later receives the
shared payload and the data position by broadcast, and fresh RNG streams (:func:`joiner_rng`).
So no part of a snapshot is sent to a peer while training runs (an earlier version sent the
per-rank payload to the ring neighbour at every snapshot, which nothing read: 2-6 ms a step on
``benchmarks/elastic_overhead.py``'s workload). The one exception is a run with hot spares
(``ScalingConfig.spares``): a spare takes a lost rank's *number*, so it must continue that rank's
random streams for the run to stay bit-exact; there every snapshot gathers each rank's RNG states
(:func:`pack_rng`: 16 KB per rank, in the pause agreement's collective) and :func:`broadcast`
hands the lost rank's to the spare.

FSDP-sharded objects (``prepare_model(parallel_strategy="fsdp")`` on an elastic
``ParallelConfig(dp_replicate=-1, dp_shard=G)``: :mod:`ringtrain.config.replica_groups`) are kept as
this rank's local shards (:attr:`Snapshot.shards`: the ``DTensor.to_local()`` parts of the DCP
state dict). They are valid on the resized mesh because a survivor keeps its ``dp_shard``
coordinate; a worker that joins receives them from the member with the same coordinate in replica
group 0 (:func:`load_shards`, a broadcast over the mesh's ``dp_replicate`` group).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from fsspec.implementations.memory import MemoryFileSystem

from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.cluster.distributed import broadcast_state
from ringtrain.worker.session import get_context
from ringtrain.worker.state import TrainState
from ringtrain.worker.state_files import STATE_FILE, capture_rng, rank_file, restore_rng, stage

logger = logging.getLogger("ringtrain")


@dataclass
class Snapshot:
    """One rank's in-memory copy of a TrainState at a step boundary.

    Attributes:
        step: the ``TrainState.step`` it was taken at (steps).
        shared: the shared part of ``TrainState.to_payload()`` (``train_state.pt``'s content,
            host-memory tensors).
        rank: this rank's part (``rank_NNNNN.pt``'s content).
        shards: this rank's local shards of the FSDP-sharded objects (``{"model": ...,
            "optimizer": ...}``, the DCP state dict with every ``DTensor`` replaced by a copy of
            its local tensor; ``None``: nothing is sharded).
        peer_rng: every rank's RNG states at ``step`` (rank -> :func:`pack_rng`'s words),
            gathered with the pause agreement when hot spares may take a lost rank's place
            (``ElasticSettings.carry_rng``); ``None``: not gathered.
    """

    step: int
    shared: dict[str, Any]
    rank: dict[str, Any]
    shards: dict[str, Any] | None = None
    peer_rng: dict[int, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        """Host memory the snapshot's tensors occupy (bytes)."""
        return _tensor_bytes(self.shared) + _tensor_bytes(self.rank) + _tensor_bytes(self.shards)

    def files(self, rank: int) -> dict[str, Any]:
        """The snapshot as the TrainState payload of ``rank`` (``{file name: content}``)."""
        return {STATE_FILE: self.shared, rank_file(rank): self.rank}


def take(state: TrainState, previous: Snapshot | None) -> Snapshot:
    """Snapshot ``state`` (its payload with the shared part, on every rank), copying into
    ``previous``'s buffers when shapes match.

    The RNG states are kept as :func:`~ringtrain.worker.state_files.capture_rng` returns them (new
    objects it owns: nothing to copy); walking Python's 625-int state tuple element by element
    took a third of a snapshot's time on ``benchmarks/elastic_overhead.py``'s 1.86 M-parameter
    MLP.
    """
    rank = get_context().world_rank
    reuse = previous.files(rank) if previous is not None else {}
    payload = state.to_payload(shared=True)  # live tensors; staged below
    per_rank = dict(payload[rank_file(rank)])
    rng = per_rank.pop("rng", None)
    staged_rank = stage(per_rank, reuse.get(rank_file(rank)))
    if rng is not None:
        staged_rank["rng"] = rng
    shared = stage(payload[STATE_FILE], reuse.get(STATE_FILE))
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # stage() copied CUDA tensors with non_blocking=True
    return Snapshot(
        step=int(state.step),
        shared=shared,
        rank=staged_rank,
        shards=local_shards(state) if state.sharded else None,
    )


def _sharded_objects(state: TrainState) -> tuple[Any, Any]:
    """The FSDP model of ``state`` and its optimizer when that is sharded too (else None)."""
    return state["model"], state["optimizer"] if "optimizer" in state.sharded else None


def local_shards(state: TrainState) -> dict[str, Any]:
    """Copies of this rank's local shards of the FSDP-sharded objects of ``state`` (the DCP
    state dict, :func:`ringtrain.checkpoint.sharded.state_dict_of`, with each ``DTensor``
    replaced by a copy of its local tensor; no collective)."""
    from ringtrain.checkpoint.sharded import state_dict_of

    local: dict[str, Any] = _to_local(state_dict_of(*_sharded_objects(state)))
    return local


def load_shards(state: TrainState, shards: dict[str, Any] | None, from_peer: bool) -> None:
    """Load local ``shards`` (:func:`local_shards`) into the FSDP-sharded objects of ``state``,
    built on the current mesh with the same ``dp_shard`` coordinate (collective).

    Args:
        state: the TrainState being restored.
        shards: this rank's snapshot shards (``None`` on a worker that joins).
        from_peer: every rank takes the shards of the member with its ``dp_shard`` coordinate
            in replica group 0 (a broadcast over ``mesh["dp_replicate"]``): workers joined.

    Raises:
        ValueError: no shards to load, or a shard's shape differs from this rank's (the mesh's
            inner dimensions changed).
    """
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from ringtrain.checkpoint.sharded import _options, state_dict_of

    if from_peer:
        group = get_context().mesh["dp_replicate"].get_group()
        shards = broadcast_state(shards, 0, group)
    if shards is None:
        raise ValueError("elastic: this rank holds no in-memory shards of the FSDP state")
    model, optimizer = _sharded_objects(state)
    filled = _fill(state_dict_of(model, optimizer), shards, "")
    set_model_state_dict(model, filled["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, filled["optimizer"], options=_options(model))


def _to_local(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _to_local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_local(v) for v in value)
    return copy.deepcopy(value)


def _fill(current: Any, saved: Any, where: str) -> Any:
    """``saved`` laid into ``current``: a DTensor's local tensor is overwritten in place (so it
    keeps its mesh and placements), anything else is taken from ``saved``."""
    from torch.distributed.tensor import DTensor

    if isinstance(current, DTensor):
        local = current.to_local()
        if not isinstance(saved, torch.Tensor) or local.shape != saved.shape:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise ValueError(
                f"elastic: the snapshot's shard of {where or 'a tensor'} is {got}, this rank's "
                f"is {tuple(local.shape)} (the mesh's dp_shard/tp/pp sizes must not change)"
            )
        with torch.no_grad():
            local.copy_(saved)
        return current
    if isinstance(current, dict) and isinstance(saved, dict):
        return {k: _fill(current.get(k), v, f"{where}.{k}".lstrip(".")) for k, v in saved.items()}
    return saved


def broadcast(
    snapshot: Snapshot | None,
    source: int,
    rank: int,
    generation: int = 0,
    carry_rng: bool = False,
) -> Snapshot:
    """Make every rank of the (new) default process group hold ``source``'s snapshot: its shared
    payload and its data position (global, re-partitioned over the new world size on restore).
    Each rank keeps its own RNG streams; a rank without a snapshot (a worker that joins) gets
    fresh ones from :func:`joiner_rng`. Used after a resize when the members' newest snapshots
    differ, and when workers join.

    Args:
        snapshot: this rank's snapshot (``None``: it has none).
        source: the rank whose snapshot everyone takes.
        rank: this rank.
        generation: the group generation being formed (seeds a joiner's RNG streams).
        carry_rng: the run gathers every rank's RNG states (hot spares): the source says so
            when its snapshot holds none (a peer was lost mid-gather).

    Raises:
        ValueError: if ``source`` itself has no snapshot.
    """
    sent: dict[str, Any] | None = None
    if rank == source:
        if snapshot is None:
            raise ValueError(f"rank {source} was chosen as the snapshot source but has none")
        sent = {"step": snapshot.step, "shared": snapshot.shared, "rank": snapshot.rank}
        sent["peer_rng"] = snapshot.peer_rng
        if carry_rng and snapshot.peer_rng is None:
            logger.warning(
                "elastic: the snapshot of step %d holds no gathered random streams (a peer was "
                "lost while they were gathered); a worker that takes a lost rank's place starts "
                "fresh ones (a run with per-rank randomness is not bit-exact from here)",
                snapshot.step,
            )
    box = broadcast_state(sent, source)  # not a pickle: gloo is not authenticated
    step, shared, source_rank = box["step"], box["shared"], box["rank"]
    if rank == source:
        assert snapshot is not None
        return snapshot
    if snapshot is not None:
        mine = dict(snapshot.rank)
    else:
        mine = dict(source_rank)
        mine["rng"] = _carried_rng(box.get("peer_rng"), rank, step)
        if mine["rng"] is None:
            mine["rng"] = joiner_rng(source_rank.get("rng"), rank, generation)
    mine["data_loader"] = source_rank.get("data_loader")
    mine["step"] = step
    # A member keeps its own FSDP shards (of the same step: the members paused together).
    shards = snapshot.shards if snapshot is not None and snapshot.step == step else None
    return Snapshot(step=int(step), shared=shared, rank=mine, shards=shards)


RNG_WORDS = 2048
"""The int64 words :func:`pack_rng` fills (16 KB): the CPU streams of Python (625 words plus 3),
NumPy (624 plus 4) and torch (5,056 bytes: 632 words) with a 6-word header, padded."""


def pack_rng(rng: dict[str, Any]) -> torch.Tensor:
    """``rng`` (:func:`~ringtrain.worker.state_files.capture_rng`'s CPU streams) as
    :data:`RNG_WORDS` int64 words, so that every rank's fit one all-gather without a pickle;
    all zeros (word 0 is 0: nothing to carry) when it holds more (CUDA streams) or does not
    fit."""
    out = torch.zeros(RNG_WORDS, dtype=torch.int64)
    if set(rng) != {"python", "numpy", "torch"} or not isinstance(rng["torch"], torch.Tensor):
        return out
    py, npy, cpu = rng["python"], rng["numpy"], rng["torch"]
    version, words, gauss = py
    cpu_bytes = cpu.detach().to(torch.uint8).flatten()
    pad = (-cpu_bytes.numel()) % 8
    cpu_words = torch.cat([cpu_bytes, torch.zeros(pad, dtype=torch.uint8)]).view(torch.int64)
    header = [1, int(version), len(words), int(npy["key"].numel()), cpu_bytes.numel(), 0]
    tail = [
        *words,
        int(gauss is not None),
        _float_bits(gauss or 0.0),
        int(npy["pos"]),
        int(npy["has_gauss"]),
        _float_bits(float(npy["gauss"])),
    ]
    body = torch.cat(
        [torch.tensor(header + tail, dtype=torch.int64), npy["key"].to(torch.int64), cpu_words]
    )
    if body.numel() > RNG_WORDS or npy["bit_generator"] != "MT19937":
        return out
    out[: body.numel()] = body
    return out


def unpack_rng(words: torch.Tensor) -> dict[str, Any] | None:
    """The RNG states :func:`pack_rng` packed into ``words`` (``None``: it carried none).

    Raises:
        ValueError: ``words`` do not hold :func:`pack_rng`'s layout.
    """
    w = words.to(torch.int64).flatten()
    if w.numel() < 6 or int(w[0]) == 0:
        return None
    version, n_py, n_key, n_cpu = (int(v) for v in w[1:5])
    start = 6 + n_py + 5
    end = start + n_key + (n_cpu + 7) // 8
    if int(w[0]) != 1 or min(n_py, n_key, n_cpu) < 0 or end > w.numel():
        raise ValueError("elastic: the gathered RNG states are not in pack_rng's layout")
    py = w[6 : 6 + n_py].tolist()
    has_gauss_py, gauss_py, pos, has_gauss, gauss = w[6 + n_py : start].tolist()
    cpu = w[start + n_key : end].clone().view(torch.uint8)[:n_cpu]
    return {
        "python": (version, tuple(py), _bits_float(gauss_py) if has_gauss_py else None),
        "numpy": {
            "bit_generator": "MT19937",
            "key": w[start : start + n_key].clone(),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": _bits_float(gauss),
        },
        "torch": cpu.clone(),
    }


def _float_bits(value: float) -> int:
    return int(torch.tensor([value], dtype=torch.float64).view(torch.int64).item())


def _bits_float(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64).item())


def _carried_rng(table: Any, rank: int, step: int) -> dict[str, Any] | None:
    """The RNG states rank ``rank`` had at ``step`` (from the table the snapshot gathered:
    :attr:`Snapshot.peer_rng`), for the worker that takes its place; ``None`` when the table
    does not hold them (no spares, a rank beyond the old group: a grow; a gather cut short by a
    lost peer, CUDA streams: said in a warning)."""
    words = table.get(rank) if isinstance(table, dict) else None
    carried = unpack_rng(words) if isinstance(words, torch.Tensor) else None
    if carried is None and isinstance(table, dict) and rank in table:  # not a grow's new rank
        logger.warning(
            "elastic: rank %d's random streams at step %d were not gathered; the worker taking "
            "its place starts fresh ones (a run with per-rank randomness is not bit-exact from "
            "here)",
            rank,
            step,
        )
    return carried


def joiner_rng(source_rng: Any, rank: int, generation: int) -> dict[str, Any]:
    """Fresh RNG streams (Python, NumPy, torch, CUDA when in use) for a worker that joins a
    running group as ``rank``: seeded from a hash of the source rank's torch RNG state, the new
    rank and the generation, so they follow the run's own seed, differ from every other rank's
    and are the same when the run is repeated. (A dead rank's streams are not kept: they
    would be stale by the time capacity returns and would not map to a new rank number.)
    """
    digest = hashlib.sha256(f"ringtrain-join/{rank}/{generation}/".encode())
    state = source_rng.get("torch") if isinstance(source_rng, dict) else None
    if isinstance(state, torch.Tensor):
        digest.update(state.numpy().tobytes())
    seed = int.from_bytes(digest.digest()[:8], "little") >> 1
    saved = capture_rng()
    try:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)  # also seeds every CUDA device
        return capture_rng()
    finally:
        restore_rng(saved)


class SnapshotCheckpoint(Checkpoint):
    """What ``get_checkpoint()`` returns after an elastic resize: ``TrainState.restore()`` reads
    ``in_memory_files`` instead of storage. ``path`` is a label, not a place on storage.

    Args:
        snapshot: the snapshot every rank of the new group holds (same ``step``).
        rank: this worker's rank in the new group.
    """

    def __init__(self, snapshot: Snapshot, rank: int, shards_from_peer: bool = False) -> None:
        super().__init__(f"/ringtrain-elastic-snapshot/step_{snapshot.step}", MemoryFileSystem())
        self.snapshot = snapshot
        self.shards_from_peer = shards_from_peer
        # "elastic": a resize keeps the math (constant global batch); no bit-exactness warning.
        self.in_memory_files: dict[str, Any] = {
            **snapshot.files(rank),
            STATE_FILE: {**snapshot.shared, "elastic": True},
        }

    @property
    def uri(self) -> str:
        return f"elastic-snapshot://step_{self.snapshot.step}"

    def restore_sharded(self, state: TrainState) -> None:
        """Load the snapshot's FSDP shards into ``state`` (:func:`load_shards`; collective)."""
        load_shards(state, self.snapshot.shards, self.shards_from_peer)


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0
