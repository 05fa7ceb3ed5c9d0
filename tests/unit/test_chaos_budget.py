"""The budget clock of a chaos run (``ChaosConfig.budget_s``): counted from the run's first
training step, with a start-up allowance of the same length (``chaos.campaign._Budget``), and
the driver wait that asks it again (``chaos.procs.wait_driver``)."""

from __future__ import annotations

import subprocess
import time

from ringtrain.chaos import procs
from ringtrain.chaos.campaign import _Budget
from ringtrain.chaos.worker import log_event


def test_the_budget_runs_from_the_first_step_with_the_start_up_allowed_as_long(tmp_path):
    budget = _Budget(100.0, str(tmp_path))
    before = budget.deadline()
    assert not budget.stepped and before - time.monotonic() > 99.0  # start-up: 100 s
    assert "no step reached" in budget.counted
    log_event(str(tmp_path), event="fault", index=0)  # not a step: the clock stays
    assert budget.deadline() == before
    time.sleep(0.2)
    log_event(str(tmp_path), event="first_step", rank=1, step=1, attempt=0, started=0.0)
    after = budget.deadline()
    assert budget.stepped and after >= before + 0.2  # 100 s again, from the first step
    assert budget.deadline() == after  # once: later steps (other ranks, drivers) do not move it
    log_event(str(tmp_path), event="first_step", rank=0, step=1, attempt=1, started=0.0)
    assert budget.deadline() == after and "from its first step" in budget.counted


class _Driver:
    """A driver process as ``wait_driver`` sees it: ``wait(timeout)`` (no process started)."""

    def __init__(self, exits_after_s: float | None) -> None:
        self.exit_at = None if exits_after_s is None else time.monotonic() + exits_after_s

    def wait(self, timeout: float) -> int:
        if self.exit_at is not None and time.monotonic() + timeout >= self.exit_at:
            time.sleep(max(0.0, self.exit_at - time.monotonic()))
            return 0
        time.sleep(timeout)
        raise subprocess.TimeoutExpired("driver", timeout)


def test_wait_driver_asks_a_moving_deadline_again():
    asked = []
    end = time.monotonic() + 0.6

    def deadline() -> float:
        asked.append(1)
        return end

    assert procs.wait_driver(_Driver(None), deadline) is None  # out of time, still running
    assert len(asked) >= 2
    moved = [time.monotonic() + 0.3]

    def moving() -> float:  # asked again, 0.3 s on: the first step came, the deadline moves
        asked.append(1)
        if len(asked) == 2:
            moved[0] += 1.0
        return moved[0]

    asked.clear()
    assert procs.wait_driver(_Driver(0.8), moving) == 0  # ended within the moved deadline
