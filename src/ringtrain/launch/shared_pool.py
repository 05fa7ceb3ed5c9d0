"""One warm worker pool shared by several fits: ``with rt.warm_pool(): ...``.

Each local fit with ``ScalingConfig.warm_start`` (the default) starts its own
:class:`~ringtrain.launch.pool.WorkerPool`: a zygote that imports torch (~2-3 CPU-s), forks the
run's workers and is stopped when the fit ends. Inside a :func:`warm_pool` block every such fit
of this driver process forks its workers from the block's zygote instead, which starts once (at
the first fit) and stops when the block exits::

    with rt.warm_pool():
        rt.Trainer(train_a, scaling).fit()
        rt.Trainer(train_b, scaling).fit()   # no second `import torch`

With ``warm_pool(start=True)`` the zygote starts when the block opens, so that its imports
overlap the driver's own (a preemptible job's driver, started again after each notice).

A fit inside the block behaves as one outside it. What a worker gets per spawn (its whole
environment, cwd, argv, output pipes, the run's ``RINGTRAIN_*`` and torch variables) is sent
with each request; what the zygote fixed when it started (the environment its interpreter and
torch read at start-up, e.g. ``PYTHONHASHSEED``, ``OMP_*``, locale; ``sys.path``; the working
directory) is compared at each fit with the driver's at that moment, and if any of it changed
(or the zygote died) the fit gets a fresh zygote: the old one stops once no fit uses it.
Only the variables of :data:`VOLATILE_ENV` are left out of the comparison.

One difference remains: the pool's reaper sweeps its run token when the pool closes, so a
process a worker started outside its process group without ``exec`` (which therefore carries
only the zygote's token) is swept at the block's end instead of the fit's. Workers themselves
and their process groups are stopped by each fit, as without the block.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping

from ringtrain.launch.pool import PoolUnavailable, WorkerPool

logger = logging.getLogger("ringtrain")

VOLATILE_ENV = frozenset({"PYTEST_CURRENT_TEST", "CRC32C_SW_MODE"})
"""Variables left out when a fit's environment is compared with its shared zygote's, because
the driver changes them by itself and the zygote never reads them: pytest sets
``PYTEST_CURRENT_TEST`` per test phase; tensorboardX sets ``CRC32C_SW_MODE`` when the driver's
TensorBoard sink is first imported (at the first fit), and only a worker that imports it reads
it, from its own environment."""


@dataclasses.dataclass(frozen=True)
class PoolKey:
    """What a zygote fixed when it started: the driver's environment, ``sys.path`` and working
    directory at that moment (a fit whose own differ needs another zygote)."""

    env: Mapping[str, str]
    path: tuple[str, ...]
    cwd: str

    @classmethod
    def now(cls) -> PoolKey:
        """This process's environment (less :data:`VOLATILE_ENV`), ``sys.path`` and cwd."""
        env = {k: v for k, v in os.environ.items() if k not in VOLATILE_ENV}
        return cls(env=env, path=tuple(sys.path), cwd=os.getcwd())

    def differences(self, other: PoolKey) -> list[str]:
        """What differs from ``other``, in words: changed variables by name (never their
        values, which may be secrets), then ``sys.path`` and the working directory."""
        names = sorted(k for k in {*self.env, *other.env} if self.env.get(k) != other.env.get(k))
        found = [f"environment variable {name}" for name in names]
        if self.path != other.path:
            found.append("sys.path")
        if self.cwd != other.cwd:
            found.append("the working directory")
        return found


class WarmPool:
    """The handle :func:`warm_pool` yields: the block's zygote(s), shared by the local fits
    of this process while the block is open.

    Attributes:
        reasons: why each zygote after the first was started (the previous one died, or the
            driver's environment, ``sys.path`` or cwd changed since it started), in order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: WorkerPool | None = None
        self._key: PoolKey | None = None
        self._users: dict[WorkerPool, int] = {}  # pools in use by running fits
        self._started: list[WorkerPool] = []
        self._closed = False
        self._owner_pid = os.getpid()  # a forked child of the driver does not share it
        self.depth = 0  # open warm_pool blocks (nested, or on several threads)
        self.reasons: list[str] = []

    @property
    def started(self) -> int:
        """How many zygotes this block started (1 after the first fit, unless replaced)."""
        return len(self._started)

    @property
    def zygote_pid(self) -> int | None:
        """The current zygote's pid (the parent of the workers the next fit forks), or
        ``None`` before the first fit and after the block."""
        pool = self._pool
        return pool.zygote_pid if pool is not None else None

    def helper_pids(self) -> set[int]:
        """The driver's children that the block holds now: each live zygote and its reaper
        (for leak checks: they are expected while the block is open)."""
        with self._lock:
            pools = [self._pool, *self._users]
        return {pid for pool in pools if pool is not None for pid in pool.helper_pids()}

    def helper_threads(self) -> set[threading.Thread]:
        """The driver threads the block holds now (one reader per live zygote)."""
        with self._lock:
            pools = [self._pool, *self._users]
        return {pool.reader_thread for pool in pools if pool is not None}

    def start(self) -> None:
        """Start the block's zygote now instead of at the first fit (a no-op when a zygote that
        can serve this process's environment, ``sys.path`` and cwd is already up), so that its
        ``import torch`` overlaps whatever the driver does before its first ``fit()``, e.g.
        its own imports (:func:`warm_pool` with ``start=True``).

        Raises:
            PoolUnavailable: the block has ended, or this is a forked copy of the driver.
            OSError: the zygote could not start (the first fit then tries again, and starts its
                workers cold if that fails too).
        """
        with self._lock:
            self._current()

    def acquire(self) -> WorkerPool:
        """The zygote for a fit starting now (started or replaced first if needed); give it
        back with :meth:`release` when the fit ends.

        Raises:
            PoolUnavailable: the block has ended, or this is a forked copy of the driver.
            OSError: a fresh zygote could not start (the fit then starts its workers cold).
        """
        with self._lock:
            pool = self._current()
            self._users[pool] = self._users.get(pool, 0) + 1
            return pool

    def _current(self) -> WorkerPool:
        """The zygote that serves this process as it is now, started (or replaced) first if
        needed; the caller holds the lock."""
        if self._closed or os.getpid() != self._owner_pid:
            raise PoolUnavailable("the warm_pool block this handle belongs to has ended")
        key = PoolKey.now()
        reason = self._stale(key)
        if reason is not None:
            self._retire_current()
            pool = WorkerPool()
            self._pool, self._key = pool, key
            if self._started:
                self.reasons.append(reason)
                logger.info("warm_pool: %s: starting a fresh one", reason)
            self._started.append(pool)
        assert self._pool is not None
        return self._pool

    def release(self, pool: WorkerPool) -> None:
        """The fit that got ``pool`` from :meth:`acquire` ended; a pool that was replaced
        meanwhile stops once no fit uses it."""
        with self._lock:
            left = self._users.get(pool, 0) - 1
            if left > 0:
                self._users[pool] = left
                return
            self._users.pop(pool, None)
            done = pool is not self._pool or self._closed
        if done:
            pool.close()

    def close(self) -> None:
        """Stop every zygote of the block (with the workers it still runs) and its reaper."""
        with self._lock:
            self._closed = True
            pools = list(dict.fromkeys([p for p in (self._pool, *self._users) if p is not None]))
            self._pool, self._key = None, None
            self._users.clear()
        for pool in pools:
            pool.close()

    def _stale(self, key: PoolKey) -> str | None:
        """Why the current zygote cannot serve a fit of ``key`` (``""``: there is none yet),
        or ``None`` when it can."""
        pool, started = self._pool, self._key
        if pool is None or started is None:
            return ""
        if not pool.alive:
            return f"the shared warm pool's zygote (pid {pool.zygote_pid}) is gone"
        changed = started.differences(key)
        if changed:
            return (
                f"{', '.join(changed)} changed since the shared warm pool's zygote "
                f"(pid {pool.zygote_pid}) started"
            )
        return None

    def _retire_current(self) -> None:
        """Stop the current zygote now if no fit uses it (else its last user stops it)."""
        pool, self._pool, self._key = self._pool, None, None
        if pool is not None and pool not in self._users:
            pool.close()


_active: WarmPool | None = None
_active_lock = threading.Lock()


def active() -> WarmPool | None:
    """The open :func:`warm_pool` block's handle, or ``None`` (outside any block, or in a
    process forked from the driver)."""
    shared = _active
    if shared is None or shared._owner_pid != os.getpid():
        return None
    return shared


@contextlib.contextmanager
def warm_pool(start: bool = False) -> Iterator[WarmPool]:
    """Share one warm worker pool among the local fits of this process while the block is
    open (see the module docstring); the pool stops when the block exits.

    Args:
        start: start the zygote when the block opens instead of at the first fit, so that its
            ``import torch`` (~1-2 s of one core) runs while the driver imports its own modules.
            A driver that is started again and again (a preemptible job resumed after each
            notice, a requeued SLURM job) opens the block before it imports torch and the
            train function's module, and its workers are up 1-1.5 s sooner on 2 cores
            (docs/fault-tolerance.md, "Resuming fast"). If the driver then changes its
            environment, ``sys.path`` or cwd before the first fit, that fit starts a fresh
            zygote (as without ``start``). A zygote that cannot start is not an error here:
            the first fit tries again, then starts its workers cold.

    The block covers every ``Trainer.fit()`` with ``backend="local"`` and ``warm_start=True``
    (the defaults) made in this process while it is open, on any thread. A nested block (or
    one opened on another thread meanwhile) joins the open one, whose pool stops when the last
    block exits. A ``ringtrain.tune.Tuner`` sweep run in the block forks its trials' workers
    from the block's zygote too (outside a block, a sweep shares a pool of its own among its
    trials). Fits with ``warm_start=False``, on Ray, or given their own ``launcher=`` are
    unaffected.

    Example::

        with rt.warm_pool() as pool:
            rt.Trainer(train_a, rt.ScalingConfig(num_workers=2)).fit()
            rt.Trainer(train_b, rt.ScalingConfig(num_workers=4)).fit()  # same zygote
            print(pool.zygote_pid, pool.started, pool.reasons)

    Yields:
        WarmPool: the block's handle (``zygote_pid``, ``started``, ``reasons``).
    """
    global _active
    with _active_lock:
        shared = active()
        if shared is None:
            shared = _active = WarmPool()
        shared.depth += 1
    try:
        if start:
            try:
                shared.start()
            except OSError as exc:
                logger.info(
                    "warm_pool: the zygote could not start now (%s); the first fit tries again", exc
                )
        yield shared
    finally:
        with _active_lock:
            shared.depth -= 1
            last = shared.depth == 0
            if last and _active is shared:
                _active = None
        if last:
            shared.close()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Inside an open block: fits start their own pools (as outside any block) until this
    exits. For tests of the per-fit pool, start-up and process hygiene (``tests/conftest.py``'s
    ``own_pool`` marker)."""
    global _active
    with _active_lock:
        held, _active = _active, None
    try:
        yield
    finally:
        with _active_lock:
            _active = held
