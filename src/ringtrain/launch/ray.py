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

An actor or node that dies becomes a :class:`~ringtrain.channel.WorkerError` plus an
:class:`~ringtrain.channel.Exited` event of its rank: a worker failure for the FailurePolicy like
any other. ``stop`` terminates the worker processes (SIGTERM, then SIGKILL), kills the actors and
removes the placement group, on every exit path.

Elastic runs (docs/elastic.md): :meth:`RayWorkerGroup.resize` renumbers the surviving workers in
place and kills the lost workers' actors; their bundles stay reserved in the placement group, and
:meth:`RayWorkerGroup.grow` starts joining workers in them once they are placed (Ray places the
bundles of a lost node again when the cluster has room).

Ray is imported only when this backend is used (``pip install 'ringtrain[ray]'``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from ringtrain.channel import (
    DriverListener,
    Event,
    Exited,
    WorkerError,
    new_authkey,
)
from ringtrain.env import ENV_ELASTIC, worker_environment
from ringtrain.launch.base import ChannelGroup, WorkerSpec, start_store
from ringtrain.launch.ray_placement import (
    NodeResources,
    Slot,
    assign_ranks,
    explain_unplaceable,
    format_resources,
)
from ringtrain.launch.ray_worker import RayWorker, remote_worker_class

logger = logging.getLogger("ringtrain")

RAY_INSTALL_HINT = "pip install 'ringtrain[ray]'"
ENV_RAY_NODE_ID = "RINGTRAIN_RAY_NODE_ID"  # informational: the Ray node a worker runs on
ACTOR_START_TIMEOUT_S = 120.0
"""How long granted actors may take to start (a cold node may first build a runtime env)."""
RETIRE_TIMEOUT_S = 5.0
"""How long a resize waits for the worker processes of the workers that left to be killed."""
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


@dataclass(eq=False)
class _Worker:
    """One worker of a :class:`RayWorkerGroup`: its actor, where it runs and its current rank.

    Attributes:
        actor: the Ray actor handle.
        bundle: index of its bundle in the group's placement group.
        name: the actor's name.
        info: what the actor's ``node_info()`` returned (``node_id``, ``ip``, ...).
        slot: its placement (node rank, local rank) when it started.
        rank: its current world rank (renumbered by :meth:`RayWorkerGroup.resize`).
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


class RayWorkerGroup(ChannelGroup):
    """N Ray actors in one placement group, their channel connections, and one event queue.

    Threads: one accepts channel connections, one per connection reads messages, and one per
    actor polls it for output lines and the worker's exit (or learns that the actor died). All
    of them only put events on the queue that :meth:`poll` drains.

    Elastic runs (``ScalingConfig(num_workers=(min, max))``, docs/elastic.md): the rendezvous
    store is hosted by the driver (not by rank 0's actor), so the survivors of any lost worker,
    rank 0 included, re-form the group in it; :meth:`resize` renumbers the survivors in place
    and retires the lost workers' actors; :meth:`grow` starts joining workers in the placement
    group's free bundles when they are placed.

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
        self._events: queue.Queue[Event] = queue.Queue()
        self._conns: dict[int, Connection] = {}
        self._threads: list[threading.Thread] = []
        self._workers: list[_Worker] = []  # every worker started, retired ones too (for stop)
        self._members: dict[int, _Worker] = {}  # rank -> worker (joiners under their rank)
        self._joining: set[int] = set()  # ranks started by grow, not members yet
        self._grown = 0  # joiners started so far (names their actors)
        self._pg: Any = None
        self._listener: DriverListener | None = None
        self._store: Any = None  # elastic runs: the driver's rendezvous store
        self._store_port_ref: Any = None  # otherwise: the port of rank 0's actor's store
        self._master: tuple[str, int] = ("", 0)
        self._elastic = bool(spec.env.get(ENV_ELASTIC))
        self._authkey = new_authkey()
        self._token = secrets.token_hex(3)
        self._cmd = [sys.executable, "-m", "ringtrain.launch.worker"]
        if spec.script is not None:
            self._cmd += ["--script", spec.script, *spec.script_args]
        self._stopped = False
        self._lock = threading.Lock()
        try:
            self._pg = self._place(strategy, placement_timeout_s)
            self._start_actors()
            self._start_workers()
        except BaseException:
            self.stop(grace_s=0)
            raise

    @property
    def slots(self) -> list[Slot]:
        """Where the current members run, in rank order (``rank`` is the current one; node and
        local ranks are those of the placement the worker started with)."""
        with self._lock:
            members = sorted(self._members.items())
            joining = set(self._joining)
        return [
            dataclasses.replace(w.slot, rank=r)
            for r, w in members
            if w.slot is not None and r not in joining
        ]

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

    def _new_worker(self, index: int, name: str) -> _Worker:
        """Create the actor of bundle ``index`` (it starts asynchronously)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        actor = (
            remote_worker_class(self.ray)
            .options(
                name=name,
                num_cpus=self.bundle["CPU"],
                num_gpus=self.bundle.get("GPU", 0),
                resources=custom,
                max_concurrency=8,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=index
                ),
            )
            .remote()
        )
        worker = _Worker(actor=actor, bundle=index, name=name)
        with self._lock:
            self._workers.append(worker)
        return worker

    def _start_actors(self) -> None:
        run = os.path.basename(self.spec.run_dir.rstrip("/")) or "run"
        self._run_name = run
        workers = [
            self._new_worker(i, f"ringtrain-{run}-a{self.spec.attempt}-w{i}-{self._token}")
            for i in range(self.world_size)
        ]
        if not self._elastic:
            # Bundle 0's actor is rank 0 (assign_ranks): its store starts while the others
            # come up.
            self._store_port_ref = workers[0].actor.host_store.remote(self.world_size)
        try:
            infos = self.ray.get(
                [w.actor.node_info.remote() for w in workers], timeout=ACTOR_START_TIMEOUT_S
            )
        except self.ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"the {self.world_size} Ray worker actors did not start within "
                f"{ACTOR_START_TIMEOUT_S:g} s of their placement group being granted"
            ) from None
        for worker, info, slot in zip(
            workers, infos, assign_ranks([info["node_id"] for info in infos]), strict=True
        ):
            worker.info, worker.slot, worker.rank = info, slot, slot.rank
            self._members[slot.rank] = worker

    def _blind(self, workers: list[_Worker]) -> list[_Worker]:
        """The workers (on nodes other than the driver's) that cannot see a local run
        directory (a shared filesystem mounted at the same path is needed): checked with a
        marker file the driver writes. An fsspec URL is reached the same way by every node."""
        import fsspec

        from ringtrain.checkpoint.storage import is_local_fs

        fs, path = fsspec.core.url_to_fs(self.spec.run_dir)
        if not is_local_fs(fs):
            return []
        here = self.ray.get_runtime_context().get_node_id()
        remote: dict[str, _Worker] = {}
        for w in workers:
            if w.info["node_id"] != here:
                remote.setdefault(w.info["node_id"], w)
        if not remote:
            return []  # every worker runs on the driver's node
        os.makedirs(path, exist_ok=True)
        marker = os.path.join(path, f".ringtrain-shared-{secrets.token_hex(4)}")
        with open(marker, "w") as f:
            f.write("visible from every node?\n")
        try:
            seen = self.ray.get([w.actor.path_exists.remote(marker) for w in remote.values()])
        finally:
            with contextlib.suppress(OSError):
                os.remove(marker)
        blind_nodes = {n for n, ok in zip(remote, seen, strict=True) if not ok}
        return [w for w in workers if w.info["node_id"] in blind_nodes]

    def _check_storage(self, workers: list[_Worker]) -> None:
        blind = self._blind(workers)
        if blind:
            _, path = _url_to_path(self.spec.run_dir)
            raise StorageNotSharedError(
                f"the run directory {path} is on the driver's local disk, and worker node(s) "
                f"{', '.join(sorted({w.info['ip'] for w in blind}))} cannot see it: checkpoints "
                "would be scattered over the nodes. With several nodes, set "
                "RunConfig.storage_path to a shared filesystem mounted at the same path on "
                "every node (NFS, Lustre, ...) or to an fsspec URL every node can reach (s3://, "
                "gs://, abfs://, ...)"
            )

    def _worker_env(
        self,
        base: Mapping[str, str],
        worker: _Worker,
        *,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        node_rank: int,
        cuda_visible_devices: str | None,
    ) -> dict[str, str]:
        assert self._listener is not None
        env = dict(base)
        env.update(
            worker_environment(
                rank=rank,
                world_size=world_size,
                local_rank=local_rank,
                local_world_size=local_world_size,
                node_rank=node_rank,
                master_addr=self._master[0],
                master_port=self._master[1],
                threads=max(1, int(self.bundle["CPU"])),
                use_gpu=self.spec.use_gpu,
                attempt=self.spec.attempt,
                run_dir=self.spec.run_dir,
                driver_addr=self._listener.address,
                authkey_hex=self._authkey.hex(),
                start_round=self.spec.start_round,
            )
        )
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        env[ENV_RAY_NODE_ID] = worker.info["node_id"]
        if self.spec.use_gpu and cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        return env

    def _launch(self, pairs: list[tuple[_Worker, dict[str, str]]]) -> None:
        """Start each worker's process in its actor and watch it."""
        refs = [
            w.actor.start.remote(self._cmd, env, [p for p in sys.path if p], os.getcwd())
            for w, env in pairs
        ]
        pids = self.ray.get(refs, timeout=ACTOR_START_TIMEOUT_S)
        for (worker, _env), pid in zip(pairs, pids, strict=True):
            worker.pid = pid
            self._spawn(self._watch, worker)

    def _start_workers(self) -> None:
        ray = self.ray
        spec = self.spec
        members = [self._members[r] for r in range(self.world_size)]
        self._check_storage(members)
        driver_ip = ray.util.get_node_ip_address()
        # The channel and (elastic runs) the store listen on the driver's node address, not
        # the wildcard: workers on other nodes reach them there (docs/ray.md).
        self._listener = DriverListener(
            self._authkey, self._on_connection, host=driver_ip, world_size=spec.world_size
        )
        if self._elastic:
            # The store must outlive any worker: the survivors of a lost rank 0 re-form the
            # group in it (docs/elastic.md). Port chosen by the OS; workers reach it at the
            # driver's node address, as they reach the channel.
            self._store = start_store(driver_ip, spec.world_size)
            self._master = (driver_ip, int(self._store.port))
        else:
            port = ray.get(self._store_port_ref, timeout=ACTOR_START_TIMEOUT_S)
            self._master = (members[0].info["ip"], int(port))
        # With use_gpu, the workers of one node see all of that node's assigned GPUs, in local
        # rank order, so cuda:{local_rank} is the GPU Ray gave this worker and NCCL can use
        # peer-to-peer copies between them.
        node_gpus: dict[str, list[str]] = {}
        for w in members:
            node_gpus.setdefault(w.info["node_id"], []).append(w.info["cuda_visible_devices"] or "")
        pairs = []
        for w in sorted(members, key=lambda w: w.bundle):
            slot = w.slot
            assert slot is not None
            env = self._worker_env(
                spec.env,
                w,
                rank=slot.rank,
                world_size=spec.world_size,
                local_rank=slot.local_rank,
                local_world_size=slot.local_world_size,
                node_rank=slot.node_rank,
                cuda_visible_devices=",".join(node_gpus[slot.node_id]),
            )
            pairs.append((w, env))
        self._launch(pairs)

    # ------------------------------------------------------------------ threads
    def _spawn(self, target: Any, *args: Any) -> None:
        t = threading.Thread(
            target=target, args=args, daemon=True, name=f"ringtrain-ray-{target.__name__}"
        )
        t.start()
        self._threads.append(t)

    def _watch(self, worker: _Worker) -> None:
        """Forward one worker's output with its (current) rank prefix; turn its exit, or its
        actor's death, into events of its current rank, unless it has left the group."""
        ray = self.ray
        while not self._stopped:
            try:
                lines, code = ray.get(worker.actor.poll.remote(POLL_BLOCK_S))
            except Exception as exc:  # RayActorError, ActorDiedError, node failures
                with self._lock:
                    if self._stopped or worker.retired:
                        return
                    rank = worker.rank
                    ip = worker.info.get("ip", "?")
                    died = isinstance(exc, ray.exceptions.RayActorError)
                    reason = str(getattr(exc, "error_msg", "") or exc).strip().splitlines()
                    message = (
                        f"the Ray actor of rank {rank} on node {ip} "
                        + ("died" if died else "failed")
                        + (f": {reason[-1] if not died else reason[0]}" if reason else "")
                    )
                    now = time.time()
                    if died and self._elastic:
                        # A lost worker (its process died with the actor, by SIGKILL through
                        # PR_SET_PDEATHSIG), which an elastic run resizes away: an Exited by
                        # SIGKILL, as for a killed process; a WorkerError would read as an
                        # exception in the train function, which restarts from disk instead.
                        logger.warning("%s", message)
                    else:
                        self._events.put(
                            WorkerError(
                                rank=rank,
                                time=now,
                                exc_type=type(exc).__name__,
                                message=message,
                                traceback="\n".join(reason),
                            )
                        )
                    self._events.put(Exited(rank=rank, time=now, returncode=-signal.SIGKILL))
                return
            prefix = f"(rank {worker.rank}) "
            for stream_name, line in lines:
                stream = sys.stdout if stream_name == "stdout" else sys.stderr
                try:
                    stream.write(prefix + line)
                    stream.flush()
                except (ValueError, OSError):
                    pass  # the driver's stream was closed
            if code is not None:
                # Under the lock: the event has the rank of the group it left (before or after
                # a resize), and none comes from a worker that left the group.
                with self._lock:
                    if not worker.retired:
                        self._events.put(
                            Exited(rank=worker.rank, time=time.time(), returncode=code)
                        )
                return

    def _on_connection(self, conn: Connection) -> None:
        self._spawn(self._read, conn)

    # ------------------------------------------------------------------ elastic
    def resize(self, assignment: dict[int, int], orders: dict[int, Any]) -> None:
        """Elastic resize in place: worker ``old`` becomes rank ``assignment[old]`` and is sent
        ``orders[old]`` (a :class:`~ringtrain.channel.Resize`) on its channel connection.
        Joining workers (started by :meth:`grow`) in ``assignment`` become members. The workers
        not in it (lost members, joiners left out) leave the group: their worker processes are
        stopped if still alive and their actors killed (their bundles stay in the placement
        group, free for a later :meth:`grow`); nothing they do is an event any more.
        ``world_size`` becomes ``len(assignment)``.

        Raises:
            OSError: if a worker's connection is gone (the caller restarts the group instead).
        """
        with self._lock:
            missing = [old for old in assignment if old not in self._conns]
            if missing:
                raise OSError(f"ranks {missing} have no channel connection")
            members = {new: self._members[old] for old, new in assignment.items()}
            conns = {new: self._conns[old] for old, new in assignment.items()}
            left = [w for r, w in self._members.items() if r not in assignment]
            stale = [c for r, c in self._conns.items() if r not in assignment]
            for worker in left:
                worker.retired = True
            for new, worker in members.items():
                worker.rank = new
            self._members, self._conns = members, conns
            self._joining.clear()
            self.world_size = len(assignment)
        for conn in stale:
            with contextlib.suppress(OSError):
                conn.close()
        for old, new in assignment.items():
            conns[new].send(orders[old])
        self._retire(left)

    def _retire(self, workers: list[_Worker]) -> None:
        """Stop the worker processes of ``workers`` (SIGKILL) and kill their actors."""
        if not workers:
            return
        ray = self.ray
        refs = []
        for worker in workers:
            with contextlib.suppress(Exception):
                refs.append(worker.actor.terminate.remote(0.0))
        with contextlib.suppress(Exception):
            ray.wait(refs, num_returns=len(refs), timeout=RETIRE_TIMEOUT_S)
        for worker in workers:
            with contextlib.suppress(Exception):
                ray.kill(worker.actor, no_restart=True)

    def free_bundles(self) -> list[int]:
        """Bundles of the placement group that no worker of the group uses and that are placed
        on an alive node now (a bundle whose node was lost is placed again by Ray when the
        cluster has room): where :meth:`grow` can start workers."""
        from ray.util.placement_group import placement_group_table

        with self._lock:
            busy = {w.bundle for w in self._members.values()}
        free = [i for i in range(self.spec.world_size) if i not in busy]
        if not free:
            return []
        table = placement_group_table(self._pg)
        if table.get("state") == "CREATED":
            return free
        alive = {n["NodeID"] for n in self.ray.nodes() if n.get("Alive")}
        where = table.get("bundles_to_node_id") or {}
        return [i for i in free if where.get(i) in alive]

    def grow(self, ranks: list[int]) -> list[int]:
        """Start a joining worker for each of ``ranks`` (consecutive from ``world_size``) in a
        free bundle of the placement group (:meth:`free_bundles`): an actor, and in it the
        attempt's worker with :func:`~ringtrain.elastic.worker.joiner_env`, which says Hello
        with its rank and waits for a Resize (see :meth:`resize`).

        Returns:
            The ranks started: a prefix of ``ranks``, as many as there are free placed bundles
            (``[]`` when the cluster has no room now).

        Raises:
            ValueError: if ``ranks`` do not follow the current members, or the run is not
                elastic.
            RuntimeError: if the actors of placed bundles did not start (those of this call
                are stopped again).
        """
        from ringtrain.elastic.worker import joiner_env

        with self._lock:
            expected = list(range(self.world_size, self.world_size + len(ranks)))
            if list(ranks) != expected or self._joining or self._stopped:
                raise ValueError(
                    f"grow: ranks {list(ranks)} do not follow the {self.world_size} members "
                    f"(expected {expected}; joining now: {sorted(self._joining)})"
                )
        base = joiner_env(self.spec.env)
        bundles = self.free_bundles()[: len(ranks)]
        if not bundles:
            return []
        ranks = list(ranks)[: len(bundles)]
        started: list[_Worker] = []
        try:
            for rank, index in zip(ranks, bundles, strict=True):
                self._grown += 1
                name = (
                    f"ringtrain-{self._run_name}-a{self.spec.attempt}-g{self._grown}-w{rank}-"
                    f"{self._token}"
                )
                worker = self._new_worker(index, name)
                worker.rank = rank
                started.append(worker)
            try:
                infos = self.ray.get(
                    [w.actor.node_info.remote() for w in started], timeout=ACTOR_START_TIMEOUT_S
                )
            except self.ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"the Ray actors of joining ranks {ranks} did not start within "
                    f"{ACTOR_START_TIMEOUT_S:g} s in placed bundles {bundles}"
                ) from None
            for worker, info in zip(started, infos, strict=True):
                worker.info = info
            blind = self._blind(started)
            if blind:  # a node that joined since the start and cannot see the run directory
                logger.warning(
                    "elastic: not growing onto node(s) %s: they cannot see the run directory "
                    "%s (use a shared filesystem or an fsspec URL as storage_path)",
                    ", ".join(sorted({w.info["ip"] for w in blind})),
                    self.spec.run_dir,
                )
                cut = started.index(blind[0])
                dropped, started = started[cut:], started[:cut]
                for worker in dropped:
                    worker.retired = True
                self._retire(dropped)
                if not started:
                    return []
            world_size = self.world_size + len(started)
            nodes = {w.info["node_id"]: w.slot.node_rank for w in self._workers if w.slot}
            with self._lock:
                for worker in started:
                    self._members[worker.rank] = worker
                    self._joining.add(worker.rank)
            pairs = []
            for worker in started:
                node = worker.info["node_id"]
                node_rank = nodes.setdefault(node, max(nodes.values(), default=-1) + 1)
                # A joiner sees only its own GPU(s): cuda:0 is the one Ray assigned it.
                env = self._worker_env(
                    base,
                    worker,
                    rank=worker.rank,
                    world_size=world_size,
                    local_rank=0,
                    local_world_size=1,
                    node_rank=node_rank,
                    cuda_visible_devices=worker.info["cuda_visible_devices"] or "",
                )
                pairs.append((worker, env))
            self._launch(pairs)
        except BaseException:
            with self._lock:
                for worker in started:
                    worker.retired = True
                    self._joining.discard(worker.rank)
                    if self._members.get(worker.rank) is worker:
                        del self._members[worker.rank]
                    conn = self._conns.pop(worker.rank, None)
                    if conn is not None:
                        with contextlib.suppress(OSError):
                            conn.close()
            self._retire(started)
            raise
        return [w.rank for w in started]

    def discard(self, ranks: list[int]) -> None:
        """Stop joining workers that were never made members (SIGKILL, actor killed) and forget
        them; nothing they do is an event any more. Idempotent; members and unknown ranks are
        ignored."""
        with self._lock:
            gone: list[_Worker] = self._pop_joiners(ranks, self._members)
            for worker in gone:
                worker.retired = True
        self._retire(gone)

    # ------------------------------------------------------------------ contract
    def pids(self) -> dict[int, int]:
        """rank -> worker process id (on the worker's node)."""
        with self._lock:
            return {r: w.pid for r, w in self._members.items() if w.pid is not None}

    def actors(self) -> dict[int, Any]:
        """rank -> the Ray actor handle running it."""
        with self._lock:
            return {r: w.actor for r, w in self._members.items()}

    def stop(self, grace_s: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            workers = list(self._workers)
        ray = self.ray
        started = [w for w in workers if w.pid is not None]
        if started:
            refs = [w.actor.terminate.remote(grace_s) for w in started]
            with contextlib.suppress(Exception):
                ray.wait(refs, num_returns=len(refs), timeout=grace_s + 15)
        for worker in workers:
            with contextlib.suppress(Exception):
                ray.kill(worker.actor, no_restart=True)
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
        self._store = None


def _url_to_path(url: str) -> tuple[Any, str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return fs, str(path)
