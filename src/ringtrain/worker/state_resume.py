"""This rank's share of a :class:`~ringtrain.worker.state.TrainState` payload when it is loaded: its
per-rank file and the data loader position to restore, converted when the checkpoint was saved
at another world size (elastic resize, or a restart with fewer or more workers) or on another
device mesh (the data-parallel shards changed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from ringtrain.worker.session import get_context
from ringtrain.worker.state_files import rank_file, require_layout, reshard_loader_state

logger = logging.getLogger("ringtrain")

PayloadReader = Callable[[str], Any]
"""Reads one file of a payload by name (``None`` when the payload has no such file)."""


def payload_reader(source: Mapping[str, Any] | PayloadReader) -> PayloadReader:
    """``source`` as a reader: a ``{file name: content}`` mapping's ``get``, or the reader."""
    if isinstance(source, Mapping):
        return source.get
    return source


def rank_part(
    read: PayloadReader, shared: Mapping[str, Any], source: str, data_loader: Any
) -> tuple[dict[str, Any], Any]:
    """This rank's payload and the data position to load into ``data_loader``.

    Args:
        read: the payload's reader; ``shared`` its shared file (``world_size``, ``elastic``).
        source: where the payload comes from, for messages.
        data_loader: the TrainState's loader, or ``None``.

    Returns:
        this rank's per-rank payload (``{"rng": None}`` for a rank the checkpoint did not
        have) and the loader state, converted to this world size or mesh when it changed.

    Raises:
        ValueError: the checkpoint has no file for this rank at the same world size.
    """
    rank = get_context().world_rank
    per_rank = read(rank_file(rank))
    if per_rank is not None:
        require_layout(source, rank_file(rank), per_rank, ("rng",))
    saved_world = int(shared.get("world_size") or 1)
    world = get_context().world_size
    if per_rank is None and saved_world == world:
        raise ValueError(
            f"{source} has no {rank_file(rank)}: it was saved by "
            f"{shared.get('world_size')} workers, this run has {world}"
        )
    loader_state = (per_rank or {}).get("data_loader")
    if saved_world != world and not shared.get("elastic"):
        logger.warning(
            "resuming a checkpoint of %d workers with %d: not bit-exact (the data position "
            "is converted to the new world size; ranks >= %d keep their own RNG streams)",
            saved_world,
            world,
            saved_world,
        )
    if saved_world != world:
        if loader_state is None:  # a new rank: every rank has consumed the same samples
            loader_state = (read(rank_file(0)) or {}).get("data_loader")
        if loader_state is not None and data_loader is not None:
            loader_state = reshard_loader_state(loader_state, data_loader)
        per_rank = per_rank or {"rng": None}
    elif loader_state is not None and _sharded_otherwise(loader_state, data_loader):
        # Same world size, another device mesh: the data-parallel shards changed.
        loader_state = reshard_loader_state(loader_state, data_loader)
    return dict(per_rank), loader_state


def _sharded_otherwise(loader_state: Mapping[str, Any], loader: Any) -> bool:
    """Whether ``loader`` shards the data over another number of data-parallel ranks, or with
    another per-rank batch, than the loader ``loader_state`` was saved from (a checkpoint of
    the same world size on another device mesh: ``dp_shard=2 x tp=2`` resumed at
    ``dp_shard=4``)."""
    if loader is None or not hasattr(loader, "world_size"):
        return False
    saved = (loader_state.get("world_size"), loader_state.get("batch_size"))
    return saved != (loader.world_size, getattr(loader, "batch_size", None))
