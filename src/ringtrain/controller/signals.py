"""How a driver's run ends on a signal: SIGTERM turned into a Ctrl-C-like interruption
(:class:`DriverTerminated`, for callers that want it: a sweep), and a SLURM job requeued after
a run that ended ``PREEMPTED``. Re-exported by :mod:`ringtrain.trainer`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ringtrain.cluster import slurm
from ringtrain.config import RunConfig


def _requeue_if_preempted(status: str, run_config: RunConfig) -> None:
    """Inside a SLURM job, requeue it after a run that ended ``PREEMPTED`` (unless
    ``FailureConfig.slurm_requeue`` is False); say what was done, or why scontrol failed, on
    stderr in one line. Never raises: the run's status stays ``PREEMPTED``."""
    outcome = slurm.requeue_after_preemption(
        status, enabled=run_config.failure_config.slurm_requeue
    )
    if outcome.attempted:
        print(f"ringtrain: {outcome.message}", file=sys.stderr, flush=True)


class DriverTerminated(KeyboardInterrupt):
    """The driver received SIGTERM; raised like Ctrl-C so that workers are stopped and the run
    directory records ``ABORTED``."""


def interrupted(exc: KeyboardInterrupt, storage_path: str, name: str) -> KeyboardInterrupt:
    """What ``Trainer.fit`` raises once a Ctrl-C (or :class:`DriverTerminated`) has stopped the
    run's workers and recorded it ``ABORTED``: an exception of the same class whose message is
    the whole story, the run stopped and how to continue it (the caller drops the traceback
    through the controller)."""
    why = str(exc) if isinstance(exc, DriverTerminated) and str(exc) else "interrupted by Ctrl-C"
    if "://" in storage_path:
        where = storage_path.rstrip("/") + "/" + name
    else:
        where = os.path.normpath(os.path.join(storage_path, name))
    return type(exc)(
        f"run {name!r} stopped: {why}; workers stopped; continue it with "
        f"rt.Trainer.restore({where!r}).fit()"
    )


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While active, turn SIGTERM into an interruption with the same orderly shutdown as Ctrl-C
    (on the main thread only). ``Trainer.fit`` no longer uses it: SIGTERM to the driver is a
    preemption notice (:class:`ringtrain.preemption.SignalNotice`); kept for callers of it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise DriverTerminated(f"the driver received {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
