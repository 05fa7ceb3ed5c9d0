"""Elastic runs on Ray (``ScalingConfig(num_workers=(min, max), backend="ray")``,
docs/elastic.md): :class:`ElasticRayWorkerGroup` is the Ray worker group whose rendezvous store
the driver hosts, so the survivors of any lost worker, rank 0 included, re-form the group in it;
:meth:`~ElasticRayWorkerGroup.resize` renumbers the survivors in place and retires the lost
workers' actors (their bundles stay reserved in the placement group), and
:meth:`~ElasticRayWorkerGroup.grow` starts joining workers in those bundles once Ray has placed
them again (it does when the cluster has room).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ringtrain.launch.base import WorkerSpec, start_store
from ringtrain.launch.ray_group import ACTOR_START_TIMEOUT_S, GroupWorker, RayWorkerGroup

logger = logging.getLogger("ringtrain")

RETIRE_TIMEOUT_S = 5.0
"""How long a resize waits for the worker processes of the workers that left to be killed."""


class ElasticRayWorkerGroup(RayWorkerGroup):
    """A :class:`~ringtrain.launch.ray_group.RayWorkerGroup` that resizes in place and grows
    back (a :class:`~ringtrain.launch.base.GrowableGroup`).

    Differences from the fixed-size group: the driver hosts the rendezvous store (on its node
    address; it outlives any worker), and an actor that dies is a lost worker (an Exited by
    SIGKILL, which the elastic policy resizes away), not a WorkerError (which would restart
    the group from disk).

    Args: as :class:`~ringtrain.launch.ray_group.RayWorkerGroup`.
    """

    def __init__(self, spec: WorkerSpec, **kwargs: Any) -> None:
        self._grown = 0  # joiners started so far (names their actors)
        super().__init__(spec, **kwargs)

    def _request_store(self, workers: list[GroupWorker]) -> None:
        """Nothing: the driver hosts the store (:meth:`_rendezvous`)."""

    def _rendezvous(self, driver_ip: str, members: list[GroupWorker]) -> tuple[str, int]:
        """Host the store on the driver's node address (port chosen by the OS), where workers
        reach it as they reach the channel: it must outlive any worker, so that the survivors
        of a lost rank 0 re-form the group in it (docs/elastic.md)."""
        self._store = start_store(driver_ip, self.spec.world_size)
        return driver_ip, int(self._store.port)

    def _death_is_error(self, died: bool) -> bool:
        """A dead actor is a lost worker (its process died with it, by SIGKILL through
        ``PR_SET_PDEATHSIG``): only an Exited by SIGKILL, as for a killed process; a WorkerError
        would read as an exception in the train function, which restarts from disk instead."""
        return not died

    def resize(self, assignment: dict[int, int], orders: dict[int, Any]) -> None:
        """Elastic resize in place: worker ``old`` becomes rank ``assignment[old]`` and is sent
        ``orders[old]`` (a :class:`~ringtrain.wire.channel.Resize`) on its channel connection.
        Joining workers (started by :meth:`grow`) in ``assignment`` become members. The workers
        not in it (lost members, joiners left out) leave the group: their worker processes are
        stopped if still alive and their actors killed (their bundles stay in the placement
        group, free for a later :meth:`grow`); nothing they do is an event any more.
        ``world_size`` becomes ``len(assignment)``.

        Raises:
            OSError: if a worker's connection is gone (the caller restarts the group instead).
        """
        with self._lock:
            members, conns, left = self._reassign(assignment, self._members)
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

    def _retire(self, workers: list[GroupWorker]) -> None:
        """Stop the worker processes of ``workers`` (SIGKILL) and kill their actors; those on a
        host that does not answer are not waited for (their actors are killed when it comes
        back)."""
        if not workers:
            return
        ray = self.ray
        refs = []
        silent = self._watch.silent_nodes()
        for worker in [w for w in workers if w.info.get("node_id") not in silent]:
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
        attempt's worker (its ``Start`` marks it joining: :meth:`WorkerSpec.start_config`),
        which says Hello with its rank and waits for a Resize (see :meth:`resize`).

        Returns:
            The ranks started: a prefix of ``ranks``, as many as there are free placed bundles
            (``[]`` when the cluster has no room now).

        Raises:
            ValueError: if ``ranks`` do not follow the current members, or the run is not
                elastic.
            RuntimeError: if the actors of placed bundles did not start (those of this call
                are stopped again).
        """
        self._check_grow(ranks)
        bundles = self.free_bundles()[: len(ranks)]
        if not bundles:
            return []
        ranks = list(ranks)[: len(bundles)]
        started: list[GroupWorker] = []
        try:
            started = self._start_joiner_actors(ranks, bundles)
            started = self._drop_blind(started)
            if started:
                self._launch_joiners(started)
        except BaseException:
            self._forget_joiners(started)
            raise
        return [w.rank for w in started]

    def _check_grow(self, ranks: list[int]) -> None:
        if not self.spec.elastic:
            raise ValueError("grow: the run is not elastic (WorkerSpec.config.elastic is None)")
        with self._lock:
            expected = list(range(self.world_size, self.world_size + len(ranks)))
            if list(ranks) != expected or self._joining or self._stopped:
                raise ValueError(
                    f"grow: ranks {list(ranks)} do not follow the {self.world_size} members "
                    f"(expected {expected}; joining now: {sorted(self._joining)})"
                )

    def _start_joiner_actors(self, ranks: list[int], bundles: list[int]) -> list[GroupWorker]:
        """One actor per rank in its bundle, started and asked where it runs.

        Raises:
            RuntimeError: if they did not start in time (they are retired again).
        """
        started: list[GroupWorker] = []
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
            refs = [w.actor.node_info.remote() for w in started]
            try:
                infos = self.ray.get(refs, timeout=ACTOR_START_TIMEOUT_S)
            except self.ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"the Ray actors of joining ranks {ranks} did not start within "
                    f"{ACTOR_START_TIMEOUT_S:g} s in placed bundles {bundles}"
                ) from None
        except BaseException:
            self._forget_joiners(started)
            raise
        for worker, info in zip(started, infos, strict=True):
            worker.info = info
        return started

    def _drop_blind(self, started: list[GroupWorker]) -> list[GroupWorker]:
        """``started`` up to the first joiner on a node that joined since the start and cannot
        see the run directory; that one and the rest are retired."""
        blind = self._blind(started)
        if not blind:
            return started
        logger.warning(
            "elastic: not growing onto node(s) %s: they cannot see the run directory "
            "%s (use a shared filesystem or an fsspec URL as storage_path)",
            ", ".join(sorted({w.info["ip"] for w in blind})),
            self.spec.run_dir,
        )
        cut = started.index(blind[0])
        dropped, kept = started[cut:], started[:cut]
        for worker in dropped:
            worker.retired = True
        self._retire(dropped)
        return kept

    def _launch_joiners(self, started: list[GroupWorker]) -> None:
        """Make ``started`` joining members and start their worker processes."""
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
                self.spec.env,
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

    def _forget_joiners(self, started: list[GroupWorker]) -> None:
        """Undo a failed grow: ``started`` leave the group, their actors are killed."""
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

    def discard(self, ranks: list[int]) -> None:
        """Stop joining workers that were never made members (SIGKILL, actor killed) and forget
        them; nothing they do is an event any more. Idempotent; members and unknown ranks are
        ignored."""
        with self._lock:
            gone: list[GroupWorker] = self._pop_joiners(ranks, self._members)
            for worker in gone:
                worker.retired = True
        self._retire(gone)
