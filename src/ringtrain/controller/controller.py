"""The driver-side state machine.

``run()`` → ``_run_attempt()`` → ``_handle(event)``, top to bottom::

    INITIALIZING ──▶ RUNNING ──▶ FINISHED
                       │  ▲
             failure   ▼  │ FailurePolicy: RESTART
                     RESTARTING
                       │ FailurePolicy: RAISE
                       ▼
                     ERRORED            (Ctrl-C anywhere: ABORTED)

A caller may also ask a running job to stop early (``stop_event``, e.g. a sweep pruning a trial):
its group is stopped at once and the run ends ``STOPPED``, its published checkpoints kept.

One attempt = one worker group. Every rank's n-th ``report()`` belongs to round n; when all ranks
have reported a round, its checkpoint files (if any rank attached some) are published and retention
applied. On the first failure the controller keeps collecting events for ``failure_grace_s`` (the
peers of a crashed rank usually fail a moment later with a connection error, and the real cause
must win), stops the group, and asks the FailurePolicy what to do.

Elastic runs (``ScalingConfig(num_workers=(min, max))``) may instead resize the group in place
(the ``RESIZING`` path) and grow it back: that side is :class:`~ringtrain.controller.elastic.
ElasticControl`, mixed in here. The per-group book-keeping is in :mod:`ringtrain.controller.
attempt`.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.channel import (
    CheckpointDone,
    Done,
    Event,
    Exited,
    Heartbeat,
    Hello,
    Interrupted,
    Report,
    Resumed,
    Timing,
    WorkerError,
)
from ringtrain.checkpoint.manager import CheckpointManager, TrackedCheckpoint
from ringtrain.controller.attempt import (
    HELLO_TIMEOUT_S,
    Attempt,
    Grow,
    root_cause,
    signal_name,
)
from ringtrain.controller.elastic import ElasticControl
from ringtrain.controller.policy import Decision, FailurePolicy
from ringtrain.elastic.policy import ElasticAction, ElasticPolicy
from ringtrain.launch.base import Launcher, WorkerGroup, WorkerSpec
from ringtrain.monitor.progress import ProgressReporter
from ringtrain.monitor.straggler import StragglerDetector
from ringtrain.result import Result, TrainingFailedError, WorkerFailure
from ringtrain.rundir import RunDirectory

logger = logging.getLogger("ringtrain")


class RunState(enum.Enum):
    INITIALIZING = "INITIALIZING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    FINISHED = "FINISHED"
    ERRORED = "ERRORED"
    ABORTED = "ABORTED"
    STOPPED = "STOPPED"


SpecFactory = Callable[[int, int, "str | None"], WorkerSpec]
"""(attempt, start_round, latest checkpoint URI) -> the spec of that attempt's workers."""


class Controller(ElasticControl):
    """Runs a training job to completion through restarts.

    Args:
        launcher: starts worker groups.
        make_spec: builds each attempt's :class:`WorkerSpec`.
        world_size: number of workers.
        run_dir: the run directory writer.
        checkpoints: publication and retention of checkpoints.
        failure_policy: restart-or-raise decisions.
        progress: the live display.
        callbacks: driver-side callbacks (the hooks of :data:`ringtrain.config.CALLBACK_HOOKS`).
        failure_grace_s: how long to keep collecting events after the first failure (seconds);
            cut short once every rank has failed or exited.
        stop_grace_s: SIGTERM-to-SIGKILL grace when stopping a group (seconds).
        worker_timeout_s: a rank without progress for this long is failed as hung (seconds;
            ``None``: never).
        checkpoint_grace_s: after a failure, how long to let live ranks finish background
            checkpoint writes of rounds every rank reported, so that the restart loses only the
            steps after that checkpoint (seconds).
        stragglers: flags slow ranks from the workers' timing windows (``None``: no detection).
        elastic: resize-in-place decisions (``ScalingConfig(num_workers=(min, max))``);
            ``None``: every failure restarts the group (docs/elastic.md).
        stop_event: set by another thread (or a callback) to end the run early: the group is
            stopped within one poll interval and the run ends ``STOPPED`` (used by
            ``ringtrain.tune`` to prune a trial).
    """

    def __init__(
        self,
        *,
        launcher: Launcher,
        make_spec: SpecFactory,
        world_size: int,
        run_dir: RunDirectory,
        checkpoints: CheckpointManager,
        failure_policy: FailurePolicy,
        progress: ProgressReporter,
        callbacks: Sequence[Any] = (),
        failure_grace_s: float = 1.0,
        stop_grace_s: float = 5.0,
        poll_interval_s: float = 0.1,
        worker_timeout_s: float | None = None,
        checkpoint_grace_s: float = 120.0,
        stragglers: StragglerDetector | None = None,
        elastic: ElasticPolicy | None = None,
        stop_event: threading.Event | None = None,
    ) -> None:
        self.launcher = launcher
        self.make_spec = make_spec
        self.world_size = world_size
        self.run_dir = run_dir
        self.checkpoints = checkpoints
        self.failure_policy = failure_policy
        self.progress = progress
        self.callbacks = list(callbacks)
        self.failure_grace_s = failure_grace_s
        self.stop_grace_s = stop_grace_s
        self.poll_interval_s = poll_interval_s
        self.worker_timeout_s = worker_timeout_s
        self.checkpoint_grace_s = checkpoint_grace_s
        self.stragglers = stragglers
        self.elastic = elastic
        self.stop_event = stop_event
        self.generation = 0  # elastic: rendezvous generation of the worker group
        # Elastic growth back to max: the grow in progress, consecutive failed grows, and since
        # when (monotonic) the group has been below max without trying (None: it is not).
        self._grow: Grow | None = None
        self._grow_failures = 0
        self._grow_idle_since: float | None = None

        self.state = RunState.INITIALIZING
        self.group: WorkerGroup | None = None
        self.failures: list[WorkerFailure] = []
        self.error: TrainingFailedError | None = None
        self.metrics_per_rank: dict[int, dict[str, Any]] = {}
        self._history: dict[int, dict[str, Any]] = {}  # round -> rank 0's metrics
        self.next_round = checkpoints.next_round
        self.start_time = time.time()
        self._attempt: Attempt | None = None
        self._resumed: TrackedCheckpoint | None = None  # what this attempt's workers resumed
        self._resume_uri: str | None = None  # ... at this location (a local copy for memory://)

    # ------------------------------------------------------------------ the loop
    def run(self) -> Result:
        """Run attempts until the job finishes or the FailurePolicy says stop."""
        self.progress.start(self.run_dir.name, self.world_size, self.run_dir.uri)
        self._write_result()
        attempt = 0
        try:
            while True:
                failure = self._run_attempt(attempt)
                if failure is None:
                    self.state = RunState.STOPPED if self._stop_requested() else RunState.FINISHED
                    break
                if self._set_aside_unloadable(failure):
                    self.state = RunState.RESTARTING
                    attempt += 1
                    continue  # bounded: each time, one checkpoint fewer is left to resume from
                self.failures.append(failure)
                self._callback("on_failure", failure)
                decision = self.failure_policy.decide(failure, len(self.failures))
                logger.warning(decision.reason)
                self.progress.message(decision.reason)
                self.run_dir.event(
                    "decision", decision=decision.decision.value, reason=decision.reason
                )
                if decision.decision is Decision.RAISE:
                    self.state = RunState.ERRORED
                    self.error = TrainingFailedError(self.failures)
                    break
                self.state = RunState.RESTARTING
                attempt += 1
        except BaseException:
            self.state = RunState.ABORTED
            raise
        finally:
            if self.group is not None:
                self.group.stop(grace_s=self.stop_grace_s)
            result = self.result()
            self.run_dir.event(
                "run_end", status=self.state.value, duration_s=time.time() - self.start_time
            )
            self._write_result()
            self.run_dir.close()
            self.progress.close(self.state.value)
            if self.state is not RunState.ABORTED:
                self._callback("on_end", result)
        return result

    def _run_attempt(self, number: int) -> WorkerFailure | None:
        # No worker runs now: what a previous attempt left half-written goes, and the checkpoint
        # to resume from is checked byte by byte (a corrupt one is set aside, the one before used).
        self.checkpoints.remove_staging()
        latest = self.checkpoints.latest_verified()
        for note in self.checkpoints.notes:
            logger.warning(note)
            self.progress.message(note)
            self.run_dir.event("checkpoint_invalid", reason=note)
        self.checkpoints.notes.clear()
        # Rounds after the checkpoint we resume from are recomputed: their report indices must
        # line up with the restored state, and their metrics replace the lost attempt's.
        self.next_round = latest.round + 1 if latest is not None else 0
        for stale in [r for r in self._history if r >= self.next_round]:
            del self._history[stale]
        resume_from = self.checkpoints.worker_uri(latest) if latest is not None else None
        self._resumed, self._resume_uri = latest, resume_from
        if latest is not None:
            self.run_dir.event("resume", attempt=number, checkpoint=latest.checkpoint.uri)
            if number == 0:
                self.progress.message(f"resuming from {latest.checkpoint.uri}")
        spec = self.make_spec(number, self.next_round, resume_from)
        self._attempt = attempt = Attempt(number, spec.world_size)
        self._reset_stragglers()
        self.run_dir.event("run_start", world_size=spec.world_size, attempt=number)
        for rank in range(spec.world_size):
            self.progress.worker_state(rank, "starting")
        self.group = self.launcher.start(spec)
        self.state = RunState.RUNNING
        self._grow, self._grow_idle_since = None, None  # a (re)start has max workers
        self._grow_failures = 0
        self.generation = 0  # fresh worker processes start at generation 0
        try:
            while not attempt.all_exited:
                for event in self.group.poll(self.poll_interval_s):
                    self._handle(event)
                    if self._stop_requested():
                        break  # the reports still queued belong to rounds after the stop
                if self._stop_requested():
                    self.run_dir.event("stop_requested", round=self.next_round - 1)
                    return None  # the finally below stops the group
                if (
                    self.elastic is not None
                    and attempt.first_failure_at is None
                    and self._grow_tick(attempt)
                ):
                    attempt = self._attempt  # the grown generation
                    continue
                if (
                    self.elastic is not None
                    and attempt.first_failure_at is not None
                    and not attempt.elastic_fallback
                    and self._elastic(attempt) is not ElasticAction.FALLBACK
                ):
                    attempt = self._attempt  # the same, or the resized generation
                    continue
                if attempt.first_failure_at is None:
                    self._check_hang(attempt)
                elif self._writes_in_flight(attempt) and (
                    time.monotonic() - attempt.first_failure_at < self.checkpoint_grace_s
                ):
                    continue  # a live rank is finishing a checkpoint write: let it land
                elif attempt.all_failed_or_exited or (
                    time.monotonic() - attempt.first_failure_at > self.failure_grace_s
                ):
                    break
        finally:
            self.group.stop(grace_s=self.stop_grace_s)
            self.group = None
            self._grow = None
        self._end_attempt(attempt)
        if not attempt.failures:
            return None
        return root_cause(list(attempt.failures.values()))

    def _set_aside_unloadable(self, failure: WorkerFailure) -> bool:
        """A worker could not load the checkpoint this attempt resumed from (it passed the
        driver's checks but ``torch.load(weights_only=True)`` refused it, or its content is not a
        TrainState): set it aside like a corrupt one and restart from the one before, without
        counting a failure (docs/security.md). Returns False for any other failure."""
        resumed = self._resumed
        if resumed is None or failure.kind != "exception":
            return False
        # The worker's exception, or one it caused (a train function may wrap it), names it.
        said = [f"{failure.exc_type}: {failure.message.split(': ', 1)[-1]}"] + [
            line.strip() for line in (failure.traceback or "").splitlines()
        ]
        marks = {
            f"CheckpointLoadError: could not load checkpoint {uri}"
            for uri in (resumed.checkpoint.uri, self._resume_uri)
            if uri
        }
        found = [line for line in said if any(line.startswith(m) for m in marks)]
        if not found:
            return False
        why = found[0].split(": ", 1)[-1]
        if not self.checkpoints.set_aside_unloadable(resumed, f"rank {failure.rank}: {why}"):
            return False
        for note in self.checkpoints.notes:
            logger.warning(note)
            self.progress.message(note)
            self.run_dir.event("checkpoint_invalid", reason=note, rank=failure.rank)
        self.checkpoints.notes.clear()
        self._resumed = None
        return True

    def _stop_requested(self) -> bool:
        return self.stop_event is not None and self.stop_event.is_set()

    # ------------------------------------------------------------------ events
    def _handle(self, event: Event) -> None:
        attempt = self._attempt
        assert attempt is not None
        rank = getattr(event, "rank", None)
        if isinstance(rank, int) and rank >= attempt.world_size:
            # Elastic runs: a worker started to join, or a stale event of a rank that left.
            if self._grow is not None and rank in self._grow.ranks:
                self._on_joiner_event(self._grow, event)
            return
        if isinstance(rank, int) and not isinstance(event, Exited):
            now = time.monotonic()
            attempt.last_seen[rank] = now
            if isinstance(event, Heartbeat):
                if event.progress_age_s is not None:
                    attempt.last_progress[rank] = max(
                        attempt.last_progress.get(rank, 0.0), now - event.progress_age_s
                    )
                if event.step is not None:
                    attempt.last_step[rank] = event.step
                attempt.progress_count[rank] = event.progress_count
                return
            if isinstance(event, Report):
                attempt.last_progress[rank] = now
        if isinstance(event, Hello):
            self.progress.worker_state(event.rank, "running")
        elif isinstance(event, Interrupted):
            if 0 <= event.generation < self.generation:
                return  # it left a generation already replaced; its Resize is on its way
            attempt.interrupted[event.rank] = event
            if event.grow:  # paused at a step boundary to let workers join: not a failure
                pass
            elif attempt.first_failure_at is None:
                attempt.first_failure_at = time.monotonic()
        elif isinstance(event, Resumed):
            self._on_resumed(attempt, event)
        elif isinstance(event, Report):
            self._on_report(attempt, event)
        elif isinstance(event, Timing):
            self._on_timing(attempt, event)
        elif isinstance(event, CheckpointDone):
            outcome = ("files", event.files) if event.error is None else ("error", event.error)
            attempt.outcomes.setdefault(event.round, {})[event.rank] = outcome
            self._try_publish(attempt, event.round)
        elif isinstance(event, Done):
            attempt.done.add(event.rank)
        elif isinstance(event, WorkerError):
            self._on_failure(
                attempt,
                WorkerFailure(
                    rank=event.rank,
                    kind="exception",
                    message=f"rank {event.rank} raised {event.exc_type}: {event.message}",
                    exc_type=event.exc_type,
                    traceback=event.traceback,
                    attempt=attempt.number,
                    round=attempt.last_round.get(event.rank, -1),
                    time=event.time,
                    step=attempt.last_step.get(event.rank),
                ),
            )
        elif isinstance(event, Exited):
            self._on_exit(attempt, event)

    def _writes_in_flight(self, attempt: Attempt) -> bool:
        """Whether a rank that is still running owes a background checkpoint write of a round
        that can still be published (every report of it is in). A rank failed as hung is not
        waited for: it is frozen or stuck, and will not finish its write (waiting for it would
        hold the restart for ``checkpoint_grace_s``)."""
        for round_, (_reports, expected) in attempt.writing.items():
            done = attempt.outcomes.get(round_, {})
            missing = [r for r in expected if r not in done]
            hung = {r for r, f in attempt.failures.items() if f.kind == "hang"}
            if missing and all(r not in attempt.exited and r not in hung for r in missing):
                return True  # publishable once the live ranks finish
        return False

    def _check_hang(self, attempt: Attempt) -> None:
        """Fail a rank that is stuck longer than ``worker_timeout_s``: one that made progress
        once and then none (its peers usually wait on it inside a collective: the one that
        stopped first, by progress count and then time, is blamed), one whose process stopped
        answering, or one that never connected (within the timeout, but at least
        ``HELLO_TIMEOUT_S``). Start-up, before a rank's first progress, is never a hang:
        collectives there time out on their own."""
        timeout = self.worker_timeout_s
        if timeout is None:
            return
        now = time.monotonic()
        live = [r for r in range(attempt.world_size) if r not in attempt.exited]
        silent = [r for r in live if now - attempt.last_seen.get(r, now) > timeout]
        unborn = [
            r
            for r in live
            if r not in attempt.last_seen
            and now - attempt.started_at > max(timeout, HELLO_TIMEOUT_S)
        ]
        idle = [
            r
            for r in live
            if r in attempt.last_progress and now - attempt.last_progress[r] > timeout
        ]
        if unborn:
            rank = unborn[0]
            how = f"never connected to the driver in {now - attempt.started_at:.1f} s"
        elif silent or idle:
            # Data-parallel ranks progress in lockstep: the one stuck first has counted the
            # fewest batches and steps (its peers fetched the next batch, then blocked on it).
            rank = min(
                silent + idle,
                key=lambda r: (
                    attempt.progress_count.get(r, 0),
                    attempt.last_progress.get(r, attempt.last_seen[r]),
                    r,
                ),
            )
            if rank in silent:
                how = (
                    f"stopped answering for {now - attempt.last_seen[rank]:.1f} s "
                    "(the process is frozen or stopped)"
                )
            else:
                how = (
                    f"made no progress for {now - attempt.last_progress[rank]:.1f} s (alive, "
                    "but stuck: a deadlock, an endless loop, or waiting on a collective)"
                )
        else:
            return
        others = sorted(set(silent + idle) - {rank})
        waiting = f"; ranks {others} are stuck too, waiting on it" if others else ""
        self._on_failure(
            attempt,
            WorkerFailure(
                rank=rank,
                kind="hang",
                message=f"rank {rank} {how}, beyond worker_timeout_s={timeout:g}{waiting}",
                attempt=attempt.number,
                round=attempt.last_round.get(rank, -1),
                time=time.time(),
                step=attempt.last_step.get(rank),
            ),
        )

    def _on_report(self, attempt: Attempt, report: Report) -> None:
        self.metrics_per_rank[report.rank] = report.metrics
        attempt.last_round[report.rank] = report.round
        step = report.metrics.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            attempt.last_step[report.rank] = step
        self.run_dir.event(
            "report",
            time=report.time,
            rank=report.rank,
            round=report.round,
            metrics=report.metrics,
            checkpoint=report.checkpoint_files is not None or report.checkpoint_pending,
        )
        self.progress.report(report.rank, report.round, report.metrics)
        self._callback("on_report", report.rank, report.round, report.metrics)
        if report.checkpoint_files is not None:
            attempt.outcomes.setdefault(report.round, {})[report.rank] = (
                "files",
                report.checkpoint_files,
            )
        elif report.checkpoint_error is not None:
            attempt.outcomes.setdefault(report.round, {})[report.rank] = (
                "error",
                report.checkpoint_error,
            )
        reports = attempt.pending.setdefault(report.round, {})
        reports[report.rank] = report
        if len(reports) == attempt.world_size:
            del attempt.pending[report.round]
            self._complete_round(attempt, report.round, reports)

    def _on_timing(self, attempt: Attempt, timing: Timing) -> None:
        window = timing.window
        self.run_dir.event(
            "timing", time=timing.time, rank=timing.rank, attempt=attempt.number, **window
        )
        self.progress.timing(timing.rank, window)
        self._callback("on_timing", timing.rank, window)
        if self.stragglers is None:
            return
        for ev in self.stragglers.update(timing.rank, window):
            logger.info(ev.message)
            self.progress.message(ev.message)
            self.progress.straggler(ev.rank, ev.flagged)
            if ev.flagged:
                self.run_dir.event(
                    "straggler",
                    rank=ev.rank,
                    attempt=attempt.number,
                    busy_s=ev.busy_s,
                    median_s=ev.median_s,
                    ratio=ev.ratio,
                    reason=ev.reason,
                    message=ev.message,
                )
            else:
                self.run_dir.event(
                    "straggler_cleared", rank=ev.rank, attempt=attempt.number, message=ev.message
                )
            self._callback("on_straggler", ev)

    def _complete_round(self, attempt: Attempt, round_: int, reports: dict[int, Report]) -> None:
        metrics = reports[0].metrics if 0 in reports else next(iter(reports.values())).metrics
        self._history[round_] = metrics
        self.next_round = round_ + 1
        self.progress.round_complete(round_, metrics)
        self._callback("on_round", round_, metrics)
        expected = {
            rank
            for rank, r in reports.items()
            if r.checkpoint_files is not None or r.checkpoint_pending or r.checkpoint_error
        }
        if expected:
            attempt.writing[round_] = (reports, expected)
            self._try_publish(attempt, round_)

    def _try_publish(self, attempt: Attempt, round_: int) -> None:
        """Publish round ``round_``'s checkpoint once all its reports are in and every rank that
        attached files has finished writing them."""
        if round_ not in attempt.writing:
            return
        reports, expected = attempt.writing[round_]
        outcomes = attempt.outcomes.get(round_, {})
        if not expected <= outcomes.keys():
            return
        del attempt.writing[round_]
        attempt.outcomes.pop(round_, None)
        metrics = reports[0].metrics if 0 in reports else next(iter(reports.values())).metrics
        errors = [why for kind, why in (outcomes[r] for r in sorted(expected)) if kind == "error"]
        if errors:
            message = (
                f"checkpoint of round {round_} was not saved ({'; '.join(errors)}); "
                "training continues, a restart would resume from the previous checkpoint"
            )
            logger.warning(message)
            self.progress.message(message)
            self.run_dir.event("checkpoint_failed", round=round_, errors=errors)
            self.checkpoints.discard_staging(round_)
            return
        files: dict[str, dict[str, Any]] = {}
        owners: dict[str, int] = {}
        for rank in sorted(expected):
            rank_files = outcomes[rank][1]
            for rel, info in rank_files.items():
                if rel in files:
                    self.progress.message(
                        f"round {round_}: ranks {owners[rel]} and {rank} both wrote checkpoint "
                        f"file {rel!r}; the last write wins (use distinct file names per rank)"
                    )
                    info = _digest_on_storage(self.checkpoints, round_, rel)
                files[rel] = {**info, "rank": owners.setdefault(rel, rank)}
        score_metrics = dict(metrics)
        for r in sorted(reports):  # a score attribute only some rank reported still counts
            for k, v in reports[r].metrics.items():
                score_metrics.setdefault(k, v)
        try:
            tracked = self.checkpoints.publish(round_, files, score_metrics)
        except ValueError as bad:  # a file name no manifest may hold (a backslash, say)
            message = f"checkpoint of round {round_} was not saved ({bad}); training continues"
            logger.warning(message)
            self.progress.message(message)
            self.run_dir.event("checkpoint_failed", round=round_, errors=[str(bad)])
            self.checkpoints.discard_staging(round_)
            return
        name = tracked.checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
        self.run_dir.event("checkpoint", round=round_, path=name, metrics=metrics)
        for path, reason in self.checkpoints.deleted:
            self.run_dir.event("checkpoint_deleted", path=path, reason=reason)
        self.checkpoints.deleted.clear()
        self._callback("on_checkpoint", tracked.checkpoint, metrics)

    def _on_failure(self, attempt: Attempt, failure: WorkerFailure) -> None:
        previous = attempt.failures.get(failure.rank)
        if previous is not None and previous.kind == "exception":
            return  # the exception says more than the exit status that follows it
        attempt.failures[failure.rank] = failure
        if attempt.first_failure_at is None:
            attempt.first_failure_at = time.monotonic()
        self.progress.worker_state(failure.rank, "failed")
        self.run_dir.event(
            "failure",
            time=failure.time,
            rank=failure.rank,
            kind=failure.kind,
            message=failure.message,
            traceback=failure.traceback,
            attempt=attempt.number,
        )

    def _on_exit(self, attempt: Attempt, event: Exited) -> None:
        attempt.exited[event.rank] = event.returncode
        if event.returncode == 0:
            self.progress.worker_state(event.rank, "finished")
            return
        # Events are only handled before the group is stopped, so a non-zero exit here is a real
        # failure of this rank (perhaps caused by a peer's: root_cause sorts that out).
        if event.returncode < 0:
            kind, what = "signal", f"was killed by {signal_name(-event.returncode)}"
        else:
            kind, what = "exit", f"exited with status {event.returncode}"
        if event.rank in attempt.failures:
            return
        self._on_failure(
            attempt,
            WorkerFailure(
                rank=event.rank,
                kind=kind,
                message=f"rank {event.rank} {what}",
                returncode=event.returncode,
                attempt=attempt.number,
                round=attempt.last_round.get(event.rank, -1),
                time=event.time,
                step=attempt.last_step.get(event.rank),
            ),
        )

    def _end_attempt(self, attempt: Attempt) -> None:
        if attempt.resize is not None:  # no step completed after the resize
            info = {k: v for k, v in attempt.resize.items() if k != "pause_time"}
            self.run_dir.event("resize", **info, resume_s=None)
            attempt.resize = None
        if attempt.failures or not attempt.pending:
            return
        counts = {rank: attempt.last_round.get(rank, -1) + 1 for rank in range(attempt.world_size)}
        self.progress.message(
            "ranks called report() a different number of times "
            f"({', '.join(f'rank {r}: {n}' for r, n in counts.items())}); "
            f"rounds {sorted(attempt.pending)} never completed and their checkpoints were dropped"
        )

    # ------------------------------------------------------------------ outputs
    def result(self) -> Result:
        best = [(t.checkpoint, t.metrics) for t in self.checkpoints.ranked()]
        latest = self.checkpoints.latest
        return Result(
            metrics=dict(self.metrics_per_rank.get(0, {})),
            metrics_per_rank={r: dict(m) for r, m in sorted(self.metrics_per_rank.items())},
            checkpoint=latest.checkpoint if latest else None,
            best_checkpoints=best,
            path=self.run_dir.uri,
            error=self.error,
            failures=list(self.failures),
            metrics_history=[self._history[r] for r in sorted(self._history)],
        )

    def _write_result(self) -> None:
        result = self.result()
        now = time.time()
        finished = self.state in (
            RunState.FINISHED,
            RunState.ERRORED,
            RunState.ABORTED,
            RunState.STOPPED,
        )
        self.run_dir.write_json(
            "result.json",
            {
                "status": self.state.value if finished else "RUNNING",
                "name": self.run_dir.name,
                "path": self.run_dir.uri,
                "driver_pid": os.getpid(),
                "start_time": self.start_time,
                "end_time": now if finished else None,
                "duration_s": now - self.start_time,
                "world_size": self.world_size,
                "rounds": self.next_round,
                "metrics": result.metrics,
                "metrics_per_rank": {str(r): m for r, m in result.metrics_per_rank.items()},
                "checkpoint": result.checkpoint.uri if result.checkpoint else None,
                "best_checkpoints": [
                    {"path": c.uri, "metrics": m} for c, m in result.best_checkpoints
                ],
                "error": str(self.error) if self.error else None,
                "failures": [f.to_dict() for f in self.failures],
            },
        )

    def _callback(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:
                logger.exception(
                    "callback %s.%s raised; the run continues", type(cb).__name__, hook
                )


def _digest_on_storage(checkpoints: CheckpointManager, round_: int, rel: str) -> dict[str, Any]:
    from ringtrain.checkpoint import storage

    fs, staging = checkpoints.staging_path(round_)
    return storage.file_digest(fs, storage.join(fs, staging, rel))
