"""A scripted fake worker group and launcher for stepping the real Controller without processes
(tests/unit/test_controller.py, tests/unit/test_controller_states.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import CheckpointConfig, FailureConfig
from ringtrain.controller.controller import Controller
from ringtrain.controller.policy import FailurePolicy
from ringtrain.launch.base import WorkerSpec
from ringtrain.monitor.progress import make_progress
from ringtrain.rundir import RunDirectory
from ringtrain.wire.channel import Exited, Heartbeat, Hello

# A scripted attempt: batches of events, one per poll; a callable batch is called when polled.
Script = list[Any]


class FakeGroup:
    def __init__(self, world_size: int, script: Script) -> None:
        self.world_size = world_size
        self.script = list(script)  # list of event batches, one batch per poll
        self.stopped = False
        self.dumped: list[int] = []  # ranks asked to print their stacks, in order

    def poll(self, timeout_s: float) -> list[Any]:
        if not self.script:
            return []
        batch = self.script.pop(0)
        # A callable batch runs when it is polled (after every earlier event was handled): it can
        # look at or change the run directory at that moment, and returns the events to deliver.
        return batch() if callable(batch) else batch

    def stop(self, grace_s: float = 5.0) -> None:
        self.stopped = True

    def pids(self) -> dict[int, int]:
        return {}

    def dump_stacks(self, ranks: list[int]) -> None:
        self.dumped.extend(ranks)


class FakeLauncher:
    def __init__(self, attempts: list[Any]) -> None:
        self.attempts = list(attempts)
        self.specs: list[WorkerSpec] = []
        self.groups: list[FakeGroup] = []

    def start(self, spec: WorkerSpec) -> Any:
        self.specs.append(spec)
        script = self.attempts.pop(0)
        if hasattr(script, "poll"):  # a ready-made worker group
            self.groups.append(script)
            return script
        # A callable script is built when its attempt starts (after the controller has cleared
        # the previous attempt's staging directories), as real workers would write files then.
        group = FakeGroup(spec.world_size, script() if callable(script) else script)
        self.groups.append(group)
        return group


def make_controller(
    tmp_path: Path, launcher: Any, world_size: int = 2, max_failures: int = 0, **kwargs: Any
) -> Controller:
    """A real Controller over ``launcher``, its run directory ``tmp_path/run``, no grace or
    poll delays; ``kwargs``: more Controller arguments (``worker_timeout_s=0.3``, ...)."""
    run_dir = RunDirectory(str(tmp_path), "run")
    run_dir.create()
    ckpts = CheckpointManager(run_dir.fs, run_dir.path, CheckpointConfig())
    return Controller(
        launcher=launcher,
        make_spec=lambda attempt, start, latest: WorkerSpec(
            world_size=world_size,
            run_dir=run_dir.uri,
            attempt=attempt,
            start_round=start,
            latest_checkpoint=latest,
        ),
        world_size=world_size,
        run_dir=run_dir,
        checkpoints=ckpts,
        failure_policy=FailurePolicy(FailureConfig(max_failures=max_failures)),
        progress=make_progress("off"),
        failure_grace_s=0.0,
        poll_interval_s=0.0,
        **kwargs,
    )


class GuardedGroup(FakeGroup):
    """A FakeGroup that ends the attempt cleanly after ``guard_s`` seconds, so that a controller
    that never notices a hang makes the test fail instead of spinning until the pytest timeout."""

    def __init__(self, world_size: int, script: Script, guard_s: float = 5.0) -> None:
        super().__init__(world_size, script)
        self.started = time.monotonic()
        self.guard_s = guard_s

    def poll(self, timeout_s: float) -> list[Any]:
        if time.monotonic() - self.started > self.guard_s:
            return [Exited(r, time.time(), 0) for r in range(self.world_size)]
        return super().poll(timeout_s)


class HeartbeatGroup(GuardedGroup):
    """Every rank says Hello, then only sends heartbeats; ``age(rank, elapsed)`` is the rank's
    ``progress_age_s`` (None: the rank sends nothing)."""

    def __init__(
        self, world_size: int, age: Callable[[int, float], float | None], guard_s: float = 5.0
    ) -> None:
        super().__init__(world_size, [[Hello(r, 100 + r, "h") for r in range(world_size)]], guard_s)
        self.age = age

    def poll(self, timeout_s: float) -> list[Any]:
        events = super().poll(timeout_s)
        if events:
            return events
        time.sleep(0.01)
        elapsed = time.monotonic() - self.started
        beats = [(r, self.age(r, elapsed)) for r in range(self.world_size)]
        return [Heartbeat(r, time.time(), a, step=40 + r) for r, a in beats if a is not None]


def controller_events(tmp_path: Path) -> list[dict]:
    """The events a controller of ``make_controller(tmp_path, ...)`` wrote (run ``run``)."""
    text = (tmp_path / "run" / "events.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines()]
