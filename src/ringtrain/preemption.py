"""Preemption notices on the driver: what says "the workers will be taken away", and how.

A :class:`PreemptionNotice` tells the controller that the cluster will take the workers away
soon (a spot instance's two-minute warning, SLURM's ``--signal``, a Ray node drain). The
controller then asks every worker to stop at one agreed ``TrainState.step`` boundary, save its
``TrainState`` there (verified and published like any checkpoint) and exit; the run ends
``PREEMPTED`` and a later ``fit()`` of the same run name resumes from that checkpoint, having lost
no step (docs/fault-tolerance.md, "Preemption").

Notices come from **notice sources**: small objects with ``start(notify)`` and ``stop()``
(:class:`NoticeSource`). The driver always runs a :class:`SignalNotice` (SIGTERM and SIGUSR1 to
the driver); a user adds others through ``FailureConfig(notice_sources=[...])``, for example a
:class:`CallableNotice` that polls a cloud metadata endpoint::

    def spot_reclaimed() -> str | None:
        r = requests.get("http://169.254.169.254/latest/meta-data/spot/instance-action", timeout=1)
        return "spot reclaim" if r.status_code == 200 else None

    rt.FailureConfig(preemption_grace_s=90,
                     notice_sources=[rt.preemption.CallableNotice(spot_reclaimed, interval_s=5)])

Writing a source: ``start(notify)`` is called once on the driver's main thread before the first
worker starts; from then on, until ``stop()``, the source calls ``notify(notice)`` whenever it
learns of a preemption, from any thread or from a signal handler (``notify`` only appends to a
lock-free queue the controller drains; it never blocks and never raises). ``stop()`` is called
once when the run ends, on every exit path; it must end the source's threads and restore what
``start`` changed (signal handlers). A notice for only some workers sets ``ranks``; the
controller treats a partial notice as one for every rank unless the run can shrink in place.

This module imports neither torch nor the controller: configs and the command line use it.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic as _monotonic
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "CallableNotice",
    "FileNotice",
    "NoticeSource",
    "Notify",
    "PreemptionNotice",
    "SignalNotice",
]

logger = logging.getLogger("ringtrain")


@dataclass(frozen=True)
class PreemptionNotice:
    """The cluster will take (some of) the workers away.

    Attributes:
        time: when the notice was received (Unix seconds, wall clock).
        deadline_s: seconds from ``time`` until the workers are killed, as the source knows it
            (a cloud's two-minute warning); ``None``: the source does not know, and
            ``FailureConfig.preemption_grace_s`` applies.
        reason: free text for the logs and events (``"SIGTERM to the driver"``).
        source: which kind of source sent it (``"signal"``, ``"callable"``, ``"worker-signal"``,
            ``"ray-drain"``...).
        ranks: the worker ranks the notice covers; ``None``: every rank.
        monotonic: ``time.monotonic()`` when the notice was received (the deadline is kept on
            this clock, which no NTP step moves).
    """

    time: float
    deadline_s: float | None = None
    reason: str = ""
    source: str = ""
    ranks: tuple[int, ...] | None = None
    monotonic: float = field(default_factory=_monotonic)

    def grace_s(self, preemption_grace_s: float) -> float:
        """The seconds the workers get from the notice: the source's own deadline when it
        knows one (the kill comes then), else ``preemption_grace_s`` (FailureConfig)."""
        if self.deadline_s is None:
            return preemption_grace_s
        return max(0.0, float(self.deadline_s))

    def deadline(self, preemption_grace_s: float) -> float:
        """When the workers are killed, on the ``time.monotonic()`` clock."""
        return self.monotonic + self.grace_s(preemption_grace_s)

    @classmethod
    def now(
        cls,
        reason: str,
        source: str,
        *,
        deadline_s: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> PreemptionNotice:
        """A notice received now."""
        return cls(
            time=time.time(),
            deadline_s=deadline_s,
            reason=reason,
            source=source,
            ranks=tuple(ranks) if ranks is not None else None,
        )


Notify = Callable[[PreemptionNotice], None]
"""What a source calls with each notice (thread- and signal-handler-safe, never blocks)."""


@runtime_checkable
class NoticeSource(Protocol):
    """Something that learns of preemptions and tells the controller (see the module docs)."""

    def start(self, notify: Notify) -> None:
        """Begin watching; call ``notify(notice)`` for each preemption learnt of until
        :meth:`stop`. Called once, on the driver's main thread when ``fit()`` runs there."""
        ...

    def stop(self) -> None:
        """Stop watching and undo what :meth:`start` changed. Idempotent."""
        ...


class SignalNotice:
    """SIGTERM or SIGUSR1 (by default) to the driver is a preemption notice: what schedulers send
    before they kill a job (SLURM's ``--signal=USR1@90``, Kubernetes' SIGTERM before SIGKILL).
    SIGINT (Ctrl-C) is not: it still stops the run at once.

    Signal handlers can only be installed on the main thread: from another thread (``fit()``
    inside a sweep's thread) :meth:`start` does nothing.

    Args:
        signals: the signals that are notices.
        deadline_s: what the scheduler grants after the signal (seconds; ``None``: unknown,
            ``FailureConfig.preemption_grace_s`` applies).

    Raises:
        ValueError: if ``signals`` is empty or holds SIGINT or SIGKILL.
    """

    def __init__(
        self,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGUSR1),
        deadline_s: float | None = None,
    ) -> None:
        sigs = tuple(signal.Signals(s) for s in signals)
        if not sigs:
            raise ValueError("SignalNotice(signals=...) needs at least one signal")
        for s in sigs:
            if s in (signal.SIGINT, signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(
                    f"SignalNotice(signals=...) cannot use {s.name}: SIGINT stops a run at once "
                    "(Ctrl-C) and SIGKILL/SIGSTOP cannot be caught; use SIGTERM or SIGUSR1"
                )
        self.signals = sigs
        self.deadline_s = deadline_s
        self._previous: dict[signal.Signals, Any] = {}

    def __repr__(self) -> str:
        return f"SignalNotice(signals=({', '.join(s.name for s in self.signals)}))"

    def start(self, notify: Notify) -> None:
        if threading.current_thread() is not threading.main_thread():
            logger.debug("SignalNotice: not on the main thread, signals are not watched")
            return

        def handler(signum: int, frame: Any) -> None:
            name = signal.Signals(signum).name
            notify(
                PreemptionNotice.now(
                    f"{name} to the driver (pid {os.getpid()})",
                    "signal",
                    deadline_s=self.deadline_s,
                )
            )

        for s in self.signals:
            self._previous[s] = signal.signal(s, handler)

    def stop(self) -> None:
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous.clear()


class CallableNotice:
    """A user function polled by a driver thread every ``interval_s`` seconds: a non-empty
    string (the reason) or ``True`` is a notice; ``None``/``False``/``""`` is none. Use it for a
    cloud metadata endpoint (GCP ``preempted``, AWS ``spot/instance-action``). After a notice
    the function is not called again. An exception it raises is logged and polling goes on.

    Args:
        fn: the check, called with no argument; it should return within ``interval_s``.
        interval_s: seconds between calls (> 0).
        deadline_s: what the cloud grants after the notice (seconds; ``None``: unknown,
            ``FailureConfig.preemption_grace_s`` applies).
        name: the ``source`` of its notices.

    Raises:
        TypeError: if ``fn`` is not callable.
        ValueError: if ``interval_s`` is not a positive number.
    """

    def __init__(
        self,
        fn: Callable[[], object],
        interval_s: float = 5.0,
        deadline_s: float | None = None,
        name: str = "callable",
    ) -> None:
        if not callable(fn):
            raise TypeError(f"CallableNotice(fn=...) must be callable, got {type(fn).__name__}")
        if (
            isinstance(interval_s, bool)
            or not isinstance(interval_s, (int, float))
            or not interval_s > 0
            or math.isinf(interval_s)
        ):
            raise ValueError(
                f"CallableNotice(interval_s=...) must be a positive number of seconds, got "
                f"{interval_s!r}"
            )
        self.fn = fn
        self.interval_s = float(interval_s)
        self.deadline_s = deadline_s
        self.name = name
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"CallableNotice({getattr(self.fn, '__name__', self.fn)!r}, {self.interval_s:g})"

    def start(self, notify: Notify) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._poll, args=(notify,), name="ringtrain-notice-poll", daemon=True
        )
        self._thread.start()

    def _poll(self, notify: Notify) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                said = self.fn()
            except Exception:
                logger.exception("CallableNotice: %r raised; polling goes on", self.fn)
                continue
            if said:
                reason = said if isinstance(said, str) else f"{self!r} said so"
                notify(PreemptionNotice.now(reason, self.name, deadline_s=self.deadline_s))
                return

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(1.0, self.interval_s))


class FileNotice(CallableNotice):
    """A notice when ``path`` exists (a shared-filesystem flag, or a test's stand-in for a cloud
    endpoint): a :class:`CallableNotice` reading the file; its first line, if any, is the
    reason.

    A file may be seen half written (``echo reason > flag`` creates the file, then writes): a
    first line that ends with a newline is taken at once; an empty file, or a first line
    without its newline, only once the file has not changed for ``settle_s`` (then the reason
    is that line, or "<path> exists" for an empty file). Writing the file atomically (to a
    temporary name, then :func:`os.replace`) avoids the wait.

    Args:
        path: the flag file.
        interval_s: seconds between polls (> 0).
        settle_s: how long an empty or unterminated file must stay unchanged (>= 0).

    Raises:
        ValueError: if ``interval_s`` is not positive or ``settle_s`` is negative.
    """

    def __init__(
        self, path: str | os.PathLike[str], interval_s: float = 1.0, settle_s: float = 1.0
    ) -> None:
        if (
            isinstance(settle_s, bool)
            or not isinstance(settle_s, (int, float))
            or not (0 <= settle_s < math.inf)
        ):
            raise ValueError(
                f"FileNotice(settle_s=...) must be a number of seconds >= 0, got {settle_s!r}"
            )
        self.path = os.fspath(path)
        self.settle_s = float(settle_s)
        self._seen: tuple[bytes, float] | None = None  # (content, monotonic time first seen)
        super().__init__(self._check, interval_s=interval_s, name="file")

    def __repr__(self) -> str:
        return f"FileNotice({self.path!r})"

    def _check(self) -> str | None:
        try:
            with open(self.path, "rb") as f:
                head = f.read(4096)
        except FileNotFoundError:
            self._seen = None
            return None
        except OSError:
            return f"{self.path} exists"  # there, but unreadable: still a notice
        line, newline, _ = head.partition(b"\n")
        if not newline:  # empty, or half a line: wait until it stops changing
            now = time.monotonic()
            if self._seen is None or self._seen[0] != head:
                self._seen = (head, now)
                if self.settle_s > 0:
                    return None
            elif now - self._seen[1] < self.settle_s:
                return None
        first = line.decode("utf-8", "replace").strip()
        return first or f"{self.path} exists"


def check_sources(owner: str, sources: object) -> tuple[NoticeSource, ...]:
    """``sources`` as a tuple of :class:`NoticeSource`.

    Raises:
        TypeError: naming ``owner`` and the offending item when one has no ``start``/``stop``.
    """
    if isinstance(sources, (str, bytes)) or not isinstance(sources, (list, tuple)):
        raise TypeError(
            f"{owner} must be a list of notice sources (objects with start(notify) and stop(), "
            f"e.g. ringtrain.preemption.CallableNotice), got {type(sources).__name__}"
        )
    for item in sources:
        if not isinstance(item, NoticeSource):
            raise TypeError(
                f"{owner}: {item!r} is not a notice source: it needs start(notify) and stop() "
                "methods (see ringtrain.preemption.NoticeSource)"
            )
    return tuple(sources)
