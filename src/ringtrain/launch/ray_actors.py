"""The Ray backend's small shared pieces: importing Ray with an install hint
(:func:`import_ray`), its errors (:class:`PlacementError`, :class:`StorageNotSharedError`,
:class:`NetworkConfigError`), the
book-keeping of one worker actor (:class:`GroupWorker`) and the actors' timeouts. Used by
:mod:`ringtrain.launch.ray_group`, :mod:`~ringtrain.launch.ray_elastic` and
:mod:`~ringtrain.launch.ray`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ringtrain.cluster.netif import NetworkConfigError
from ringtrain.launch.ray_placement import PlacementError, Slot

RAY_INSTALL_HINT = "pip install 'ringtrain[ray]'"
ENV_RAY_NODE_ID = "RINGTRAIN_RAY_NODE_ID"  # informational: the Ray node a worker runs on
ACTOR_START_TIMEOUT_S = 120.0
"""How long granted actors may take to start (a cold node may first build a runtime env)."""
POLL_BLOCK_S = 5.0
"""How long one output/exit poll of an actor blocks when nothing happens (seconds); news returns
at once, so this only bounds idle round trips."""


def import_ray() -> Any:
    """``import ray``, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise ImportError(
            f"ScalingConfig(backend='ray') needs Ray, which is not installed: {RAY_INSTALL_HINT}"
        ) from exc
    return ray


class StorageNotSharedError(ValueError):
    """The run directory is a path that some worker node cannot see."""


@dataclass(eq=False)
class GroupWorker:
    """One worker of a :class:`RayWorkerGroup`: its actor, where it runs and its current rank.

    Attributes:
        actor: the Ray actor handle.
        bundle: index of its bundle in the group's placement group.
        name: the actor's name.
        info: what the actor's ``node_info()`` returned (``node_id``, ``ip``, ...).
        slot: its placement (node rank, local rank) when it started.
        rank: its current world rank (renumbered by an elastic resize).
        pid: the worker process id on its node, once started.
        retired: it left the group (lost in an elastic resize, or a joiner discarded): its exit
            and its actor's death are no longer events.
    """

    actor: Any
    bundle: int
    name: str
    info: dict[str, Any] = field(default_factory=dict)
    slot: Slot | None = None
    rank: int = -1
    pid: int | None = None
    retired: bool = False


def _url_to_path(url: str) -> tuple[Any, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, str(path)


__all__ = [
    "ACTOR_START_TIMEOUT_S",
    "ENV_RAY_NODE_ID",
    "POLL_BLOCK_S",
    "RAY_INSTALL_HINT",
    "GroupWorker",
    "NetworkConfigError",
    "PlacementError",
    "StorageNotSharedError",
    "import_ray",
]
