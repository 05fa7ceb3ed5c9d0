"""The worker side of preemption: stop at one agreed step, save the ``TrainState`` there, exit.

:class:`PreemptionPlugin` is a worker plug-in (:mod:`ringtrain.worker.hooks`) the worker bootstrap
registers in every ringtrain-launched worker. At each ``TrainState.step`` boundary (``on_step``)
it reads the driver's messages waiting on the channel (:meth:`Session.poll_driver
<ringtrain.worker.session.Session.poll_driver>`, the one reader of driver messages on a worker) and
every rank allreduces (MAX), on a process group of its own (:data:`AGREEMENT`), a "stop
requested" flag and its step: the flag is 1 once a
:class:`~ringtrain.wire.channel.PreemptRequest` arrived, or this process itself received SIGTERM
from someone other than the driver. Ranks see the request at different steps, but the first boundary
where the MAX is 1 is the same on every rank: the **stop step**. Each rank then lets the rest of
that iteration run (the user's own ``report()`` of that step included) and, when a prepared data
loader is asked for the next batch (``on_batch_start``; in a loop without one, at the next step
boundary), saves its ``TrainState`` through the normal checkpoint path (one more ``report()``
round with the last metrics, verified and published by the driver like any other), says
:class:`~ringtrain.wire.channel.PreemptSaved` and leaves the train function with
:class:`PreemptStop`, which the bootstrap treats as a clean finish (it waits for the background
write, then says ``Done``).

The TrainState saved is the one whose ``step`` setter ran the hook; a train function without a
``TrainState`` has nothing to save: it stops at the agreed step and the run resumes from its
last own checkpoint.

**Every rank must set ``TrainState.step`` at the same steps**: each set joins this collective.
A rank that sets it while the others do not (``if rank == 0: state.step += 1``) waits for them
for at most :func:`agreement_timeout_s` and then fails with :class:`StepAgreementError` naming
the step; ranks that set it at different counts (one sets it twice per batch) fail with it at
once, since the agreement compares the steps. The agreement has its own process group, so a
mismatch never pairs it with the model's collectives (DDP's gradient allreduce).


**SIGTERM to a worker** (a node going away with the whole process tree, or someone signalling
the workers' process groups): :func:`watch_worker_signals` blocks SIGTERM in every thread of the
worker (called first thing in the bootstrap, before any thread starts) and waits for it on a
thread with ``sigwaitinfo``, which says who sent it. From the driver (the worker's parent, or its
grandparent when the parent is a ringtrain fork server: :func:`launchers`; stopping the group,
as on every restart) it terminates the process as before; from anyone else
it is a notice: the rank tells the driver (:class:`~ringtrain.wire.channel.WorkerNotice`), raises
its flag and keeps training until the stop step.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ringtrain.cluster.distributed import collective_timeout_s, new_gloo_group, settle
from ringtrain.wire.channel import PreemptRequest, PreemptSaved, WorkerNotice
from ringtrain.worker.hooks import StepState, StopTraining, WorkerPlugin
from ringtrain.worker.session import Session

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("ringtrain")

WATCHED = frozenset({signal.SIGTERM})
"""The signals a worker treats as a preemption notice when they do not come from its driver."""

AGREEMENT = "ringtrain step agreement"
"""What the agreement's own gloo process group is: made by every rank when the default group is
formed (the ``on_group_formed`` hook: the bootstrap, an elastic resize), or at the first step
boundary where the train function formed the default group itself (script mode)."""


class StepAgreementError(RuntimeError):
    """``TrainState.step`` was not set on every rank at the same steps (see the module docs)."""


def agreement_timeout_s(worker_timeout_s: float | None) -> float:
    """How long a rank waits at a step boundary for every rank's part of the previous step's
    agreement (seconds): half of ``FailureConfig.worker_timeout_s`` (at least 5 s), so that the
    rank that set the step names the mismatch before the driver's hang detection blames a rank
    stuck behind it; the collective timeout (1800 s) without one. Ranks in step (data-parallel
    lockstep) have started it long before: a rank waits only for a peer less than a step behind.
    """
    if worker_timeout_s is None:
        return collective_timeout_s(None)
    return min(collective_timeout_s(worker_timeout_s), max(worker_timeout_s / 2, 5.0))


class PreemptStop(StopTraining):
    """Raised out of the train function after the stop step's state was saved (internal). A
    :class:`~ringtrain.worker.hooks.StopTraining`, so the bootstrap ends the worker cleanly; a
    BaseException, so a train function's ``except Exception`` lets it pass."""


class PreemptionPlugin(WorkerPlugin):
    """One worker's part in stopping for a preemption (see the module docs).

    Args:
        session: the worker's :class:`~ringtrain.worker.session.Session` (with a channel).

    Attributes:
        agree_when: ``None`` (agree at every step boundary), or a predicate of
            ``TrainState.step`` that every rank evaluates alike: agree only at the steps where
            it holds. DiLoCo sets it to its sync steps (``DiLoCoConfig.preempt_at_sync``): no
            collective of every rank between two syncs, and a notice stops at most two
            agreement intervals after it arrived (the agreement is pipelined: the stop step is
            the first agreement boundary after the one where a flag was raised).
    """

    def __init__(self, session: Session) -> None:
        self.session = session
        self.reason: str | None = None  # why this rank wants to stop (None: it does not)
        self.stop_after: int | None = None  # the agreed stop step, once agreed
        self.state: StepState | None = None  # the TrainState to save at the stop
        # The flag's allreduce in flight (started at the previous boundary), its buffer, and the
        # process group it runs on (an elastic resize replaces the group: then it is dropped).
        self._pending: tuple[Any, torch.Tensor, object] | None = None
        self._group: Any = None  # the agreement's process group, and the default group it
        self._group_for: Any = None  # was made for (an elastic resize replaces that one)
        self._lock = threading.Lock()
        self.allreduces = 0  # steps agreed on (for tests and the overhead benchmark)
        # Agree only at the steps this says (None: every step). DiLoCo sets it to its sync
        # steps (DiLoCoConfig.preempt_at_sync): no collective of every rank between syncs.
        self.agree_when: Callable[[int], bool] | None = None

    # ------------------------------------------------------------------ notices
    def request(self, reason: str) -> None:
        """Raise this rank's stop flag (thread-safe; the first reason wins)."""
        with self._lock:
            if self.reason is None:
                self.reason = reason

    def signalled(self, signum: int, sender: int) -> None:
        """This process received ``signum`` from process ``sender`` (not the driver): tell the
        driver, and stop at the next agreed step even before its answer comes."""
        reason = f"{signal.Signals(signum).name} to rank {self.session.context.world_rank}"
        if sender > 0:
            reason += f" from pid {sender}"
        if self.session.context.config.elastic is None:
            # An elastic run's driver decides: this rank leaves in place, or every rank stops.
            self.request(reason)
        channel = self.session.channel
        if channel is None:
            return
        try:
            channel.send(WorkerNotice(self.session.context.world_rank, time.time(), reason))
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ hooks
    def on_group_formed(self) -> None:
        """Make the agreement's gloo group over the new default group (every rank does, now)."""
        import torch.distributed as dist

        if self.session.context.world_size > 1 and dist.is_initialized():
            self._new_group(step=None)

    def on_group_broken(self) -> None:
        """The group is being torn down (an elastic resize): finish the flag allreduce in flight
        (it ends at once: the connections were ended) and drop it and the agreement's group
        (:func:`~ringtrain.cluster.distributed.settle`; see ``WorkerPlugin.on_group_broken``).
        Held into the next generation, their last reference dropped at its first step boundary
        ran the old group's destructor there, which could block the training thread."""
        pending, self._pending = self._pending, None
        group, self._group, self._group_for = self._group, None, None
        if pending is not None and not settle(pending[0], pending[2], group):
            logger.warning("preemption agreement: a flag allreduce did not end with its group")

    def on_step(self, state: StepState) -> None:
        """Agree, with one allreduce, whether any rank must stop (see the module docs).

        Raises:
            PreemptStop: the stop step was agreed at the previous boundary and no batch was
                fetched from a prepared loader since (a loop without one): saved here first.
        """
        if self.stop_after is not None:
            self._stop(state)
        self.session.poll_driver()
        for message in self.session.take_messages(PreemptRequest):
            self.request(message.reason or "preemption notice from the driver")
        if self.agree_when is not None and not self.agree_when(int(state.step)):
            return
        if self._agreed(int(state.step)):
            self.stop_after = int(state.step)
            self.state = state
            logger.info(
                "rank %d: stopping for a preemption after step %d (%s)",
                self.session.context.world_rank,
                self.stop_after,
                self.reason or "another rank was asked",
            )

    def on_batch_start(self) -> None:
        """Before the next batch after the stop step: save and leave the train function."""
        if self.stop_after is not None and self.state is not None:
            self._stop(self.state)

    # ------------------------------------------------------------------ the stop
    def _agreed(self, step: int) -> bool:
        """Whether any rank raised its flag, agreed over the group with a MAX allreduce (the
        local flag alone at world size 1 or without a process group).

        Pipelined so that it costs no wait: each boundary starts the allreduce of this rank's
        flag and step asynchronously and reads the one started at the previous boundary (done by
        now: the step's compute ran meanwhile). Every rank reads the same result at the same
        boundary, so the stop step is the same everywhere, one step after the flag was raised.

        Raises:
            StepAgreementError: the ranks set ``TrainState.step`` at different steps, or not
                every rank joined the previous boundary's agreement within
                :func:`agreement_timeout_s`.
        """
        flag = int(self.reason is not None)
        ctx = self.session.context
        if ctx.world_size <= 1:
            return bool(flag)
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return bool(flag)
        group = self._agreement_group(step)
        agreed = False
        pending, self._pending = self._pending, None
        if pending is not None and pending[2] is group:
            agreed = self._read(pending, step)
        box = torch.tensor([flag, step, -step], dtype=torch.int64)
        work = dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._pending = (work, box, group)
        self.allreduces += 1
        return agreed

    def _agreement_group(self, step: int) -> Any:
        """The agreement's gloo group over the current default group's ranks (made when the
        group formed; made here, at the first boundary, when the train function formed it)."""
        import torch.distributed as dist

        if self._group is None or self._group_for is not dist.group.WORLD:
            self._new_group(step)
        return self._group

    def _new_group(self, step: int | None) -> None:
        """Make the agreement's group (a collective of the default group's ranks); ``step``:
        the boundary that makes it (``None``: when the default group formed)."""
        import torch.distributed as dist

        timeout = agreement_timeout_s(self.session.context.worker_timeout_s)
        try:
            self._group = new_gloo_group(timeout)
        except RuntimeError as exc:  # the store-based rendezvous of new_group timed out
            if step is None or not _timed_out(exc):
                raise
            raise self._missing(step, timeout) from exc
        self._group_for = dist.group.WORLD

    def _read(self, pending: tuple[Any, Any, object], step: int) -> bool:
        """The previous boundary's agreement: any rank's flag (checking that every rank was at
        the same step)."""
        work, box, _ = pending
        timeout = agreement_timeout_s(self.session.context.worker_timeout_s)
        try:
            work.wait()
        except RuntimeError as exc:
            if not _timed_out(exc):
                raise  # a peer is gone (its connections closed): not a mismatch
            raise self._missing(step - 1, timeout) from exc  # not every rank joined in time
        flag, high, low = (int(v) for v in box.tolist())
        if high != -low:
            raise StepAgreementError(
                f"rank {self.session.context.world_rank}: TrainState.step differs across ranks "
                f"(from {-low} to {high} at the same boundary): setting state.step joins a "
                "collective of every rank (the preemption agreement), so every rank must set it "
                "at the same steps, the same number of times"
            )
        return bool(flag)

    def _missing(self, step: int, timeout_s: float) -> StepAgreementError:
        return StepAgreementError(
            f"rank {self.session.context.world_rank} set TrainState.step to {step} and the "
            f"other ranks did not within {timeout_s:g} s: setting state.step joins a collective "
            "of every rank (the preemption agreement), so every rank must set it at the same "
            "steps (not only on some ranks, e.g. inside `if rank == 0:`)"
        )

    def on_worker_stop(self, error: BaseException | None) -> None:
        """Finish the last flag allreduce (every rank started it) before the group goes."""
        pending, self._pending = self._pending, None
        if pending is None or error is not None:
            return
        import torch.distributed as dist

        if dist.is_initialized() and pending[2] is self._group:
            try:
                pending[0].wait()
            except RuntimeError:
                pass  # a peer is gone: nothing left to agree on

    def _stop(self, state: StepState) -> None:
        """Save ``state`` (a TrainState) as one more report round, say PreemptSaved, leave."""
        from ringtrain.worker.session import report
        from ringtrain.worker.state import TrainState

        session = self.session
        round_: int | None = None
        step = int(state.step)
        self.stop_after = None
        if isinstance(state, TrainState):
            round_ = session.next_round
            metrics: dict[str, Any] = {**session.last_metrics, "preempted_step": step}
            report(metrics, checkpoint=state)
        if session.channel is not None:
            rank = session.context.world_rank
            session.channel.send(PreemptSaved(rank, time.time(), step, round_))
        raise PreemptStop(f"stopped for a preemption after step {step}")


def _timed_out(exc: BaseException) -> bool:
    """Whether a collective's error is its timeout (gloo: "Timed out waiting ...") rather than a
    lost peer ("Connection closed by peer", ...)."""
    return "timed out" in str(exc).lower() or "timeout" in type(exc).__name__.lower()


def register(session: Session) -> PreemptionPlugin | None:
    """Register a :class:`PreemptionPlugin` in ``session`` (a worker with a driver channel) and
    route :func:`watch_worker_signals`' notices to it. Returns it (None without a channel)."""
    if session.channel is None:
        return None
    set_driver_pid(session.context.config.driver_pid)
    plugin = PreemptionPlugin(session)
    session.hooks.register(plugin)
    _set_listener(plugin.signalled)
    return plugin


# ---------------------------------------------------------------- SIGTERM to a worker

_listener: Callable[[int, int], None] | None = None
_pending: list[tuple[int, int]] = []  # signals that came before a listener was set
_listener_lock = threading.Lock()


def _set_listener(listener: Callable[[int, int], None]) -> None:
    global _listener
    with _listener_lock:
        _listener = listener
        pending = list(_pending)
        _pending.clear()
    for signum, sender in pending:
        listener(signum, sender)


def driver_pid(parent: int | None = None, proc: str = "/proc") -> int:
    """The pid of this worker's driver: ``WorkerConfig.driver_pid`` (what the driver put into
    ``Start``) once it arrived; before that (or on a backend whose driver is on another
    machine: None there), the parent, or the grandparent when the parent is the warm pool's
    zygote (:func:`set_launchers`, else :func:`launchers`' ``/proc`` look-up)."""
    if _driver_pid is not None and parent is None:
        return _driver_pid
    if _launched_by and parent is None:
        return max(_launched_by, key=lambda pid: pid != os.getppid())
    return max(launchers(parent, proc), key=lambda pid: pid != (parent or os.getppid()))


def set_launchers(pids: frozenset[int]) -> None:
    """Say, before :func:`watch_worker_signals`, which processes started this worker (the warm
    pool's zygote and the driver it serves: :mod:`ringtrain.launch.zygote` calls it in each
    child it forks), so that neither reads ``/proc``."""
    global _launched_by
    _launched_by = frozenset(pids)


def set_driver_pid(pid: int | None) -> None:
    """The driver's pid from ``Start`` (``WorkerConfig.driver_pid``): a SIGTERM it sends stops
    this worker at once (like its parent's), and :func:`driver_pid` returns it. ``None``: keep
    what the worker knew (its parent, or what :func:`set_launchers` said)."""
    global _driver_pid
    if pid is None:
        return
    _driver_pid = pid
    with _listener_lock:
        _stoppers.add(pid)


_launched_by: frozenset[int] = frozenset()
_driver_pid: int | None = None
_stoppers: set[int] = set()  # senders whose SIGTERM ends the process (watch_worker_signals)


def launchers(parent: int | None = None, proc: str = "/proc") -> frozenset[int]:
    """The processes whose SIGTERM means "stop now" to this worker: its parent (the driver, or a
    Ray actor), and, when the parent is a ringtrain launcher process (its command line names a
    ``ringtrain.launch`` module: a fork server that forked this worker), the parent's parent.
    Only a fallback: ringtrain's zygote says it with :func:`set_launchers` and the driver's
    pid comes in ``WorkerConfig.driver_pid`` (:func:`set_driver_pid`)."""
    parent = os.getppid() if parent is None else parent
    found = {parent}
    try:
        with open(f"{proc}/{parent}/cmdline", "rb") as f:
            cmdline = f.read()
        if b"ringtrain.launch" in cmdline:
            with open(f"{proc}/{parent}/stat", "rb") as f:
                stat = f.read()
            found.add(int(stat.rsplit(b")", 1)[1].split()[1]))  # field 4: ppid
    except (OSError, ValueError, IndexError):
        pass
    return frozenset(found)


def watch_worker_signals(driver_pids: frozenset[int] | None = None) -> bool:
    """Block :data:`WATCHED` signals in this thread (and so in every thread started after) and
    wait for them on a daemon thread: one from ``driver_pids`` terminates the process as the
    default action would (default: the zygote and the driver when :func:`set_launchers` named
    the parent, else :func:`launchers`; the driver's pid from ``Start`` joins them later,
    :func:`set_driver_pid`); one from anyone else goes to the registered
    :class:`PreemptionPlugin` as a notice. Call it before any other thread starts. Returns False
    (nothing changed) where ``sigwaitinfo`` does not exist (not Linux)."""
    if not hasattr(signal, "sigwaitinfo") or not hasattr(signal, "pthread_sigmask"):
        return False
    parent = os.getppid()
    if driver_pids is None:
        driver_pids = _launched_by if parent in _launched_by else launchers(parent)
    with _listener_lock:
        _stoppers.update(driver_pids)
    signal.pthread_sigmask(signal.SIG_BLOCK, WATCHED)

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(WATCHED)
            with _listener_lock:
                stop = info.si_pid in _stoppers
            if stop or os.getppid() != parent:
                _die(info.si_signo)
            with _listener_lock:
                listener = _listener
                if listener is None:
                    _pending.append((info.si_signo, info.si_pid))
            if listener is not None:
                listener(info.si_signo, info.si_pid)

    threading.Thread(target=wait, name="ringtrain-signal-watch", daemon=True).start()
    return True


def _die(signum: int) -> None:
    """End the process by ``signum``'s default action (what it did before it was watched)."""
    # The disposition is the default one (SIG_DFL) unless the train function installed a
    # handler, which then runs as it would have without the watch.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})
    os.kill(os.getpid(), signum)
    time.sleep(5.0)  # delivered to this thread at once; never reached in practice
    os._exit(128 + signum)
