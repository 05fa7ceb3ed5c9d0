"""The elastic worker plug-in: :class:`ElasticRuntime` holds one worker's newest in-memory
snapshot and its group generation, takes snapshots at step boundaries, agrees with the other
members on pausing for a grow, and tears down and re-forms the process group after a resize
(:meth:`ElasticRuntime.recover`, :meth:`ElasticRuntime.join`). The protocol, and the entry point
that registers the plug-in and re-enters the train function
(:func:`ringtrain.elastic.worker.run_elastic`), are in :mod:`ringtrain.elastic.worker`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.cluster.distributed import (
    collective_timeout_s,
    destroy_process_group,
    init_process_group,
)
from ringtrain.cluster.env import DistributedContext
from ringtrain.elastic import snapshot as snapshots
from ringtrain.elastic.batch import (
    constant_global_batch,
    current_lr_scale,
    install_lr_scaling,
    plan_for_loader,
)
from ringtrain.elastic.dtensor_caches import clear_dtensor_caches
from ringtrain.elastic.sockets import GroupSockets, is_peer_lost
from ringtrain.wire.channel import GrowRequest, Interrupted, JoinReady, Resize, Resumed
from ringtrain.wire.worker_config import ElasticSettings
from ringtrain.worker.hooks import SYNC_TOKEN_ATTR, LoaderSetup, ModelSetup, StepState, WorkerPlugin
from ringtrain.worker.session import Session
from ringtrain.worker.state import TrainState
from ringtrain.worker.state_files import capture_rng, unwrap

logger = logging.getLogger("ringtrain")

FINISH_WRITE_TIMEOUT_S = 120.0


class GrowPause(BaseException):
    """Raised out of the train function at the step boundary where the group pauses to grow
    (internal; a BaseException so that a train function's ``except Exception`` lets it pass)."""


class ElasticRuntime(WorkerPlugin):
    """One worker's elastic state (its newest snapshot and its group generation) and the worker
    plug-in that keeps it (:mod:`ringtrain.worker.hooks`).

    Args:
        session: the worker's :class:`~ringtrain.worker.session.Session`.
        settings: the run's elastic settings.
    """

    def __init__(self, session: Session, settings: ElasticSettings) -> None:
        self.session = session
        self.settings = settings
        self.lr_hooks: list[Any] = []  # torch's global optimizer step hooks (scale_lr), once
        self.snapshot: snapshots.Snapshot | None = None
        # On a device mesh (ScalingConfig.parallel) the one before too: the driver resumes
        # from the oldest step a survivor holds (ringtrain.elastic.policy).
        self.previous: snapshots.Snapshot | None = None
        self.generation = 0
        self.resume_pending = False
        self.grow_requested = False  # a GrowRequest of this generation arrived
        self.pause_at: int | None = None  # the step every member agreed to pause after
        self._warned_sharded = False
        self._store: Any = None
        self.group_sockets = GroupSockets()  # the current gloo group's connections

    def init_first_group(self) -> None:
        """Form the first generation's process group (``env://`` rendezvous), noting its gloo
        connections."""
        ctx = self.session.context
        if ctx.use_gpu:
            init_process_group(ctx)
        else:
            _, self.group_sockets = GroupSockets.opened_by(
                lambda: init_process_group(ctx), store_port=ctx.master_port
            )
        self._formed(ctx)

    def _formed(self, ctx: DistributedContext) -> None:
        """The group of this generation is formed: build its mesh (CPU), then let the plug-ins
        make their sub-groups (the step agreement's gloo group), noting the gloo connections of
        both with the group's (GPU runs too: the agreement's group is gloo there as well)."""
        if not ctx.use_gpu:
            self._build_mesh(ctx)
        if ctx.world_size > 1 and dist.is_initialized():
            _, sockets = GroupSockets.opened_by(
                self.session.hooks.on_group_formed, store_port=ctx.master_port
            )
            self.group_sockets.fds.update(sockets.fds)
        # A peer cut off by a partition sends no reset: its connections fail after
        # worker_timeout_s of silence, and the survivors re-form without it.
        self.group_sockets.give_up_after(ctx.worker_timeout_s)

    def _build_mesh(self, ctx: DistributedContext) -> None:
        """On a device mesh (``ScalingConfig.parallel``), build this generation's ``ctx.mesh``
        now (every member does, right after the group forms: a collective) and note its
        sub-groups' gloo connections with the group's, so that :meth:`break_group` ends them
        too: a rank blocked in a sub-group collective with a live peer then fails at once."""
        clear_dtensor_caches()
        if ctx.config.mesh is None or ctx.world_size == 1 or ctx.use_gpu:
            return
        _, sockets = GroupSockets.opened_by(lambda: ctx.mesh, store_port=ctx.master_port)
        self.group_sockets.fds.update(sockets.fds)

    def break_group(self) -> None:
        """End this rank's connections of the current group before tearing it down, so that
        every peer still blocked in a collective with this rank fails at once instead of waiting
        for the collective timeout (:mod:`ringtrain.elastic.sockets`); let the plug-ins finish
        and drop the collectives they have in flight (``on_group_broken``: they end at once
        now), then destroy the group.

        The order matters: a gloo group destroyed while a collective is still queued on it can
        block its destructor, which runs wherever its last reference is dropped (a plug-in's
        pipelined agreement held one into the next generation's first step boundary, where the
        training thread then hung)."""
        closed = self.group_sockets.shutdown()
        if closed:
            logger.debug("elastic: shut down %d gloo connections", closed)
        try:
            self.session.hooks.on_group_broken()
        finally:
            destroy_process_group()

    # ------------------------------------------------------------------ step boundaries
    def on_step(self, state: StepState) -> None:
        """Called by ``TrainState.step``'s setter: report the first step after a resize,
        snapshot every ``snapshot_interval_steps`` steps, and agree on pausing for a grow.

        Raises:
            GrowPause: when the members agreed to pause at the previous snapshot and no batch
                was fetched from a prepared loader since (this step is snapshotted first).
        """
        ctx = self.session.context
        if self.resume_pending and self.session.channel is not None:
            self.resume_pending = False
            self.session.channel.send(
                Resumed(
                    rank=ctx.world_rank,
                    time=time.time(),
                    generation=self.generation,
                    step=int(state.step),
                )
            )
        if self.pause_at is not None and isinstance(state, TrainState):
            # A loop without a prepared loader: pause here.
            self.pause_at = self._take(state, ctx).step
            raise GrowPause(f"pausing after step {self.pause_at} to grow the group")
        if state.step % self.settings.snapshot_interval_steps:
            return
        if not isinstance(state, TrainState):
            return
        if state.sharded and ctx.config.mesh is None:
            if not self._warned_sharded:
                self._warned_sharded = True
                logger.warning(
                    "elastic: in-memory snapshots cover FSDP-sharded state only on an elastic "
                    "ParallelConfig(dp_replicate=-1, dp_shard=...) (a lost rank of the only "
                    "replica takes its shards with it); a lost worker restarts the group from "
                    "the disk checkpoint"
                )
            return
        # The grow flag's allreduce runs while the snapshot is copied (the ranks reach the
        # boundary at different times; the early one copies instead of waiting).
        grow_agreed = self._start_grow_agreement(ctx)
        snap = self._take(state, ctx)
        if grow_agreed():
            self.pause_at = snap.step

    def _take(self, state: TrainState, ctx: DistributedContext) -> snapshots.Snapshot:
        """Snapshot ``state`` (reusing the buffers of the snapshot it replaces; on a mesh the
        newest two are kept). No communication: every survivor holds what it resumes from."""
        if ctx.config.mesh is None:
            self.snapshot = snapshots.take(state, self.snapshot)
        else:
            snap = snapshots.take(state, self.previous)
            self.previous, self.snapshot = self.snapshot, snap
        return self.snapshot

    def on_batch_start(self) -> None:
        """Before a prepared loader fetches a batch: leave the train function with
        :class:`GrowPause` once the members agreed to pause for a grow (the step they agreed on
        is complete and snapshotted; the user code after it has run)."""
        if self.pause_at is not None:
            raise GrowPause(f"pausing after step {self.pause_at} to grow the group")

    def on_prepare_loader(self, setup: LoaderSetup) -> None:
        """Give the loader the per-worker batch of this world size (``elastic_batch_policy``),
        and under ``"accumulate"`` the micro-batch size (the loader's own batch size)."""
        self.ensure_lr_scaling()
        ctx = self.session.context
        plan = plan_for_loader(setup.data_loader, ctx)
        if plan is None:
            return
        batch_size = plan.batch_size
        setup.data_loader = constant_global_batch(setup.data_loader, ctx, plan)
        if plan.policy == "accumulate":
            setup.micro_batch_size = batch_size

    def before_wrap(self, setup: ModelSetup) -> None:
        """Scale the learning rate of optimizer steps (``"scale_lr"``), and let DDP skip its
        initial broadcast when the train function was re-entered with a snapshot."""
        self.ensure_lr_scaling()
        setup.sync_token = self.sync_token()

    def on_restore(self, state: object, checkpoint: object) -> None:
        """Note on the model that this generation's snapshot was loaded into it."""
        if isinstance(state, TrainState) and "model" in state and "model" not in state.sharded:
            self.mark_restored(unwrap(state["model"]), checkpoint)

    def on_worker_stop(self, error: BaseException | None) -> None:
        """Remove the learning-rate hooks (torch's are process-wide)."""
        for handle in self.lr_hooks:
            handle.remove()
        self.lr_hooks = []

    def ensure_lr_scaling(self) -> None:
        """Install (once) the optimizer step hooks of ``elastic_batch_policy="scale_lr"``."""
        if not self.lr_hooks and self.session.context.config.elastic_batch_policy == "scale_lr":
            self.lr_hooks = install_lr_scaling(current_lr_scale)

    def sync_token(self) -> int | None:
        """The group generation whose snapshot the train function was re-entered with, or None.

        When it is not None, ``prepare_model`` builds DDP without its initial broadcast of rank
        0's parameters (``init_sync=False``): ``TrainState.restore()`` is about to overwrite them
        with the snapshot, which every rank of the new group holds identically, so the broadcast
        (400 MB for a 100 M-parameter model) would be wasted.
        :func:`ringtrain.comm.ddp.sync_unless_restored` checks, at the first forward, that every
        rank did restore it, and broadcasts otherwise.
        """
        if not isinstance(self.session.latest_checkpoint, snapshots.SnapshotCheckpoint):
            return None
        return int(self.generation)

    def mark_restored(self, module: Any, checkpoint: object) -> None:
        """Note on ``module`` (unwrapped) that ``checkpoint``, when it is this generation's
        snapshot (what ``get_checkpoint()`` returns now), was just loaded into it (read by
        ``sync_unless_restored``)."""
        token = self.sync_token()
        if token is not None and checkpoint is self.session.latest_checkpoint:
            module.__dict__[RESTORED_ATTR] = token

    def _start_grow_agreement(self, ctx: DistributedContext) -> Callable[[], bool]:
        """Start agreeing whether any member has a GrowRequest (an allreduce MAX of the flag,
        asynchronous), so that every member pauses after the same step; call the returned
        function, at this same step boundary, after the snapshot was taken, for the result (it
        waits for the collective). The driver sends a GrowRequest to grow the group back, and
        to let the ranks of a partial preemption notice leave in place (at any size: so the
        flag is agreed on at every snapshot boundary, one 4-byte allreduce).

        With hot spares (``ElasticSettings.carry_rng``) the collective is an all-gather of the
        flag and this rank's RNG states (:func:`~ringtrain.elastic.snapshot.pack_rng`, 16 KB),
        and the returned function puts every rank's into the new snapshot's ``peer_rng``: a
        spare that takes a lost rank's place continues its random streams. One collective at
        the same sync point, so the gather costs its bytes, not another wait.

        Raises (from the returned function):
            RuntimeError: from the collective when a peer is lost (elastic handling follows).
        """
        self._poll_driver()
        flag = self.grow_requested
        if ctx.world_size <= 1:
            return lambda: flag
        device = ctx.device if ctx.use_gpu else torch.device("cpu")
        if not self.settings.carry_rng:
            box = torch.tensor([int(flag)], dtype=torch.int32, device=device)
            work = dist.all_reduce(box, op=dist.ReduceOp.MAX, async_op=True)

            def agreed() -> bool:
                work.wait()
                return bool(box.item())

            return agreed
        # The snapshot taken next captures the same streams: nothing draws in between.
        words = snapshots.pack_rng(capture_rng())
        mine = torch.cat([torch.tensor([int(flag)], dtype=torch.int64), words]).to(device)
        parts = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        gathered = dist.all_gather(parts, mine, async_op=True)

        def agreed_and_gathered() -> bool:
            gathered.wait()
            table = {r: p[1:].cpu() for r, p in enumerate(parts)}
            if self.snapshot is not None:
                self.snapshot.peer_rng = table
            return any(bool(p[0].item()) for p in parts)

        return agreed_and_gathered

    def _poll_driver(self) -> None:
        """Take the GrowRequests of this generation among the driver messages waiting (read
        without blocking by the session, which keeps the other kinds for other plug-ins)."""
        self.session.poll_driver()
        for message in self.session.take_messages(GrowRequest):
            if message.generation == self.generation:
                self.grow_requested = True

    def next_resize(self) -> Resize:
        """Wait for the driver's next :class:`~ringtrain.wire.channel.Resize`. GrowRequests that
        arrive meanwhile are stale and skipped; other messages (a preemption request) stay in
        the session's inbox for the plug-in they are meant for, after the group re-formed."""
        session = self.session
        channel = session.channel
        assert channel is not None
        session.take_messages(GrowRequest)
        waiting = session.take_messages(Resize)
        if waiting:
            return waiting[0]
        while True:
            # The driver stops this process instead if it restarts the group.
            message = channel.recv()
            if isinstance(message, Resize):
                return message
            if not isinstance(message, GrowRequest):
                session.inbox.append(message)

    # ------------------------------------------------------------------ resizing
    def recover(
        self, exc_type: str, message: str, grow: bool = False, left_at: float | None = None
    ) -> None:
        """Tear down the group (ending its connections first, see :meth:`break_group`), tell the
        driver, wait for the new membership, re-form the group and install the snapshot to resume
        from (``grow``: the group paused to grow, nothing broke; ``left_at``: when it left the train
        function, Unix time). A peer lost while re-forming (a joining worker died) starts over.

        Raises:
            RuntimeError: if the driver answers with something other than a Resize.
        """
        session = self.session
        while True:
            self.break_group()
            session.wait_for_checkpoint(FINISH_WRITE_TIMEOUT_S)
            channel = session.channel
            assert channel is not None
            channel.send(
                Interrupted(
                    rank=session.context.world_rank,
                    time=left_at if left_at is not None else time.time(),
                    exc_type=exc_type,
                    message=message[:2000],
                    snapshot_step=self.snapshot.step if self.snapshot is not None else None,
                    step=session.last_step,
                    generation=self.generation,
                    grow=grow,
                )
            )
            session.progressed = False  # re-forming the group is start-up, not a hang
            if self._join_or_lost(self.next_resize()):
                return
            exc_type, message, grow, left_at = "PeerLost", "a peer lost while joining", False, None

    def start_joining(self) -> None:
        """A worker started to join a running group: warm up, tell the driver it is ready,
        wait for its Resize, then join (the snapshot comes by broadcast from a member)."""
        session = self.session
        assert session.channel is not None
        warm_up(session.context)
        session.progressed = False
        session.channel.send(JoinReady(rank=session.context.world_rank, time=time.time()))
        if not self._join_or_lost(self.next_resize()):
            self.recover("PeerLost", "a peer was lost while joining")

    def _join_or_lost(self, order: Resize) -> bool:
        """:meth:`join`; ``False`` (group torn down) if a peer was lost meanwhile."""
        try:
            self.join(order)
            return True
        except Exception as exc:
            if not is_peer_lost(exc):
                raise
            self.generation = order.generation
            logger.warning("elastic: a peer was lost while re-forming the group (%s)", exc)
            return False

    def join(self, order: Resize) -> None:
        """Become rank ``order.rank`` of ``order.world_size`` in generation ``order.generation``."""
        self.grow_requested = False
        self.pause_at = None
        session = self.session
        ctx = session.context
        new_ctx = dataclasses.replace(
            ctx,
            world_rank=order.rank,
            world_size=order.world_size,
            local_rank=ctx.local_rank if ctx.use_gpu else order.rank,
            local_world_size=order.world_size,
        )
        # The context carries the new rank (get_context()); the process environment keeps the
        # variables this process was started with.
        session.context = new_ctx
        session.next_round = order.start_round
        self.generation = order.generation
        self._init_group(new_ctx, order.store_prefix)
        if order.source_rank is not None:
            self.snapshot = snapshots.broadcast(
                self.snapshot,
                order.source_rank,
                order.rank,
                order.generation,
                carry_rng=self.settings.carry_rng,
            )
        else:
            self._roll_back_to(order.snapshot_step)
        if self.snapshot is None:
            raise RuntimeError("elastic: no in-memory snapshot to resume from")
        session.latest_checkpoint = snapshots.SnapshotCheckpoint(
            self.snapshot, order.rank, shards_from_peer=order.source_rank is not None
        )
        self.resume_pending = True

    def _roll_back_to(self, step: int) -> None:
        """Resume from the snapshot before the newest when the driver chose its step (on a
        mesh the new group resumes from the oldest step a survivor holds)."""
        previous = self.previous
        stale = self.snapshot is not None and self.snapshot.step != step
        if stale and previous is not None and previous.step == step:
            self.snapshot, self.previous = previous, None

    def _init_group(self, ctx: DistributedContext, prefix: str) -> None:
        if ctx.world_size == 1:
            clear_dtensor_caches()  # a mesh of one rank is built later, on first use
            return
        timeout = timedelta(seconds=collective_timeout_s(ctx.worker_timeout_s))
        if self._store is None:
            self._store = dist.TCPStore(
                ctx.master_addr, ctx.master_port, is_master=False, timeout=timeout
            )
        backend = "gloo"
        if ctx.use_gpu:
            torch.cuda.set_device(ctx.local_rank)
            backend = "nccl"

        def create() -> None:
            dist.init_process_group(
                backend=backend,
                store=dist.PrefixStore(prefix, self._store),
                rank=ctx.world_rank,
                world_size=ctx.world_size,
                timeout=timeout,
            )

        if ctx.use_gpu:
            create()
            self.group_sockets = GroupSockets()
        else:
            _, self.group_sockets = GroupSockets.opened_by(create, store_port=ctx.master_port)
        self._formed(ctx)


RESTORED_ATTR = SYNC_TOKEN_ATTR
"""Set on the module whose parameters a restore loaded from an elastic snapshot: the group
generation of that snapshot (:meth:`ElasticRuntime.mark_restored`)."""


def warm_up(ctx: DistributedContext) -> None:
    """Pay, before the members pause for this worker to join, the one-time costs a fresh
    process has at its first training step (the CUDA context, lazy imports of DDP and of the
    optimizers' step machinery: about 1 s on CPU), which would otherwise stall the whole group.
    Draws from the torch RNG, which the snapshot's RNG state replaces on restore."""
    for module in ("torch.distributed", "torch.nn.parallel", "ringtrain.prepare"):
        importlib.import_module(module)
    device = ctx.device
    if ctx.use_gpu:
        torch.cuda.set_device(device)
    layer = torch.nn.Linear(4, 1).to(device)
    optimizers = [
        torch.optim.SGD(layer.parameters(), lr=0.0, momentum=0.9),
        torch.optim.AdamW(layer.parameters(), lr=0.0),
    ]
    for optimizer in optimizers:
        layer(torch.zeros(2, 4, device=device)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    if ctx.use_gpu:
        torch.cuda.synchronize(device)
