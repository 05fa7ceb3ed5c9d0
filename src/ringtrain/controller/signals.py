"""How a driver's run ends on a signal: SIGTERM turned into a Ctrl-C-like interruption
(:class:`DriverTerminated`, for callers that want it: a sweep), and a SLURM job requeued after
a run that ended ``PREEMPTED``. Re-exported by :mod:`ringtrain.trainer`.
"""

from __future__ import annotations

import contextlib
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
