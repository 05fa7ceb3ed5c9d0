"""What a worker event means for one worker group: a decider over the group's book-keeping.

:func:`handle` records a worker event in the :class:`~ringtrain.controller.generation.Generation`
it belongs to (rounds, health, failures, the ranks that paused or finished) and returns the
effects (:mod:`ringtrain.controller.effects`) the controller then executes: the run's
``report``, ``timing``, ``failure`` and ``resize`` events, the live display, the callbacks, a
checkpoint to publish. It never holds the controller. Every handler is O(1) in the world size
except :func:`hang` (O(world size), throttled by :meth:`Health.hung`).
"""

from __future__ import annotations

import time

from ringtrain.controller.attempt import signal_name
from ringtrain.controller.effects import (
    Adopt,
    DumpStacks,
    Effect,
    FenceOff,
    GrowIdle,
    Notify,
    Publish,
    RankMetrics,
    RoundDone,
    Say,
    Show,
    Timed,
    Verified,
    Write,
)
from ringtrain.controller.generation import Generation, Grow
from ringtrain.controller.rounds import round_metrics
from ringtrain.monitor.straggler import StragglerEvent as StragglerChange
from ringtrain.result import WorkerFailure, is_follow_on
from ringtrain.rundir.schema import (
    FailureEvent,
    ReportEvent,
    ResizeEvent,
    StragglerClearedEvent,
    StragglerEvent,
    TimingEvent,
)
from ringtrain.wire.channel import (
    CheckpointDone,
    Done,
    Event,
    Exited,
    Heartbeat,
    Hello,
    HostSilent,
    IntegrityMismatch,
    IntegrityVerified,
    Interrupted,
    JoinReady,
    Report,
    Resumed,
    RunSettings,
    Timing,
    WorkerError,
)


def handle(gen: Generation, event: Event, *, generation: int, grow: Grow | None) -> list[Effect]:
    """Record ``event`` in ``gen`` and return what the controller does about it.

    Args:
        gen: the worker group the event belongs to (updated in place: its book-keeping).
        event: a worker event (a message, or the launcher's ``Exited``).
        generation: the group's elastic rendezvous generation (an ``Interrupted`` of an older
            generation is stale).
        grow: the grow in progress (an event of a rank at or above the world size is a joining
            worker's, recorded there), or ``None``.
    """
    rank = getattr(event, "rank", None)
    if isinstance(rank, int) and rank >= gen.world_size:
        # Elastic runs: a worker started to join, or a stale event of a rank that left.
        if grow is not None:
            joiner(grow, event)
        return []
    if isinstance(rank, int) and not isinstance(event, Exited | HostSilent):  # not the rank's
        now = time.monotonic()
        gen.health.seen(rank, now)
        if isinstance(event, Heartbeat):
            gen.health.heartbeat(event, now)
            return []
        if isinstance(event, Report):
            gen.health.progressed(rank, now)
    if isinstance(event, Report):
        return report(gen, event)
    if isinstance(event, Hello | IntegrityMismatch | IntegrityVerified | RunSettings | HostSilent):
        return _told(gen, event)
    if isinstance(event, Interrupted):
        interrupted(gen, event, generation)
    elif isinstance(event, Resumed):
        return resumed(gen, event)
    elif isinstance(event, Timing):
        return timing(gen, event)
    elif isinstance(event, CheckpointDone):
        outcome = ("files", event.files) if event.error is None else ("error", event.error)
        gen.rounds.add_outcome(event.round, event.rank, outcome)
        return [Publish(event.round)]
    elif isinstance(event, Done):
        gen.done.add(event.rank)
    elif isinstance(event, WorkerError):
        return failed(gen, raised(gen, event))
    elif isinstance(event, Exited):
        return exited(gen, event)
    return []


def host_silent(gen: Generation, event: HostSilent) -> list[Effect]:
    """The launcher: a rank's host stopped answering, or answers again (a flap): a fact for the
    hang check (:func:`hang`), not a failure by itself."""
    if event.answered:
        gen.health.host_silent.pop(event.rank, None)
    else:
        gen.health.host_silent[event.rank] = (event.host, event.since)
    return []


def _told(
    gen: Generation,
    event: Hello | IntegrityMismatch | IntegrityVerified | RunSettings | HostSilent,
) -> list[Effect]:
    """A worker said who it is, what a replica check found, or the settings of its script; or
    the launcher said its host stopped or resumed answering."""
    if isinstance(event, HostSilent):
        return host_silent(gen, event)
    if isinstance(event, Hello):
        gen.hosts[event.rank] = event.hostname
        gen.pids[event.rank] = event.pid
        return [Show("worker_state", (event.rank, "running"))]
    if isinstance(event, IntegrityMismatch):
        if gen.mismatch is None:  # every rank sends the same one
            gen.mismatch = event
        return []
    if isinstance(event, RunSettings):
        return [Adopt(event)]
    return [Verified(event)]


def interrupted(gen: Generation, event: Interrupted, generation: int) -> None:
    """A member paused: it lost a peer, or was asked to pause at a step boundary (a grow)."""
    if 0 <= event.generation < generation:
        return  # it left a generation already replaced; its Resize is on its way
    gen.interrupted[event.rank] = event
    # A pause at a step boundary to let workers join (``grow``) is not a failure.
    if not event.grow and gen.first_failure_at is None:
        gen.first_failure_at = time.monotonic()


def report(gen: Generation, report: Report) -> list[Effect]:
    """One rank's ``report()``: its metrics, and its round once every rank's is in."""
    step = report.metrics.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        gen.health.last_step[report.rank] = step
    effects: list[Effect] = [
        RankMetrics(report.rank, report.metrics),
        Write(
            ReportEvent(
                time=report.time,
                rank=report.rank,
                round=report.round,
                metrics=report.metrics,
                checkpoint=report.checkpoint_files is not None or report.checkpoint_pending,
            )
        ),
        Show("report", (report.rank, report.round, report.metrics)),
        Notify("on_report", (report.rank, report.round, report.metrics)),
    ]
    reports = gen.rounds.add_report(report)
    if reports is None:
        return effects
    metrics = round_metrics(reports)
    effects += [
        RoundDone(report.round, metrics),
        Show("round_complete", (report.round, metrics)),
        Notify("on_round", (report.round, metrics)),
    ]
    if gen.rounds.complete(report.round, reports):
        effects.append(Publish(report.round))
    return effects


def timing(gen: Generation, event: Timing) -> list[Effect]:
    """A rank's window of step timings (one per ``MonitorConfig.timing_interval_s``)."""
    window = event.window
    return [
        Write(TimingEvent(time=event.time, rank=event.rank, attempt=gen.number, window=window)),
        Show("timing", (event.rank, window)),
        Notify("on_timing", (event.rank, window)),
        Timed(event.rank, window),
    ]


def resumed(gen: Generation, event: Resumed) -> list[Effect]:
    """The first step after a resize or grow completed: the ``resize`` event, with how long the
    group did not train."""
    if gen.resize is None:
        return []
    info, gen.resize = gen.resize, None
    resume_s = max(0.0, event.time - info["failure_time"])
    pause_time = info.pop("pause_time", None)
    extra = {} if pause_time is None else {"paused_s": max(0.0, event.time - pause_time)}
    grew = info["new_world_size"] > info["old_world_size"]
    since = "capacity returned" if grew or pause_time is not None else "the failure"
    text = (
        f"resized {info['old_world_size']} -> {info['new_world_size']} workers; training "
        f"resumed {resume_s:.2f} s after {since}, at step {event.step}"
    )
    if "paused_s" in extra:
        text += f" (paused {extra['paused_s']:.2f} s)"
    return [
        Write(ResizeEvent(**info, resume_s=resume_s, **extra)),
        # Below max: the next try to grow back is measured from here.
        GrowIdle(time.monotonic(), grew=grew),
        Say(text),
    ]


def raised(gen: Generation, event: WorkerError) -> WorkerFailure:
    """The failure a rank's ``WorkerError`` (an exception in its train function) is."""
    return WorkerFailure(
        rank=event.rank,
        kind="exception",
        message=f"rank {event.rank} raised {event.exc_type}: {event.message}",
        exc_type=event.exc_type,
        traceback=event.traceback,
        attempt=gen.number,
        round=gen.last_round(event.rank),
        time=event.time,
        step=gen.last_step(event.rank),
    )


def failed(gen: Generation, failure: WorkerFailure) -> list[Effect]:
    """Record ``failure`` in ``gen`` (an exception is kept over the exit status that follows it)
    and say so: the rank's ``failure`` event, marked ``follow_on`` when a peer's failure
    explains it (counted apart by ``ringtrain show`` and the dashboard)."""
    previous = gen.failures.get(failure.rank)
    if previous is not None and previous.kind == "exception":
        return []
    others = [f for r, f in gen.failures.items() if r != failure.rank]
    gen.failures[failure.rank] = failure
    if gen.first_failure_at is None:
        gen.first_failure_at = time.monotonic()
    return [
        Show("worker_state", (failure.rank, "failed")),
        Write(
            FailureEvent(
                time=failure.time,
                rank=failure.rank,
                kind=failure.kind,
                message=failure.message,
                traceback=failure.traceback,
                attempt=gen.number,
                follow_on=is_follow_on(failure, others),
            )
        ),
    ]


def exited(gen: Generation, event: Exited) -> list[Effect]:
    """A worker process exited; a non-zero status is a failure of that rank."""
    gen.exited[event.rank] = event.returncode
    if event.returncode == 0:
        return [Show("worker_state", (event.rank, "finished"))]
    # Events are only handled before the group is stopped, so a non-zero exit here is a real
    # failure of this rank (perhaps caused by a peer's: root_cause sorts that out).
    if event.returncode < 0:
        kind, what = "signal", f"was killed by {signal_name(-event.returncode)}"
    else:
        kind, what = "exit", f"exited with status {event.returncode}"
    if event.rank in gen.failures:
        return []
    return failed(
        gen,
        WorkerFailure(
            rank=event.rank,
            kind=kind,
            message=f"rank {event.rank} {what}",
            returncode=event.returncode,
            attempt=gen.number,
            round=gen.last_round(event.rank),
            time=event.time,
            step=gen.last_step(event.rank),
        ),
    )


def hang(gen: Generation, timeout_s: float | None) -> list[Effect]:
    """Fail the rank stuck longer than ``timeout_s`` (:meth:`~ringtrain.controller.health.
    Health.hung`; ``None``: never), after asking it for its stacks."""
    if timeout_s is None:
        return []
    now = time.monotonic()
    found = gen.health.hung(timeout_s, gen.exited, now)
    cut = gen.health.unreachable(timeout_s, gen.exited, now, time.time(), found is not None)
    if cut is not None:
        # Its stacks cannot be asked for (nothing reaches its host), and it may still run cut
        # off: the fence tells it, through storage, that it may no longer write.
        rank, how = cut
        failure = WorkerFailure(
            rank=rank,
            kind="unreachable",
            message=f"rank {rank} {how}",
            attempt=gen.number,
            round=gen.last_round(rank),
            time=time.time(),
            step=gen.last_step(rank),
        )
        return [FenceOff(gen.number, gen.worker_id(rank)), *failed(gen, failure)]
    if found is None:
        return []
    rank, how = found
    failure = WorkerFailure(
        rank=rank,
        kind="hang",
        message=f"rank {rank} {how}",
        attempt=gen.number,
        round=gen.last_round(rank),
        time=time.time(),
        step=gen.last_step(rank),
    )
    # Before the group is stopped: where the rank is stuck reaches the driver's stderr.
    return [DumpStacks((rank,)), *failed(gen, failure)]


def joiner(grow: Grow, event: Event) -> None:
    """An event of a worker started to join (its rank is at or above the world size)."""
    rank = getattr(event, "rank", -1)
    if rank not in grow.ranks:
        return  # a stale event of a rank that left
    if isinstance(event, JoinReady):
        grow.ready.add(rank)
    elif isinstance(event, WorkerError):
        grow.dead.setdefault(rank, f"joining rank {rank} raised {event.exc_type}: {event.message}")
    elif isinstance(event, Exited):
        how = (
            f"was killed by {signal_name(-event.returncode)}"
            if event.returncode < 0
            else f"exited with status {event.returncode}"
        )
        grow.dead.setdefault(rank, f"joining rank {rank} {how}")


def straggler(change: StragglerChange, attempt: int) -> list[Effect]:
    """A rank flagged as a straggler, or cleared, by the driver's detector
    (:class:`~ringtrain.monitor.straggler.StragglerDetector`)."""
    record = (
        StragglerEvent(
            rank=change.rank,
            attempt=attempt,
            busy_s=change.busy_s,
            median_s=change.median_s,
            ratio=change.ratio,
            reason=change.reason,
            message=change.message,
        )
        if change.flagged
        else StragglerClearedEvent(rank=change.rank, attempt=attempt, message=change.message)
    )
    return [
        Say(change.message),
        Show("straggler", (change.rank, change.flagged)),
        Write(record),
        Notify("on_straggler", (change,)),
    ]


def ended(gen: Generation) -> list[Effect]:
    """A group was stopped: its pending ``resize`` event (no step completed after the resize),
    and rounds that never completed because the ranks called ``report()`` a different number
    of times."""
    effects: list[Effect] = []
    if gen.resize is not None:
        info = {k: v for k, v in gen.resize.items() if k != "pause_time"}
        effects.append(Write(ResizeEvent(**info, resume_s=None)))
        gen.resize = None
    if gen.failures or not gen.rounds.pending:
        return effects
    counts = {rank: gen.last_round(rank) + 1 for rank in range(gen.world_size)}
    text = (
        "ranks called report() a different number of times "
        f"({', '.join(f'rank {r}: {n}' for r, n in counts.items())}); "
        f"rounds {sorted(gen.rounds.pending)} never completed and their checkpoints were dropped"
    )
    return [*effects, Show("message", (text,))]
