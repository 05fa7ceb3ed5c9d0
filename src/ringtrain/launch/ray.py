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
   ``MASTER_ADDR`` = rank 0's node address (``TORCHELASTIC_USE_AGENT_STORE``);
4. each actor starts the very same worker bootstrap as the local launcher,
   ``python -m ringtrain.launch.worker``, as its child process (it dies with the actor through
   ``PR_SET_PDEATHSIG``) with the torchrun variables; the worker connects back to the driver's
   authenticated channel, which listens on the driver's node address instead of loopback.

An actor or node that dies becomes a :class:`~ringtrain.channel.WorkerError` plus an
:class:`~ringtrain.channel.Exited` event of its rank: a worker failure for the FailurePolicy like
any other. ``stop`` terminates the worker processes (SIGTERM, then SIGKILL), kills the actors and
removes the placement group, on every exit path.

Ray is imported only when this backend is used (``pip install 'ringtrain[ray]'``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import signal
import sys
import threading
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from ringtrain.channel import (
    DriverListener,
    Event,
    Exited,
    WorkerError,
    new_authkey,
)
from ringtrain.env import worker_environment
from ringtrain.launch.base import ChannelGroup, WorkerSpec
from ringtrain.launch.ray_placement import (
    NodeResources,
    Slot,
    assign_ranks,
    explain_unplaceable,
    format_resources,
)
from ringtrain.launch.ray_worker import RayWorker, remote_worker_class

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


class PlacementError(RuntimeError):
    """The cluster did not grant the workers' placement group in time."""


class StorageNotSharedError(ValueError):
    """The run directory is a path that some worker node cannot see."""


__all__ = [
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
]


# ----------------------------------------------------------------------- the driver side


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

    @classmethod
    def from_scaling_config(cls, scaling: Any) -> RayLauncher:
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
        if ray.is_initialized():
            return
        ray.init(address=self.address, log_to_driver=False)
        node = getattr(getattr(ray, "_private", None), "worker", None)
        node = getattr(node, "_global_node", None)
        # A Ray instance this process started (no cluster found) is shut down by close().
        self._started_ray = bool(getattr(node, "head", False))

    def start(self, spec: WorkerSpec) -> RayWorkerGroup:
        self.connect()
        return RayWorkerGroup(
            spec,
            bundle=self.bundle(spec.use_gpu),
            strategy=self.placement_strategy,
            placement_timeout_s=self.placement_timeout_s,
        )

    def close(self) -> None:
        """Shut down the Ray instance this launcher started, if any (a cluster it joined, or
        Ray initialised by the caller, stays up)."""
        if self._started_ray:
            self._started_ray = False
            import_ray().shutdown()


class RayWorkerGroup(ChannelGroup):
    """N Ray actors in one placement group, their channel connections, and one event queue.

    Threads: one accepts channel connections, one per connection reads messages, and one per
    actor polls it for output lines and the worker's exit (or learns that the actor died). All
    of them only put events on the queue that :meth:`poll` drains.

    Raises:
        PlacementError: the placement group was not granted within ``placement_timeout_s``.
        StorageNotSharedError: the run directory is a local path a worker node cannot see.
        RuntimeError: the actors did not start.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        bundle: dict[str, float],
        strategy: str,
        placement_timeout_s: float,
    ) -> None:
        self.ray = import_ray()
        self.world_size = spec.world_size
        self.spec = spec
        self.bundle = bundle
        self.slots: list[Slot] = []
        self._events: queue.Queue[Event] = queue.Queue()
        self._conns: dict[int, Connection] = {}
        self._threads: list[threading.Thread] = []
        self._actors: list[Any] = []
        self._pids: dict[int, int] = {}
        self._pg: Any = None
        self._listener: DriverListener | None = None
        self._stopped = False
        self._lock = threading.Lock()
        try:
            self._pg = self._place(strategy, placement_timeout_s)
            self._start_actors()
            self._start_workers()
        except BaseException:
            self.stop(grace_s=0)
            raise

    # ------------------------------------------------------------------ set-up
    def _place(self, strategy: str, timeout_s: float) -> Any:
        from ray.util.placement_group import placement_group

        pg = placement_group([dict(self.bundle)] * self.world_size, strategy=strategy)
        self._pg = pg
        if pg.wait(timeout_seconds=timeout_s):  # asks the GCS; runs no task
            return pg
        nodes = [
            NodeResources(n.get("NodeManagerAddress", "?"), dict(n.get("Resources") or {}))
            for n in self.ray.nodes()
            if n.get("Alive")
        ]
        why = explain_unplaceable(
            self.bundle, self.world_size, strategy, nodes, self.ray.available_resources()
        )
        raise PlacementError(
            f"Ray did not grant the placement group of {self.world_size} workers with "
            f"{format_resources(self.bundle)} each (placement_strategy={strategy!r}) within "
            f"placement_timeout_s={timeout_s:g}: {why}"
        )

    def _start_actors(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = remote_worker_class(self.ray)
        token = secrets.token_hex(3)
        run = os.path.basename(self.spec.run_dir.rstrip("/")) or "run"
        custom = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        for i in range(self.world_size):
            actor = remote_cls.options(
                name=f"ringtrain-{run}-a{self.spec.attempt}-w{i}-{token}",
                num_cpus=self.bundle["CPU"],
                num_gpus=self.bundle.get("GPU", 0),
                resources=custom,
                max_concurrency=8,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=i
                ),
            ).remote()
            self._actors.append(actor)
        # Bundle 0's actor is rank 0 (assign_ranks): its store starts while the others come up.
        self._store_port = self._actors[0].host_store.remote(self.world_size)
        try:
            infos = self.ray.get(
                [a.node_info.remote() for a in self._actors], timeout=ACTOR_START_TIMEOUT_S
            )
        except self.ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the {self.world_size} Ray worker actors did not start within "
                f"{ACTOR_START_TIMEOUT_S:g} s of their placement group being granted"
            ) from None
        self._infos: list[dict[str, Any]] = infos
        self.slots = assign_ranks([info["node_id"] for info in infos])

    def _check_storage(self, run_dir: str) -> None:
        """A local run directory must be visible from every worker node (a shared filesystem
        mounted at the same path): checked with a marker file the driver writes."""
        import fsspec

        from ringtrain.checkpoint.storage import is_local_fs

        fs, path = fsspec.core.url_to_fs(run_dir)
        if not is_local_fs(fs):
            return  # an fsspec URL (s3://, gs://, ...): every node reaches it the same way
        here = self.ray.get_runtime_context().get_node_id()
        remote = {s.node_id: s.bundle for s in self.slots if s.node_id != here}
        if not remote:
            return  # every worker runs on the driver's node
        os.makedirs(path, exist_ok=True)
        marker = os.path.join(path, f".ringtrain-shared-{secrets.token_hex(4)}")
        with open(marker, "w") as f:
            f.write("visible from every node?\n")
        try:
            seen = self.ray.get(
                [self._actors[b].path_exists.remote(marker) for b in remote.values()]
            )
        finally:
            with contextlib.suppress(OSError):
                os.remove(marker)
        blind = [
            self._infos[b]["ip"] for b, ok in zip(remote.values(), seen, strict=True) if not ok
        ]
        if blind:
            raise StorageNotSharedError(
                f"the run directory {path} is on the driver's local disk, and worker node(s) "
                f"{', '.join(sorted(set(blind)))} cannot see it: checkpoints would be scattered "
                "over the nodes. With several nodes, set RunConfig.storage_path to a shared "
                "filesystem mounted at the same path on every node (NFS, Lustre, ...) or to an "
                "fsspec URL every node can reach (s3://, gs://, abfs://, ...)"
            )

    def _start_workers(self) -> None:
        ray = self.ray
        spec = self.spec
        self._check_storage(spec.run_dir)
        authkey = new_authkey()
        driver_ip = ray.util.get_node_ip_address()
        self._listener = DriverListener(authkey, self._on_connection, host=driver_ip)
        master_port = ray.get(self._store_port, timeout=ACTOR_START_TIMEOUT_S)
        master_addr = self._infos[0]["ip"]
        threads = max(1, int(self.bundle["CPU"]))
        # With use_gpu, the workers of one node see all of that node's assigned GPUs, in local
        # rank order, so cuda:{local_rank} is the GPU Ray gave this worker and NCCL can use
        # peer-to-peer copies between them.
        node_gpus: dict[str, list[str]] = {}
        for slot in sorted(self.slots, key=lambda s: s.rank):
            node_gpus.setdefault(slot.node_id, []).append(
                self._infos[slot.bundle]["cuda_visible_devices"] or ""
            )
        cmd = [sys.executable, "-m", "ringtrain.launch.worker"]
        if spec.script is not None:
            cmd += ["--script", spec.script, *spec.script_args]
        refs = []
        for slot in self.slots:
            env = dict(spec.env)
            env.update(
                worker_environment(
                    rank=slot.rank,
                    world_size=spec.world_size,
                    local_rank=slot.local_rank,
                    local_world_size=slot.local_world_size,
                    node_rank=slot.node_rank,
                    master_addr=master_addr,
                    master_port=master_port,
                    threads=threads,
                    use_gpu=spec.use_gpu,
                    attempt=spec.attempt,
                    run_dir=spec.run_dir,
                    driver_addr=self._listener.address,
                    authkey_hex=authkey.hex(),
                    start_round=spec.start_round,
                )
            )
            env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
            env[ENV_RAY_NODE_ID] = slot.node_id
            if spec.use_gpu:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus[slot.node_id])
            actor = self._actors[slot.bundle]
            refs.append(actor.start.remote(cmd, env, [p for p in sys.path if p], os.getcwd()))
        pids = ray.get(refs, timeout=ACTOR_START_TIMEOUT_S)
        for slot, pid in zip(self.slots, pids, strict=True):
            self._pids[slot.rank] = pid
            self._spawn(self._watch, slot)

    # ------------------------------------------------------------------ threads
    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(
            target=target, args=args, daemon=True, name=f"ringtrain-ray-{target.__name__}"
        )
        t.start()
        self._threads.append(t)

    def _watch(self, slot: Slot) -> None:
        """Forward one worker's output with its rank prefix; turn its exit, or its actor's
        death, into events."""
        ray = self.ray
        actor = self._actors[slot.bundle]
        prefix = f"(rank {slot.rank}) "
        while not self._stopped:
            try:
                lines, code = ray.get(actor.poll.remote(POLL_BLOCK_S))
            except Exception as exc:  # RayActorError, ActorDiedError, node failures
                if self._stopped:
                    return
                ip = self._infos[slot.bundle]["ip"]
                died = isinstance(exc, ray.exceptions.RayActorError)
                reason = str(getattr(exc, "error_msg", "") or exc).strip().splitlines()
                now = time.time()
                self._events.put(
                    WorkerError(
                        rank=slot.rank,
                        time=now,
                        exc_type=type(exc).__name__,
                        message=f"the Ray actor of rank {slot.rank} on node {ip} "
                        + ("died" if died else "failed")
                        + (f": {reason[-1] if not died else reason[0]}" if reason else ""),
                        traceback="\n".join(reason),
                    )
                )
                self._events.put(Exited(rank=slot.rank, time=now, returncode=-signal.SIGKILL))
                return
            for stream_name, line in lines:
                stream = sys.stdout if stream_name == "stdout" else sys.stderr
                try:
                    stream.write(prefix + line)
                    stream.flush()
                except (ValueError, OSError):
                    pass  # the driver's stream was closed
            if code is not None:
                self._events.put(Exited(rank=slot.rank, time=time.time(), returncode=code))
                return

    def _on_connection(self, conn: Connection) -> None:
        self._spawn(self._read, conn)

    # ------------------------------------------------------------------ contract
    def pids(self) -> dict[int, int]:
        """rank -> worker process id (on the worker's node)."""
        return dict(self._pids)

    def actors(self) -> dict[int, Any]:
        """rank -> the Ray actor handle running it."""
        return {s.rank: self._actors[s.bundle] for s in self.slots}

    def stop(self, grace_s: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        ray = self.ray
        if self._pids:
            refs = [a.terminate.remote(grace_s) for a in self._actors]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=grace_s + 15)
        for actor in self._actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        if self._listener is not None:
            self._listener.close()
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.close()
        # The watchers return once their pending poll fails on the killed actor.
        for t in self._threads:
            t.join(timeout=10)
