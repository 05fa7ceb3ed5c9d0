"""Round book-keeping of one worker group, and the publication of each round's checkpoint.

Every rank's n-th ``report()`` belongs to round n. When all ranks have reported a round, the
round is complete; its checkpoint (if any rank attached files, or said it is writing them in the
background) is published once every such rank's write outcome is in, and retention is applied.
"""

from __future__ import annotations

from typing import Any

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.controller.effects import Effect, Notify, Say, Show, Write
from ringtrain.rundir.schema import CheckpointDeletedEvent, CheckpointEvent, CheckpointFailedEvent
from ringtrain.wire.channel import Report

Outcome = tuple[str, Any]
"""A rank's checkpoint write: ``("files", {rel: info})`` or ``("error", "why")``."""


class Rounds:
    """The reports and checkpoint outcomes of one worker group's rounds. Each update is O(1)
    (a round completes when its report count reaches the world size)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.pending: dict[int, dict[int, Report]] = {}  # round -> rank -> report
        self.last_round: dict[int, int] = {}  # rank -> last round it reported
        self.outcomes: dict[int, dict[int, Outcome]] = {}  # round -> rank -> outcome
        # Rounds whose reports are all in but whose files are still being written.
        self.writing: dict[int, tuple[dict[int, Report], set[int]]] = {}

    def add_report(self, report: Report) -> dict[int, Report] | None:
        """Record ``report``; returns its round's reports once every rank's is in."""
        self.last_round[report.rank] = report.round
        if report.checkpoint_files is not None:
            self.add_outcome(report.round, report.rank, ("files", report.checkpoint_files))
        elif report.checkpoint_error is not None:
            self.add_outcome(report.round, report.rank, ("error", report.checkpoint_error))
        reports = self.pending.setdefault(report.round, {})
        reports[report.rank] = report
        if len(reports) < self.world_size:
            return None
        del self.pending[report.round]
        return reports

    def add_outcome(self, round_: int, rank: int, outcome: Outcome) -> None:
        self.outcomes.setdefault(round_, {})[rank] = outcome

    def complete(self, round_: int, reports: dict[int, Report]) -> bool:
        """A round every rank reported: whether it has a checkpoint to publish."""
        expected = {
            rank
            for rank, r in reports.items()
            if r.checkpoint_files is not None or r.checkpoint_pending or r.checkpoint_error
        }
        if expected:
            self.writing[round_] = (reports, expected)
        return bool(expected)

    def take_publishable(
        self, round_: int
    ) -> tuple[dict[int, Report], set[int], dict[int, Outcome]] | None:
        """Round ``round_``'s reports, writer ranks and outcomes once every writer's outcome is
        in (the round is then forgotten), else None."""
        if round_ not in self.writing:
            return None
        reports, expected = self.writing[round_]
        outcomes = self.outcomes.get(round_, {})
        if not expected <= outcomes.keys():
            return None
        del self.writing[round_]
        self.outcomes.pop(round_, None)
        return reports, expected, outcomes

    def writes_in_flight(self, gone: set[int] | dict[int, Any]) -> bool:
        """Whether a rank not in ``gone`` (exited, or failed as hung or unreachable) owes a
        background write of a round that can still be published (every report of it is in)."""
        for round_, (_reports, expected) in self.writing.items():
            done = self.outcomes.get(round_, {})
            missing = [r for r in expected if r not in done]
            if missing and all(r not in gone for r in missing):
                return True
        return False

    def open_rounds(self) -> list[int]:
        """Rounds some rank never reported, or whose checkpoint is still being written."""
        return sorted(set(self.writing) | set(self.pending))


def round_metrics(reports: dict[int, Report]) -> dict[str, Any]:
    """A round's metrics: rank 0's (or the lowest reporting rank's)."""
    return reports[0].metrics if 0 in reports else next(iter(reports.values())).metrics


class Publisher:
    """Turns a round's staged checkpoint files into a published checkpoint (or says why not).

    The controller executes a :class:`~ringtrain.controller.effects.Publish` effect with
    :meth:`try_publish`, which publishes through the checkpoint manager and returns what the
    controller then writes, shows and calls back.

    Args:
        checkpoints: publication and retention.
    """

    def __init__(self, checkpoints: CheckpointManager) -> None:
        self.checkpoints = checkpoints
        # A file name two ranks wrote is said once per run (with the fix), not every round.
        self.said_shared: set[str] = set()
        # A worker declared lost may still run, cut off (checkpoint/fence.py): from then on a
        # round is published only once its staging directory holds exactly what the ranks
        # reported (CheckpointManager.settle_staging).
        self.guarded = False

    def try_publish(self, rounds: Rounds, round_: int) -> list[Effect]:
        """Publish round ``round_``'s checkpoint once all its reports are in and every rank that
        attached files has finished writing them; the ``checkpoint``, ``checkpoint_deleted``
        (retention) or ``checkpoint_failed`` events and the ``on_checkpoint`` callback."""
        ready = rounds.take_publishable(round_)
        if ready is None:
            return []
        reports, expected, outcomes = ready
        metrics = round_metrics(reports)
        errors = [why for kind, why in (outcomes[r] for r in sorted(expected)) if kind == "error"]
        if errors:
            return self._not_saved(
                round_,
                f"checkpoint of round {round_} was not saved ({'; '.join(errors)}); "
                "training continues, a restart would resume from the previous checkpoint",
                errors,
            )
        effects: list[Effect] = []
        files = self._merge_files(round_, expected, outcomes, effects)
        score_metrics = dict(metrics)
        for r in sorted(reports):  # a score attribute only some rank reported still counts
            for k, v in reports[r].metrics.items():
                score_metrics.setdefault(k, v)
        if self.guarded:
            stray = self.checkpoints.settle_staging(round_, files)
            if stray is not None:
                message = (
                    f"checkpoint of round {round_} was not saved ({stray}: a write of a worker "
                    "declared lost); training continues"
                )
                return effects + self._not_saved(round_, message, [stray])
        try:
            tracked = self.checkpoints.publish(round_, files, score_metrics)
        except ValueError as bad:  # a file name no manifest may hold (a backslash, say)
            message = f"checkpoint of round {round_} was not saved ({bad}); training continues"
            return effects + self._not_saved(round_, message, [str(bad)])
        name = tracked.checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
        effects.append(Write(CheckpointEvent(round=round_, path=name, metrics=metrics)))
        for path, reason in self.checkpoints.deleted:
            effects.append(Write(CheckpointDeletedEvent(path=path, reason=reason)))
        self.checkpoints.deleted.clear()
        effects.append(Notify("on_checkpoint", (tracked.checkpoint, metrics)))
        return effects

    def _not_saved(self, round_: int, message: str, errors: list[str]) -> list[Effect]:
        self.checkpoints.discard_staging(round_)
        return [Say(message, warn=True), Write(CheckpointFailedEvent(round=round_, errors=errors))]

    def _merge_files(
        self,
        round_: int,
        expected: set[int],
        outcomes: dict[int, Outcome],
        effects: list[Effect],
    ) -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = {}
        owners: dict[str, int] = {}
        for rank in sorted(expected):
            for rel, info in outcomes[rank][1].items():
                if rel in files:
                    same = files[rel].get("sha256") == info.get("sha256")
                    info = _digest_on_storage(self.checkpoints, round_, rel)  # what landed
                    if same and info.get("sha256") == files[rel].get("sha256"):
                        continue  # the same bytes (replicas' identical state): nothing lost
                    if rel not in self.said_shared:
                        self.said_shared.add(rel)
                        text = (
                            f"round {round_}: ranks {owners[rel]} and {rank} both wrote "
                            f"checkpoint file {rel!r} with different contents; the last write "
                            "wins (use distinct file names per rank; said once per run)"
                        )
                        effects.append(Show("message", (text,)))
                files[rel] = {**info, "rank": owners.setdefault(rel, rank)}
        return files


def _digest_on_storage(checkpoints: CheckpointManager, round_: int, rel: str) -> dict[str, Any]:
    from ringtrain.checkpoint import storage

    fs, staging = checkpoints.staging_path(round_)
    return storage.file_digest(fs, storage.join(fs, staging, rel))
