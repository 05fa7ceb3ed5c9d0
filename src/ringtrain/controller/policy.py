"""Small policy objects: each returns a decision and says why."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from ringtrain.config import FailureConfig
from ringtrain.result import WorkerFailure


class Decision(enum.Enum):
    RESTART = "restart"
    RAISE = "raise"


@dataclass(frozen=True)
class FailureDecision:
    decision: Decision
    reason: str


class FailurePolicy:
    """Restart the worker group after a failure while ``FailureConfig.max_failures`` allows."""

    def __init__(self, config: FailureConfig) -> None:
        self.max_failures = config.max_failures

    def decide(self, failure: WorkerFailure, failures_so_far: int) -> FailureDecision:
        """Args:
        failure: the failure that just stopped the group.
        failures_so_far: failures of this run including this one (>= 1).
        """
        limit = "inf" if self.max_failures < 0 else str(self.max_failures)
        where = (
            f"{failure.message} after round {failure.round}"
            if failure.round >= 0
            else failure.message
        )
        if self.max_failures < 0 or failures_so_far <= self.max_failures:
            return FailureDecision(
                Decision.RESTART,
                f"restarting: {where}; failure {failures_so_far} of max_failures={limit}",
            )
        return FailureDecision(
            Decision.RAISE,
            f"stopping: {where}; failure {failures_so_far} exceeds max_failures={limit}",
        )
