"""Workers as Ray actors: ``ScalingConfig(backend="ray")``.

The same launcher contract as :mod:`ringtrain.launch.local`, so the controller, the failure policy,
checkpoints and progress do not know which one runs. Per attempt:

1. a **placement group** of ``num_workers`` bundles (``resources_per_worker``, plus one GPU each
   with ``use_gpu``) is requested with the configured strategy and must be granted within
   ``placement_timeout_s``, else :class:`PlacementError` names the resources that are missing;
2. one **actor** per bundle (:class:`RayWorker`) reports the node it landed on. Ranks are numbered
   node by node (nodes in the order of their first bundle, bundles in order within a node), which
   gives each worker its node rank, local rank and local world size from the actual placement;
3. the rank-0 actor hosts the rendezvous ``TCPStore`` on its node (port chosen by the OS, so no
   race for a "free" port), as torchrun's agent does on the first node; workers connect to
   ``MASTER_ADDR`` = rank 0's node address (``TORCHELASTIC_USE_AGENT_STORE``). In an elastic
   run the driver hosts the store instead (as the local launcher does), on its node address: the
   store then outlives any worker, so the survivors of a lost rank 0 re-form the group in it;
4. each actor starts the very same worker bootstrap as the local launcher,
   ``python -m ringtrain.launch.worker``, as its child process (it dies with the actor through
   ``PR_SET_PDEATHSIG``) with the torchrun variables; the worker connects back to the driver's
   authenticated channel, which listens on the driver's node address instead of loopback.

An actor or node that dies becomes a :class:`~ringtrain.wire.channel.WorkerError` plus an
:class:`~ringtrain.wire.channel.Exited` event of its rank: a worker failure for the FailurePolicy
like any other. ``stop`` terminates the worker processes (SIGTERM, then SIGKILL), kills the actors
and removes the placement group, on every exit path.

Elastic runs (docs/elastic.md) get an :class:`~ringtrain.launch.ray_elastic.ElasticRayWorkerGroup`:
its ``resize`` renumbers the surviving workers in place and kills the lost workers' actors; their
bundles stay reserved in the placement group, and its ``grow`` starts joining workers in them once
they are placed (Ray places the bundles of a lost node again when the cluster has room).

The modules: this one (the launcher), :mod:`~ringtrain.launch.ray_group` (the worker group),
:mod:`~ringtrain.launch.ray_elastic` (resize and grow), :mod:`~ringtrain.launch.ray_worker` (the
actor) and :mod:`~ringtrain.launch.ray_placement` (rank numbering and placement errors, free of
Ray). :class:`~ringtrain.launch.backends.RayBackend` makes the launcher. Ray is imported only when
this backend is used (``pip install 'ringtrain[ray]'``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ringtrain.launch.base import WorkerSpec
from ringtrain.launch.ray_drain import RayDrainNotice
from ringtrain.launch.ray_elastic import ElasticRayWorkerGroup
from ringtrain.launch.ray_group import (
    ENV_RAY_NODE_ID,
    RAY_INSTALL_HINT,
    PlacementError,
    RayWorkerGroup,
    StorageNotSharedError,
    import_ray,
)
from ringtrain.launch.ray_placement import NodeResources, Slot, assign_ranks, explain_unplaceable
from ringtrain.launch.ray_worker import RayWorker, remote_worker_class

if TYPE_CHECKING:
    from ringtrain.config import ScalingConfig
    from ringtrain.preemption import NoticeSource

__all__ = [
    "ENV_RAY_NODE_ID",
    "RAY_INSTALL_HINT",
    "ElasticRayWorkerGroup",
    "NodeResources",
    "PlacementError",
    "RayLauncher",
    "RayWorker",
    "RayWorkerGroup",
    "Slot",
    "StorageNotSharedError",
    "assign_ranks",
    "explain_unplaceable",
    "import_ray",
    "token_auth_as_for_auto",
]


def token_auth_as_for_auto() -> None:
    """Ray 2.60 turns token authentication on by itself when a driver finds the cluster with
    ``address="auto"`` and a token exists (``~/.ray/auth_token``, ``RAY_AUTH_TOKEN``,
    ``RAY_AUTH_TOKEN_PATH``), but not for an explicit ``HOST:PORT``: the driver then connects
    without its token, and a cluster with token authentication answers with ``InvalidAuthToken``
    until ``ray.init`` fails. Do for an explicit address what Ray does for ``"auto"``;
    ``RAY_AUTH_MODE`` set by the user wins. On a Ray without token authentication, nothing."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


class RayLauncher:
    """Starts a :class:`RayWorkerGroup` per attempt on a Ray cluster.

    Args:
        address: the cluster (``"auto"``, ``"HOST:PORT"``); ``None``: Ray already initialised
            in this process, else ``RAY_ADDRESS``, else a cluster started with ``ray start`` on
            this machine, else a new Ray instance on this machine for the run.
        placement_strategy: ``PACK``, ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``.
        resources_per_worker: one worker's bundle; ``CPU`` defaults to 1 (and sets the worker's
            torch threads), other keys are Ray custom resources. ``use_gpu`` adds ``GPU: 1``.
        placement_timeout_s: seconds to wait for the placement group.

    Raises:
        ImportError: if Ray is not installed.
    """

    def __init__(
        self,
        address: str | None = None,
        placement_strategy: str = "PACK",
        resources_per_worker: Mapping[str, float] | None = None,
        placement_timeout_s: float = 60.0,
    ) -> None:
        import_ray()
        self.address = address
        self.placement_strategy = placement_strategy
        self.resources_per_worker = dict(resources_per_worker or {})
        self.placement_timeout_s = placement_timeout_s
        self._started_ray = False
        self._actor_class: Any = None  # ray.remote(RayWorker), exported once per launcher
        self._group: RayWorkerGroup | None = None  # the latest group started (node drains)

    @classmethod
    def from_scaling_config(cls, scaling: ScalingConfig) -> RayLauncher:
        """The launcher a :class:`~ringtrain.config.ScalingConfig` with ``backend="ray"`` asks
        for."""
        return cls(
            address=scaling.ray_address,
            placement_strategy=scaling.placement_strategy,
            resources_per_worker=scaling.resources_per_worker,
            placement_timeout_s=scaling.placement_timeout_s,
        )

    def bundle(self, use_gpu: bool) -> dict[str, float]:
        """One worker's resources."""
        bundle = {"CPU": 1.0, **{k: float(v) for k, v in self.resources_per_worker.items()}}
        bundle.pop("GPU", None)
        if use_gpu:
            bundle["GPU"] = 1.0
        return bundle

    def connect(self) -> None:
        """Join (or start) Ray in this process, once."""
        ray = import_ray()
        if self._actor_class is None:
            self._actor_class = remote_worker_class(ray)
        if ray.is_initialized():
            return
        explicit = self.address or os.environ.get("RAY_ADDRESS") or "auto"
        if explicit != "auto":
            token_auth_as_for_auto()
        ray.init(address=self.address, log_to_driver=False)
        node = getattr(getattr(ray, "_private", None), "worker", None)
        node = getattr(node, "_global_node", None)
        # A Ray instance this process started (no cluster found) is shut down by close().
        self._started_ray = bool(getattr(node, "head", False))

    def start(self, spec: WorkerSpec) -> RayWorkerGroup:
        """A worker group for ``spec``: an :class:`ElasticRayWorkerGroup` for an elastic run."""
        self.connect()
        group = ElasticRayWorkerGroup if spec.elastic else RayWorkerGroup
        self._group = group(
            spec,
            actor_class=self._actor_class,
            bundle=self.bundle(spec.use_gpu),
            strategy=self.placement_strategy,
            placement_timeout_s=self.placement_timeout_s,
        )
        return self._group

    def node_ranks(self) -> dict[str, list[int]]:
        """Where the current group's ranks run: Ray node id -> ranks (empty: no group)."""
        group = self._group
        return group.node_ranks() if group is not None else {}

    def notice_sources(self) -> list[NoticeSource]:
        """The preemption notice sources of this backend: a node drain
        (:class:`~ringtrain.launch.ray_drain.RayDrainNotice`) covering the ranks on that node."""
        return [RayDrainNotice(self.node_ranks)]

    def close(self) -> None:
        """Shut down the Ray instance this launcher started, if any (a cluster it joined, or
        Ray initialised by the caller, stays up)."""
        if self._started_ray:
            self._started_ray = False
            import_ray().shutdown()
