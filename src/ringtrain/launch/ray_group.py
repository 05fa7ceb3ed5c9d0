"""The worker group of the Ray backend: ``num_workers`` actors in one placement group
(:class:`RayWorkerGroup`), each running ``python -m ringtrain.launch.worker`` as its child, and
their channel connections to the driver. See :mod:`ringtrain.launch.ray` for the whole picture;
elastic resize and grow are :mod:`ringtrain.launch.ray_elastic`.
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
from multiprocessing.connection import Connection
from typing import Any

from ringtrain.cluster.env import worker_environment
from ringtrain.cluster.worker_env import cpu_worker_devices
from ringtrain.launch.base import ChannelGroup, WorkerSpec
from ringtrain.launch.ray_actors import (
    ACTOR_START_TIMEOUT_S,
    ENV_RAY_NODE_ID,
    POLL_BLOCK_S,
    RAY_INSTALL_HINT,
    GroupWorker,
    PlacementError,
    StorageNotSharedError,
    _url_to_path,
    import_ray,
)
from ringtrain.launch.ray_checks import blind_workers, check_network, network_plans
from ringtrain.launch.ray_hosts import HostWatch
from ringtrain.launch.ray_placement import Slot, assign_ranks, place_group
from ringtrain.wire import handshake
from ringtrain.wire.channel import DriverListener, Event, Exited, WorkerError, new_authkey

logger = logging.getLogger("ringtrain")

CUT_OFF_GRACE_S = 0.5
"""The SIGTERM-to-SIGKILL grace of a group stopped while one of its hosts does not answer."""


class RayWorkerGroup(ChannelGroup):
    """N Ray actors in one placement group, their channel connections, and one event queue.

    Threads: one accepts channel connections, one per connection reads messages, and one per
    actor polls it for output lines and the worker's exit (or learns that the actor died). All
    of them only put events on the queue that :meth:`poll` drains.

    The rendezvous store is hosted by rank 0's actor. Elastic runs use the subclass
    :class:`~ringtrain.launch.ray_elastic.ElasticRayWorkerGroup` (the driver hosts the store;
    resize and grow in place), which overrides :meth:`_request_store`, :meth:`_rendezvous` and
    :meth:`_death_is_error`.

    Args:
        spec: what every worker runs.
        actor_class: ``ray.remote(RayWorker)``
            (:func:`~ringtrain.launch.ray_worker.remote_worker_class`).
        bundle: one worker's resources.
        strategy: the placement group's strategy.
        placement_timeout_s: seconds to wait for the placement group.

    Raises:
        PlacementError: the placement group was not granted within ``placement_timeout_s``.
        StorageNotSharedError: the run directory is a local path a worker node cannot see.
        RuntimeError: the actors did not start.
    """

    def __init__(
        self,
        spec: WorkerSpec,
        *,
        actor_class: Any,
        bundle: dict[str, float],
        strategy: str,
        placement_timeout_s: float,
    ) -> None:
        self.ray = import_ray()
        self.world_size = spec.world_size
        self.spec = spec
        self.bundle = bundle
        self._actor_class = actor_class
        self._events: queue.Queue[Event] = queue.Queue()
        self._conns: dict[int, Connection] = {}
        self._threads: list[threading.Thread] = []
        self._workers: list[GroupWorker] = []  # every worker started, retired ones too (for stop)
        self._members: dict[int, GroupWorker] = {}  # rank -> worker (joiners under their rank)
        self._joining: set[int] = set()  # ranks started by an elastic grow, not members yet
        self._pg: Any = None
        self._listener: DriverListener | None = None
        self._store: Any = None  # a rendezvous store the driver hosts (elastic runs)
        self._store_port_ref: Any = None  # otherwise: the port of rank 0's actor's store
        self._master: tuple[str, int] = ("", 0)
        self._authkey = new_authkey()
        self._token = secrets.token_hex(3)
        self._cmd = [sys.executable, "-m", "ringtrain.launch.worker"]
        if spec.script is not None:
            self._cmd += ["--script", spec.script, *spec.script_args]
        self._stopped = False
        self._lock = threading.Lock()
        self._raylets: dict[str, tuple[str, int]] = {}  # node id -> raylet (host, port)
        self._watch = HostWatch(self._watched_nodes, self._events.put)
        self._watchers: dict[int, threading.Thread] = {}  # id(worker) -> its watcher thread
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
        pg, self._raylets = place_group(
            self.ray, self.bundle, self.world_size, strategy, timeout_s, self._keep_pg
        )
        return pg

    def _keep_pg(self, pg: Any) -> None:
        self._pg = pg  # removed by stop() even if the placement then fails

    def _watched_nodes(self) -> dict[str, tuple[str, int, list[int]]]:
        """What :class:`~ringtrain.launch.ray_hosts.HostWatch` probes: node id -> (raylet host,
        port, the ranks there)."""
        out: dict[str, tuple[str, int, list[int]]] = {}
        for node, ranks in self.node_ranks(joining=True).items():
            if node in self._raylets:
                out[node] = (*self._raylets[node], ranks)
        return out

    def _new_worker(self, index: int, name: str) -> GroupWorker:
        """Create the actor of bundle ``index`` (it starts asynchronously)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        actor = self._actor_class.options(
            name=name,
            num_cpus=self.bundle["CPU"],
            num_gpus=self.bundle.get("GPU", 0),
            resources=custom,
            max_concurrency=8,
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=index
            ),
        ).remote()
        worker = GroupWorker(actor=actor, bundle=index, name=name)
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
        self._request_store(workers)
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

    def _blind(self, workers: list[GroupWorker]) -> list[GroupWorker]:
        """The workers that cannot see a local run directory (:func:`blind_workers`)."""
        return blind_workers(self.ray, self.spec.run_dir, workers)

    def _check_storage(self, workers: list[GroupWorker]) -> None:
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
        worker: GroupWorker,
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
                driver_addr=self._listener.address,
                authkey_hex=self._authkey.hex(),
            )
        )
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        env[ENV_RAY_NODE_ID] = worker.info["node_id"]
        if self.spec.use_gpu and cuda_visible_devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        env.update(cpu_worker_devices(self.spec.use_gpu, base))
        return env

    def _launch(self, pairs: list[tuple[GroupWorker, dict[str, str]]]) -> None:
        """Check that each worker can communicate (:mod:`~ringtrain.launch.ray_checks`), then
        start its process in its actor, on the interface its actor chose, and watch it."""
        assert self._listener is not None
        plans = network_plans(
            self.ray, pairs, self._master, self._listener.address, ACTOR_START_TIMEOUT_S
        )
        with self._lock:
            hosts = len({w.info["node_id"] for w in self._members.values()})
        check_network([w for w, _ in pairs], plans, hosts)
        pairs = [(w, {**plan["env"], **env}) for (w, env), plan in zip(pairs, plans, strict=True)]
        refs = [
            w.actor.start.remote(self._cmd, env, [p for p in sys.path if p], os.getcwd())
            for w, env in pairs
        ]
        pids = self.ray.get(refs, timeout=ACTOR_START_TIMEOUT_S)
        for (worker, _env), pid in zip(pairs, pids, strict=True):
            worker.pid = pid
            self._watchers[id(worker)] = self._spawn(self._follow, worker)

    def _start_workers(self) -> None:
        ray = self.ray
        spec = self.spec
        members = [self._members[r] for r in range(self.world_size)]
        self._check_storage(members)
        driver_ip = ray.util.get_node_ip_address()
        # The channel listens on the driver's node address, not the wildcard: workers on
        # other nodes reach it there (docs/ray.md).
        self._listener = DriverListener(
            self._authkey, self._on_connection, host=driver_ip, world_size=spec.world_size
        )
        self._master = self._rendezvous(driver_ip, members)
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
        self._watch.start()

    # ------------------------------------------------------------------ threads
    def _spawn(self, target: Any, *args: Any) -> threading.Thread:
        t = threading.Thread(
            target=target, args=args, daemon=True, name=f"ringtrain-ray-{target.__name__}"
        )
        t.start()
        self._threads.append(t)
        return t

    def _follow(self, worker: GroupWorker) -> None:
        """Forward one worker's output with its (current) rank prefix; turn its exit, or its
        actor's death, into events of its current rank, unless it has left the group."""
        ray = self.ray
        while not self._stopped:
            try:
                lines, code = ray.get(worker.actor.poll.remote(POLL_BLOCK_S))
            except Exception as exc:  # RayActorError, ActorDiedError, node failures
                self._actor_failed(worker, exc)
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

    def _actor_failed(self, worker: GroupWorker, exc: Exception) -> None:
        """The actor of ``worker`` died (or its poll failed): an Exited by SIGKILL of its
        current rank, after a WorkerError naming the node when :meth:`_death_is_error`; nothing
        once the group stopped or the worker left it."""
        with self._lock:
            if self._stopped or worker.retired:
                return
            rank = worker.rank
            ip = worker.info.get("ip", "?")
            died = isinstance(exc, self.ray.exceptions.RayActorError)
            reason = str(getattr(exc, "error_msg", "") or exc).strip().splitlines()
            message = (
                f"the Ray actor of rank {rank} on node {ip} "
                + ("died" if died else "failed")
                + (f": {reason[-1] if not died else reason[0]}" if reason else "")
            )
            now = time.time()
            if self._death_is_error(died):
                self._events.put(
                    WorkerError(
                        rank=rank,
                        time=now,
                        exc_type=type(exc).__name__,
                        message=message,
                        traceback="\n".join(reason),
                    )
                )
            else:
                logger.warning("%s", message)
            self._events.put(Exited(rank=rank, time=now, returncode=-signal.SIGKILL))

    def _on_connection(self, conn: Connection) -> None:
        self._spawn(self._read, conn)

    # ------------------------------------------------------------------ what elastic changes
    def _request_store(self, workers: list[GroupWorker]) -> None:
        """Ask bundle 0's actor, rank 0 (:func:`assign_ranks`), to host the rendezvous store:
        it starts while the other actors come up."""
        self._store_port_ref = workers[0].actor.host_store.remote(self.world_size)

    def _rendezvous(self, driver_ip: str, members: list[GroupWorker]) -> tuple[str, int]:
        """``MASTER_ADDR``/``MASTER_PORT``: rank 0's node and its actor's store port."""
        port = self.ray.get(self._store_port_ref, timeout=ACTOR_START_TIMEOUT_S)
        return members[0].info["ip"], int(port)

    def _death_is_error(self, died: bool) -> bool:
        """Whether an actor that ``died`` (or whose poll failed) is a WorkerError as well as an
        Exited: always, here (the FailurePolicy restarts the group)."""
        return True

    # ------------------------------------------------------------------ contract
    def pids(self) -> dict[int, int]:
        """rank -> worker process id (on the worker's node)."""
        with self._lock:
            return {r: w.pid for r, w in self._members.items() if w.pid is not None}

    def dump_stacks(self, ranks: list[int]) -> None:
        """Ask the actors of ``ranks`` to signal their worker processes for their stacks
        (:meth:`RayWorker.dump_stacks <ringtrain.launch.ray_worker.RayWorker.dump_stacks>`,
        on whatever node they run), and wait (at most 10 s) until each has handed the output
        to its watcher, which prints it with the rank's prefix. Ranks whose host does not answer
        are not asked. Best effort, never raises."""
        silent = self._watch.silent_nodes()
        with self._lock:
            actors = [
                self._members[r].actor
                for r in ranks
                if r in self._members and self._members[r].info.get("node_id") not in silent
            ]
        if not actors:
            return
        with contextlib.suppress(Exception):
            refs = [a.dump_stacks.remote() for a in actors]
            self.ray.wait(refs, num_returns=len(refs), timeout=10)

    def node_ranks(self, joining: bool = False) -> dict[str, list[int]]:
        """Ray node id (hex) -> the ranks of the current members running there (empty once the
        group is stopped): what a node drain takes away (:mod:`ringtrain.launch.ray_drain`);
        with ``joining``, joining workers too."""
        with self._lock:
            if self._stopped:
                return {}
            out: dict[str, list[int]] = {}
            for rank, worker in sorted(self._members.items()):
                node = worker.info.get("node_id")
                if node and (joining or rank not in self._joining):
                    out.setdefault(str(node), []).append(rank)
            return out

    def actors(self) -> dict[int, Any]:
        """rank -> the Ray actor handle running it."""
        with self._lock:
            return {r: w.actor for r, w in self._members.items()}

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop the group: SIGTERM then SIGKILL after ``grace_s`` seconds to each worker process
        (through its actor), kill the actors, remove the placement group. Workers whose host
        does not answer (a partition) are not waited for: their actors are killed without
        waiting (Ray delivers it if the host comes back), and their watcher threads are left to
        end by themselves. With such a host in the group the others get at most
        :data:`CUT_OFF_GRACE_S`: they are stuck in a collective with it and can finish nothing
        (the controller waited for their checkpoint writes before stopping the group)."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            workers = list(self._workers)
        self._watch.stop(wait=False)
        silent = self._watch.silent_nodes()
        reachable = [w for w in workers if w.info.get("node_id") not in silent]
        if len(reachable) < len(workers):
            grace_s = min(grace_s, CUT_OFF_GRACE_S)
        ray = self.ray
        started = [w for w in reachable if w.pid is not None]
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
            handshake.abort(conn)  # wakes its reader, even if the worker is cut off
        # The watchers return once their pending poll fails on the killed actor; one whose
        # actor's host does not answer waits for Ray to give up on that node: not joined.
        cut_off = {self._watchers.get(id(w)) for w in workers if w not in reachable}
        for t in self._threads:
            if t not in cut_off:
                t.join(timeout=10)
        self._store = None


__all__ = [
    "ACTOR_START_TIMEOUT_S",
    "CUT_OFF_GRACE_S",
    "ENV_RAY_NODE_ID",
    "POLL_BLOCK_S",
    "RAY_INSTALL_HINT",
    "GroupWorker",
    "PlacementError",
    "RayWorkerGroup",
    "StorageNotSharedError",
    "import_ray",
]
