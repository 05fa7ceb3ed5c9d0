"""The worker side of elastic training: snapshots, and re-entering the train function in place.

``run_elastic`` calls the user's train function. When a collective fails because a peer process
was lost (gloo raises ``Connection closed/reset by peer`` once the peer's sockets close), the
exception propagates out of the train function; ``run_elastic`` catches it, tears down the process
group (which makes every other survivor's pending collective fail too), finishes any background
checkpoint write, tells the driver :class:`~ringtrain.channel.Interrupted` and waits for its
:class:`~ringtrain.channel.Resize`: the new world size, this worker's new rank and a new
rendezvous generation (a fresh key prefix in the driver's TCPStore, so no port is picked and
nothing of the old group's keys is reused). It then re-forms the process group and calls the
train function again in the same process, with the newest in-memory snapshot as what
``get_checkpoint()`` returns and ``TrainState.restore()`` loads. This is how Horovod elastic
re-enters ``hvd.elastic.run`` (horovod/common/elastic.py); unlike Horovod, the state rolled back
to is also held by a peer.

Any other exception (a bug in the train function, a hang, a timeout) is not handled here: it
ends the worker as in a non-elastic run and the driver restarts the group from disk.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import re
import time
from datetime import timedelta
from typing import Any

from ringtrain.channel import Interrupted, Resize, Resumed
from ringtrain.distributed import collective_timeout_s, init_process_group
from ringtrain.elastic import snapshot as snapshots
from ringtrain.env import ENV_ELASTIC, DistributedContext

logger = logging.getLogger("ringtrain")

FINISH_WRITE_TIMEOUT_S = 120.0

# Errors of a collective whose peer process went away (the same families the controller treats as
# secondary failures).
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"failed to recv|remote process exited|DistNetworkError|DistBackendError",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class ElasticSettings:
    """``RINGTRAIN_ELASTIC`` = ``"min,max,snapshot_interval_steps"``, as the driver sets it."""

    min_workers: int
    max_workers: int
    snapshot_interval_steps: int

    @classmethod
    def parse(cls, text: str) -> ElasticSettings:
        lo, hi, every = (int(part) for part in text.split(","))
        return cls(lo, hi, every)

    def to_env(self) -> str:
        return f"{self.min_workers},{self.max_workers},{self.snapshot_interval_steps}"


def settings_of(ctx: DistributedContext) -> ElasticSettings | None:
    text = ctx.extra.get(ENV_ELASTIC)
    return ElasticSettings.parse(text) if text else None


def constant_global_batch(data_loader: Any, ctx: DistributedContext, plan: Any = None) -> Any:
    """The loader to shard at world size ``ctx.world_size``: its ``batch_size`` (the per-worker
    batch at ``max`` workers) becomes ``plan.per_worker_batch``, the samples per worker and
    step that the run's ``elastic_batch_policy`` gives (``batch_size * max / world_size`` when
    the global batch is kept; :mod:`ringtrain.elastic.batch`). Outside an elastic run, or when
    the per-worker batch does not change, ``data_loader`` itself.

    Args:
        data_loader: the user's ``DataLoader``.
        ctx: this worker's context.
        plan: the :class:`~ringtrain.elastic.batch.BatchPlan` (default: computed here).

    Raises:
        ValueError: if the policy keeps the global batch and it does not divide by the world
            size (the message names the batch sizes that work, and ``"scale_lr"``).
    """
    if plan is None:
        from ringtrain.elastic.batch import plan_for_loader

        plan = plan_for_loader(data_loader, ctx)
    if plan is None or plan.per_worker_batch == data_loader.batch_size:
        return data_loader
    from torch.utils.data import DataLoader

    kwargs: dict[str, Any] = dict(
        batch_size=plan.per_worker_batch,
        sampler=data_loader.sampler,
        num_workers=data_loader.num_workers,
        collate_fn=data_loader.collate_fn,
        pin_memory=data_loader.pin_memory,
        drop_last=data_loader.drop_last,
        timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn,
        multiprocessing_context=data_loader.multiprocessing_context,
        generator=data_loader.generator,
        persistent_workers=data_loader.persistent_workers,
    )
    if data_loader.num_workers > 0:
        kwargs["prefetch_factor"] = data_loader.prefetch_factor
    return DataLoader(data_loader.dataset, **kwargs)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says a collective's peer is gone."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if PEER_LOST.search(f"{type(current).__name__} {current}"):
            return True
        current = current.__cause__ or current.__context__
    return False


class ElasticRuntime:
    """One worker's elastic state: its newest snapshot and its group generation.

    Args:
        session: the worker's :class:`~ringtrain.session.Session`.
        settings: the run's elastic settings.
    """

    def __init__(self, session: Any, settings: ElasticSettings) -> None:
        self.session = session
        self.settings = settings
        self.snapshot: snapshots.Snapshot | None = None
        self.generation = 0
        self.resume_pending = False
        self._warned_sharded = False
        self._store: Any = None

    # ------------------------------------------------------------------ step boundaries
    def on_step(self, state: Any) -> None:
        """Called by ``TrainState.step``'s setter: report the first step after a resize, and
        snapshot every ``snapshot_interval_steps`` steps."""
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
        if state.step % self.settings.snapshot_interval_steps:
            return
        if state._sharded:
            if not self._warned_sharded:
                self._warned_sharded = True
                logger.warning(
                    "elastic: in-memory snapshots do not cover FSDP-sharded state; a lost "
                    "worker restarts the group from the disk checkpoint"
                )
            return
        snap = snapshots.take(state, self.snapshot)
        self.snapshot = snap
        snapshots.replicate_to_neighbour(snap, ctx.world_rank, ctx.world_size)

    # ------------------------------------------------------------------ resizing
    def recover(self, exc_type: str, message: str) -> None:
        """Tear down the broken group, tell the driver, wait for the new membership, re-form
        the group and install the snapshot to resume from.

        Raises:
            RuntimeError: if the driver answers with something other than a Resize.
        """
        session = self.session
        _destroy_process_group()
        session.wait_for_checkpoint(FINISH_WRITE_TIMEOUT_S)
        channel = session.channel
        assert channel is not None
        channel.send(
            Interrupted(
                rank=session.context.world_rank,
                time=time.time(),
                exc_type=exc_type,
                message=message[:2000],
                snapshot_step=self.snapshot.step if self.snapshot is not None else None,
                step=session.last_step,
            )
        )
        session.progressed = False  # re-forming the group is start-up, not a hang
        order = channel.recv()  # the driver stops this process instead if it restarts the group
        if not isinstance(order, Resize):
            raise RuntimeError(f"elastic: expected a Resize from the driver, got {order!r}")
        self.join(order)

    def join(self, order: Resize) -> None:
        """Become rank ``order.rank`` of ``order.world_size`` in generation ``order.generation``."""
        session = self.session
        ctx = session.context
        new_ctx = dataclasses.replace(
            ctx,
            world_rank=order.rank,
            world_size=order.world_size,
            local_rank=ctx.local_rank if ctx.use_gpu else order.rank,
            local_world_size=order.world_size,
        )
        session.context = new_ctx
        for name, value in (
            ("RANK", order.rank),
            ("WORLD_SIZE", order.world_size),
            ("LOCAL_RANK", new_ctx.local_rank),
            ("LOCAL_WORLD_SIZE", order.world_size),
        ):
            os.environ[name] = str(value)
        session.next_round = order.start_round
        self.generation = order.generation
        self._init_group(new_ctx, order.store_prefix)
        if order.source_rank is not None:
            self.snapshot = snapshots.broadcast(self.snapshot, order.source_rank, order.rank)
        if self.snapshot is None:
            raise RuntimeError("elastic: no in-memory snapshot to resume from")
        session.latest_checkpoint = snapshots.SnapshotCheckpoint(self.snapshot, order.rank)
        self.resume_pending = True

    def _init_group(self, ctx: DistributedContext, prefix: str) -> None:
        import torch
        import torch.distributed as dist

        if ctx.world_size == 1:
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
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(prefix, self._store),
            rank=ctx.world_rank,
            world_size=ctx.world_size,
            timeout=timeout,
        )


def run_elastic(train_fn: Any, config: Any, takes_config: bool, session: Any) -> None:
    """Call ``train_fn`` until it returns, re-entering it in place after each resize.

    Raises:
        Whatever ``train_fn`` raises that is not the loss of a peer, and errors of re-forming
        the group (the driver then restarts the group from the disk checkpoint).
    """
    settings = settings_of(session.context)
    assert settings is not None
    runtime = ElasticRuntime(session, settings)
    session.elastic = runtime
    init_process_group(session.context)
    while True:
        try:
            if takes_config:
                train_fn(config if config is not None else {})
            else:
                train_fn()
            return
        except Exception as exc:
            if not is_peer_lost(exc) or session.channel is None:
                raise
            exc_type, message = type(exc).__name__, str(exc)
            logger.warning(
                "elastic: rank %d lost a peer (%s)", session.context.world_rank, exc_type
            )
        gc.collect()  # the failed call's model, DDP reducer and loader iterators
        runtime.recover(exc_type, message)


def _destroy_process_group() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
