"""What the controller does with each worker event: a collaborator of
:class:`~ringtrain.controller.controller.Controller` that updates one
:class:`~ringtrain.controller.generation.Generation` (rounds, health, failures) and writes the
run's ``report``, ``timing``, ``straggler`` and ``failure`` events. Every handler is O(1) in the
world size except :meth:`GroupEvents.check_hang` (O(world size), throttled)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ringtrain.controller.attempt import signal_name
from ringtrain.controller.generation import Generation
from ringtrain.controller.rounds import round_metrics
from ringtrain.result import WorkerFailure, is_follow_on
from ringtrain.rundir.schema import (
    FailureEvent,
    ReportEvent,
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
    Interrupted,
    Report,
    Resumed,
    RunSettings,
    Timing,
    WorkerError,
)

if TYPE_CHECKING:
    from ringtrain.controller.controller import Controller

logger = logging.getLogger("ringtrain")


class GroupEvents:
    """Handles the events of the controller ``ctl``'s current worker group."""

    def __init__(self, ctl: Controller) -> None:
        self.ctl = ctl
        self.said: set[str] = set()  # notes shown once per run (every attempt sends them)

    def handle(self, gen: Generation, event: Event) -> None:
        rank = getattr(event, "rank", None)
        if isinstance(rank, int) and rank >= gen.world_size:
            # Elastic runs: a worker started to join, or a stale event of a rank that left.
            self.ctl.coordinator.on_joiner_event(event)
            return
        if isinstance(rank, int) and not isinstance(event, Exited):
            now = time.monotonic()
            gen.health.seen(rank, now)
            if isinstance(event, Heartbeat):
                gen.health.heartbeat(event, now)
                return
            if isinstance(event, Report):
                gen.health.progressed(rank, now)
        if isinstance(event, Report):
            self.on_report(gen, event)
        elif isinstance(event, Hello):
            self.ctl.progress.worker_state(event.rank, "running")
        elif isinstance(event, Interrupted):
            self.on_interrupted(gen, event)
        elif isinstance(event, Resumed):
            self.ctl.coordinator.on_resumed(gen, event)
        elif isinstance(event, Timing):
            self.on_timing(gen, event)
        elif isinstance(event, CheckpointDone):
            outcome = ("files", event.files) if event.error is None else ("error", event.error)
            gen.rounds.add_outcome(event.round, event.rank, outcome)
            self.ctl.publisher.try_publish(gen.rounds, event.round)
        elif isinstance(event, Done):
            gen.done.add(event.rank)
        elif isinstance(event, WorkerError):
            self.on_failure(
                gen,
                WorkerFailure(
                    rank=event.rank,
                    kind="exception",
                    message=f"rank {event.rank} raised {event.exc_type}: {event.message}",
                    exc_type=event.exc_type,
                    traceback=event.traceback,
                    attempt=gen.number,
                    round=gen.last_round(event.rank),
                    time=event.time,
                    step=gen.last_step(event.rank),
                ),
            )
        elif isinstance(event, Exited):
            self.on_exit(gen, event)
        elif isinstance(event, RunSettings):
            self.on_run_settings(event)

    def on_run_settings(self, event: RunSettings) -> None:
        """The script's own RunConfig (``ringtrain run SCRIPT`` whose script calls
        ``rt.Trainer(...).fit()``): adopt what can still apply, say the rest (once per run)."""
        from ringtrain.controller.script_settings import adopt

        ctl = self.ctl
        adoption = adopt(
            ctl.checkpoints.config,
            ctl.failure_policy.max_failures,
            event.run_config,
            run_name=ctl.run_dir.name,
            run_uri=ctl.run_dir.uri,
            callbacks=event.callbacks,
            notice_sources=event.notice_sources,
        )
        ctl.checkpoints.config = adoption.checkpoint_config
        ctl.failure_policy.max_failures = adoption.max_failures
        for note in adoption.notes:
            if note not in self.said:
                self.said.add(note)
                logger.info(note)
                ctl.progress.message(note)

    def on_interrupted(self, gen: Generation, event: Interrupted) -> None:
        if 0 <= event.generation < self.ctl.coordinator.generation:
            return  # it left a generation already replaced; its Resize is on its way
        gen.interrupted[event.rank] = event
        # A pause at a step boundary to let workers join (``grow``) is not a failure.
        if not event.grow and gen.first_failure_at is None:
            gen.first_failure_at = time.monotonic()

    def on_report(self, gen: Generation, report: Report) -> None:
        ctl = self.ctl
        ctl.metrics_per_rank[report.rank] = report.metrics
        step = report.metrics.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            gen.health.last_step[report.rank] = step
        ctl.run_dir.write(
            ReportEvent(
                time=report.time,
                rank=report.rank,
                round=report.round,
                metrics=report.metrics,
                checkpoint=report.checkpoint_files is not None or report.checkpoint_pending,
            )
        )
        ctl.progress.report(report.rank, report.round, report.metrics)
        ctl.callback("on_report", report.rank, report.round, report.metrics)
        reports = gen.rounds.add_report(report)
        if reports is None:
            return
        metrics = round_metrics(reports)
        ctl.history[report.round] = metrics
        ctl.next_round = report.round + 1
        ctl.progress.round_complete(report.round, metrics)
        ctl.callback("on_round", report.round, metrics)
        if gen.rounds.complete(report.round, reports):
            ctl.publisher.try_publish(gen.rounds, report.round)

    def on_timing(self, gen: Generation, timing: Timing) -> None:
        ctl = self.ctl
        window = timing.window
        ctl.run_dir.write(
            TimingEvent(time=timing.time, rank=timing.rank, attempt=gen.number, window=window)
        )
        ctl.progress.timing(timing.rank, window)
        ctl.callback("on_timing", timing.rank, window)
        if ctl.stragglers is None:
            return
        for ev in ctl.stragglers.update(timing.rank, window):
            logger.info(ev.message)
            ctl.progress.message(ev.message)
            ctl.progress.straggler(ev.rank, ev.flagged)
            if ev.flagged:
                ctl.run_dir.write(
                    StragglerEvent(
                        rank=ev.rank,
                        attempt=gen.number,
                        busy_s=ev.busy_s,
                        median_s=ev.median_s,
                        ratio=ev.ratio,
                        reason=ev.reason,
                        message=ev.message,
                    )
                )
            else:
                ctl.run_dir.write(
                    StragglerClearedEvent(rank=ev.rank, attempt=gen.number, message=ev.message)
                )
            ctl.callback("on_straggler", ev)

    def on_failure(self, gen: Generation, failure: WorkerFailure) -> None:
        previous = gen.failures.get(failure.rank)
        if previous is not None and previous.kind == "exception":
            return  # the exception says more than the exit status that follows it
        others = [f for r, f in gen.failures.items() if r != failure.rank]
        gen.failures[failure.rank] = failure
        if gen.first_failure_at is None:
            gen.first_failure_at = time.monotonic()
        self.ctl.progress.worker_state(failure.rank, "failed")
        self.ctl.run_dir.write(
            FailureEvent(
                time=failure.time,
                rank=failure.rank,
                kind=failure.kind,
                message=failure.message,
                traceback=failure.traceback,
                attempt=gen.number,
                follow_on=is_follow_on(
                    failure, others
                ),  # counted apart (ringtrain show, dashboard)
            )
        )

    def on_exit(self, gen: Generation, event: Exited) -> None:
        gen.exited[event.rank] = event.returncode
        if event.returncode == 0:
            self.ctl.progress.worker_state(event.rank, "finished")
            return
        # Events are only handled before the group is stopped, so a non-zero exit here is a real
        # failure of this rank (perhaps caused by a peer's: root_cause sorts that out).
        if event.returncode < 0:
            kind, what = "signal", f"was killed by {signal_name(-event.returncode)}"
        else:
            kind, what = "exit", f"exited with status {event.returncode}"
        if event.rank in gen.failures:
            return
        self.on_failure(
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

    def check_hang(self, gen: Generation) -> None:
        """Fail the rank stuck longer than ``worker_timeout_s`` (see
        :meth:`~ringtrain.controller.health.Health.hung`)."""
        timeout = self.ctl.worker_timeout_s
        if timeout is None:
            return
        found = gen.health.hung(timeout, gen.exited, time.monotonic())
        if found is None:
            return
        rank, how = found
        if self.ctl.group is not None:
            # Before the group is stopped: where the rank is stuck reaches the driver's stderr.
            self.ctl.group.dump_stacks([rank])
        self.on_failure(
            gen,
            WorkerFailure(
                rank=rank,
                kind="hang",
                message=f"rank {rank} {how}",
                attempt=gen.number,
                round=gen.last_round(rank),
                time=time.time(),
                step=gen.last_step(rank),
            ),
        )
