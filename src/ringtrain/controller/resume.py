"""Where each worker group resumes from, and what the driver says about the checkpoints it set
aside on the way (docs/security.md, "A checkpoint that does not verify").

:class:`ResumePoint` is the controller's collaborator for one concern: before a group starts it
removes half-written staging directories, picks the newest checkpoint that verifies
(:meth:`CheckpointManager.latest_verified`), writes a ``checkpoint_invalid`` event for each one set
aside and a ``resume`` event for the one chosen; after a failure it tells whether the failure was
a worker refusing that checkpoint (set aside too, and the attempt restarted from the one before,
without counting a failure).
"""

from __future__ import annotations

import logging

from ringtrain.checkpoint.manager import CheckpointManager, TrackedCheckpoint
from ringtrain.monitor.progress import ProgressReporter
from ringtrain.result import WorkerFailure
from ringtrain.rundir import RunDirectory
from ringtrain.rundir.schema import CheckpointInvalidEvent, ResumeEvent

__all__ = ["ResumePoint"]

logger = logging.getLogger("ringtrain")


class ResumePoint:
    """The checkpoint the current attempt's workers resumed from.

    Args:
        checkpoints: the run's checkpoint manager (verification, set-aside notes).
        run_dir: the run directory writer (``resume`` and ``checkpoint_invalid`` events).
        progress: the live display (each set-aside checkpoint is shown once).
    """

    def __init__(
        self, checkpoints: CheckpointManager, run_dir: RunDirectory, progress: ProgressReporter
    ) -> None:
        self.checkpoints = checkpoints
        self.run_dir = run_dir
        self.progress = progress
        self.resumed: TrackedCheckpoint | None = None  # what this attempt's workers resumed
        self.uri: str | None = None  # ... at this location (a local copy for memory://)

    def choose(self, attempt: int) -> TrackedCheckpoint | None:
        """The newest valid checkpoint for attempt ``attempt`` (``None``: from step 0); what a
        previous attempt left half-written is removed first.

        Raises:
            NoValidCheckpointError: checkpoints exist and none verifies (and
                ``CheckpointConfig.from_scratch_if_invalid`` is off).
        """
        # No worker runs now: what a previous attempt left half-written goes, and the checkpoint
        # to resume from is checked byte by byte (a corrupt one is set aside, the one before used).
        self.checkpoints.remove_staging()
        latest = self.checkpoints.latest_verified()
        self.say_set_aside()
        self.resumed = latest
        self.uri = self.checkpoints.worker_uri(latest) if latest is not None else None
        if latest is not None:
            self.run_dir.write(ResumeEvent(attempt=attempt, checkpoint=latest.checkpoint.uri))
            if attempt == 0:
                self.progress.message(f"resuming from {latest.checkpoint.uri}")
        return latest

    def set_aside_unloadable(self, failure: WorkerFailure) -> bool:
        """A worker could not load the checkpoint this attempt resumed from (it passed the
        driver's checks but ``torch.load(weights_only=True)`` refused it, or its content is not a
        TrainState): set it aside like a corrupt one, so that the next attempt starts from the
        one before, without counting a failure (docs/security.md). Returns False for any other
        failure."""
        resumed = self.resumed
        if resumed is None or failure.kind != "exception":
            return False
        # The worker's exception, or one it caused (a train function may wrap it), names it.
        said = [f"{failure.exc_type}: {failure.message.split(': ', 1)[-1]}"] + [
            line.strip() for line in (failure.traceback or "").splitlines()
        ]
        marks = {
            f"CheckpointLoadError: could not load checkpoint {uri}"
            for uri in (resumed.checkpoint.uri, self.uri)
            if uri
        }
        found = [line for line in said if any(line.startswith(m) for m in marks)]
        if not found:
            return False
        why = found[0].split(": ", 1)[-1]
        rank = failure.rank
        if not self.checkpoints.set_aside_unloadable(resumed, f"rank {rank}: {why}", rank):
            return False
        self.resumed = None  # set aside (and said) as the next attempt starts
        return True

    def say_set_aside(self) -> None:
        """Log, show once and write (as ``checkpoint_invalid`` events) each checkpoint the
        manager set aside, with the checkpoint the run resumes from instead."""
        for note in self.checkpoints.set_aside:
            logger.warning("%s", note)
            self.progress.message(str(note))
            self.run_dir.write(
                CheckpointInvalidEvent(
                    reason=str(note),
                    rank=note.rank,
                    checkpoint=note.checkpoint,
                    set_aside_as=note.set_aside_as,
                    resumed_from=note.resumed_from,
                )
            )
        self.checkpoints.set_aside.clear()
        self.checkpoints.notes.clear()
