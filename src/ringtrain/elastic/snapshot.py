"""In-memory TrainState snapshots, replicated to the ring neighbour.

A snapshot is what a disk checkpoint of a :class:`~ringtrain.TrainState` holds, kept in host
memory instead of written: the shared payload (model, optimizer, LR scheduler, ... , step, epoch,
extras; identical on every DDP rank, so any survivor's copy will do) and this rank's payload (its
RNG states, data position and per-rank model state). Tensors are copied into buffers the snapshot
owns and reuses from one snapshot to the next (``TrainState.to_payload(staged=True)``, the payload
a disk checkpoint writes), so a snapshot costs one host-memory copy of the state, no serialisation
and no storage I/O.

The per-rank payload is also sent to the next rank of the ring (rank ``r`` keeps the payload of
rank ``r - 1 mod W``), so the RNG streams and data position of a rank that dies are still held by
a live process. A worker that joins later receives the shared payload and the (global) data
position by broadcast, and fresh RNG streams (:func:`joiner_rng`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from fsspec.implementations.memory import MemoryFileSystem

from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.session import get_context
from ringtrain.state import TrainState
from ringtrain.state_files import STATE_FILE, capture_rng, rank_file, restore_rng

logger = logging.getLogger("ringtrain")


@dataclass
class Snapshot:
    """One rank's in-memory copy of a TrainState at a step boundary.

    Attributes:
        step: the ``TrainState.step`` it was taken at (steps).
        shared: the shared part of ``TrainState.to_payload()`` (``train_state.pt``'s content,
            host-memory tensors).
        rank: this rank's part (``rank_NNNNN.pt``'s content).
        neighbour_rank: the rank whose per-rank payload ``neighbour`` is (``None``: none yet).
        neighbour: that rank's per-rank payload, serialised with ``torch.save`` (bytes).
    """

    step: int
    shared: dict[str, Any]
    rank: dict[str, Any]
    neighbour_rank: int | None = None
    neighbour: bytes | None = None

    @property
    def nbytes(self) -> int:
        """Host memory the snapshot's tensors occupy (bytes)."""
        return _tensor_bytes(self.shared) + _tensor_bytes(self.rank) + len(self.neighbour or b"")

    def files(self, rank: int) -> dict[str, Any]:
        """The snapshot as the TrainState payload of ``rank`` (``{file name: content}``)."""
        return {STATE_FILE: self.shared, rank_file(rank): self.rank}


def take(state: TrainState, previous: Snapshot | None) -> Snapshot:
    """Snapshot ``state`` (its payload with the shared part, on every rank), copying into
    ``previous``'s buffers when shapes match."""
    rank = get_context().world_rank
    reuse = previous.files(rank) if previous is not None else None
    payload = state.to_payload(shared=True, staged=True, reuse=reuse)
    return Snapshot(step=int(state.step), shared=payload[STATE_FILE], rank=payload[rank_file(rank)])


def replicate_to_neighbour(snapshot: Snapshot, rank: int, world_size: int) -> None:
    """Send this rank's per-rank payload to rank ``rank + 1`` and keep rank ``rank - 1``'s
    (two point-to-point exchanges over the default process group: sizes, then bytes).

    Raises:
        RuntimeError: from the collective when a peer is lost (the caller's elastic handling
            takes over; the snapshot's own parts are already complete).
    """
    if world_size < 2:
        return
    buffer = io.BytesIO()
    torch.save(snapshot.rank, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
    size_out = torch.tensor([data.numel()], dtype=torch.int64)
    size_in = torch.zeros(1, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, size_out, nxt), dist.P2POp(dist.irecv, size_in, prev)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    incoming = torch.empty(int(size_in.item()), dtype=torch.uint8)
    ops = [dist.P2POp(dist.isend, data, nxt), dist.P2POp(dist.irecv, incoming, prev)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    snapshot.neighbour_rank = prev
    snapshot.neighbour = incoming.numpy().tobytes()


def neighbour_payload(snapshot: Snapshot) -> dict[str, Any] | None:
    """The ring predecessor's per-rank payload held by ``snapshot`` (``None``: none)."""
    if snapshot.neighbour is None:
        return None
    loaded = torch.load(io.BytesIO(snapshot.neighbour), weights_only=True)
    return loaded if isinstance(loaded, dict) else None


def broadcast(snapshot: Snapshot | None, source: int, rank: int, generation: int = 0) -> Snapshot:
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

    Raises:
        ValueError: if ``source`` itself has no snapshot.
    """
    box: list[Any] = [None]
    if rank == source:
        if snapshot is None:
            raise ValueError(f"rank {source} was chosen as the snapshot source but has none")
        box = [(snapshot.step, snapshot.shared, snapshot.rank)]
    dist.broadcast_object_list(box, src=source)
    step, shared, source_rank = box[0]
    if rank == source:
        assert snapshot is not None
        return snapshot
    if snapshot is not None:
        mine = dict(snapshot.rank)
    else:
        mine = dict(source_rank)
        mine["rng"] = joiner_rng(source_rank.get("rng"), rank, generation)
    mine["data_loader"] = source_rank.get("data_loader")
    mine["step"] = step
    return Snapshot(step=int(step), shared=shared, rank=mine)


def joiner_rng(source_rng: Any, rank: int, generation: int) -> dict[str, Any]:
    """Fresh RNG streams (Python, NumPy, torch, CUDA when in use) for a worker that joins a
    running group as ``rank``: seeded from a hash of the source rank's torch RNG state, the new
    rank and the generation, so they follow the run's own seed, differ from every other rank's
    and are the same when the run is repeated. (A dead rank's streams, held by its ring
    neighbour, are stale by the time capacity returns and would not map to a new rank number.)
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

    def __init__(self, snapshot: Snapshot, rank: int) -> None:
        super().__init__(f"/ringtrain-elastic-snapshot/step_{snapshot.step}", MemoryFileSystem())
        self.snapshot = snapshot
        # "elastic": a resize keeps the math (constant global batch); no bit-exactness warning.
        self.in_memory_files: dict[str, Any] = {
            **snapshot.files(rank),
            STATE_FILE: {**snapshot.shared, "elastic": True},
        }

    @property
    def uri(self) -> str:
        return f"elastic-snapshot://step_{self.snapshot.step}"


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0
