"""The worker side of elastic training: snapshots, and re-entering the train function in place.

``run_elastic`` calls the user's train function. When a collective fails because a peer process was
lost (gloo raises ``Connection closed/reset by peer`` once the peer's sockets close), the exception
propagates out of the train function; ``run_elastic`` catches it, shuts down its gloo connections
and tears down the process group (which makes every other survivor's pending collective fail too,
even one waiting on a live peer: :mod:`ringtrain.elastic.sockets`), finishes any background
checkpoint write, tells the driver :class:`~ringtrain.wire.channel.Interrupted` and waits for its
:class:`~ringtrain.wire.channel.Resize`: the new world size, this worker's new rank and a new
rendezvous generation (a fresh key prefix in the driver's TCPStore, so no port is picked and nothing
of the old group's keys is reused). It then re-forms the process group and calls the train function
again in the same process, with the newest in-memory snapshot as what ``get_checkpoint()`` returns
and ``TrainState.restore()`` loads. This is how Horovod elastic re-enters ``hvd.elastic.run``
(horovod/common/elastic.py); unlike Horovod, the state rolled back to is also held by a peer.

Growing back works the same way in the other direction. When workers wait to join, the driver
sends each member a :class:`~ringtrain.wire.channel.GrowRequest` (it sends one too when a preemption
notice covers only some ranks, which then leave in place: :mod:`ringtrain.controller.elastic`).
At every snapshot boundary the members allreduce (MAX) a "pause requested" flag, as Horovod
elastic's ``state.commit()`` checks for host updates, so they all agree on the same step; the
next batch fetch from a prepared loader (or, in a loop without one, the next step boundary) raises
:class:`GrowPause` out of the train function, and each member says ``Interrupted(grow=True)``
and waits for its Resize exactly as after a lost peer, but without rolling back. A joining
worker (its ``Start`` says ``WorkerConfig.elastic.joining``: the driver's channel group marks it)
skips the first process-group start: it waits for its
Resize, receives the snapshot by broadcast, and enters the train function with
``get_checkpoint()`` returning it.

Any other exception (a bug in the train function, a hang, a timeout) is not handled here: it
ends the worker as in a non-elastic run and the driver restarts the group from disk.

The core (session, TrainState, prepare) does not know about any of this: :class:`ElasticRuntime`
(:mod:`ringtrain.elastic.runtime`; this module re-exports it) is a worker plug-in
(:mod:`ringtrain.worker.hooks`) that ``run_elastic`` registers in the session. Its
hooks snapshot at step boundaries (``on_step``), pause for a grow before a batch
(``on_batch_start``), size the loader's batch by the ``elastic_batch_policy``
(``on_prepare_loader``), scale the learning rate and let DDP skip its initial broadcast
(``before_wrap``), and note a snapshot loaded into the model (``on_restore``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from ringtrain.cluster.env import DistributedContext
from ringtrain.elastic.runtime import (
    FINISH_WRITE_TIMEOUT_S,
    RESTORED_ATTR,
    ElasticRuntime,
    GrowPause,
    warm_up,
)
from ringtrain.elastic.sockets import is_peer_lost
from ringtrain.wire.worker_config import ElasticSettings
from ringtrain.worker.session import Session, call_train_fn, installed_session

__all__ = [
    "FINISH_WRITE_TIMEOUT_S",
    "RESTORED_ATTR",
    "ElasticRuntime",
    "GrowPause",
    "current_runtime",
    "deferred_sync_generation",
    "mark_restored",
    "run_elastic",
    "settings_of",
    "warm_up",
]

logger = logging.getLogger("ringtrain")


def current_runtime() -> ElasticRuntime | None:
    """This worker's elastic plug-in (registered in its session by :func:`run_elastic`), or None
    outside an elastic run."""
    session = installed_session()
    return session.hooks.find(ElasticRuntime) if session is not None else None


def settings_of(ctx: DistributedContext) -> ElasticSettings | None:
    """The run's elastic settings (``WorkerConfig.elastic``); ``None`` outside an elastic run."""
    return ctx.config.elastic


def deferred_sync_generation() -> int | None:
    """:meth:`ElasticRuntime.sync_token` of this worker's elastic plug-in (None outside one)."""
    runtime = current_runtime()
    return runtime.sync_token() if runtime is not None else None


def mark_restored(module: Any, checkpoint: object) -> None:
    """:meth:`ElasticRuntime.mark_restored` of this worker's elastic plug-in (nothing outside
    one)."""
    runtime = current_runtime()
    if runtime is not None:
        runtime.mark_restored(module, checkpoint)


def run_elastic(
    train_fn: Callable[..., object], config: Mapping[str, Any] | None, session: Session
) -> None:
    """Register the elastic plug-in in ``session`` and call ``train_fn`` (as
    :func:`ringtrain.worker.session.call_train_fn` does) until it returns, re-entering it in place
    after each resize.

    Raises:
        Whatever ``train_fn`` raises that is not the loss of a peer, and errors of re-forming
        the group (the driver then restarts the group from the disk checkpoint).
    """
    settings = settings_of(session.context)
    assert settings is not None
    runtime = ElasticRuntime(session, settings)
    session.hooks.register(runtime)  # its on_worker_stop runs when the bootstrap's does
    # What is alive now (torch's and the train function's modules, classes, functions: some
    # 170,000 objects) lives as long as the process: freeze it out of the collector, so that the
    # gc.collect() after each resize scans only the train function's own objects (0.07 s less
    # per resize, measured with torch 2.13).
    gc.freeze()
    if settings.joining and session.channel is not None:
        runtime.start_joining()  # the state comes from a member, by broadcast
    else:
        runtime.init_first_group()
    while True:
        grow, left_at = False, None
        try:
            call_train_fn(train_fn, config)
            return
        except GrowPause as pause:
            exc_type, message, grow = "GrowPause", str(pause), True
            left_at = time.time()
        except Exception as exc:
            if not is_peer_lost(exc) or session.channel is None:
                raise
            exc_type, message = type(exc).__name__, str(exc)
            logger.warning(
                "elastic: rank %d lost a peer (%s)", session.context.world_rank, exc_type
            )
        gc.collect()  # the failed call's model, DDP reducer and loader iterators
        runtime.recover(exc_type, message, grow=grow, left_at=left_at)
