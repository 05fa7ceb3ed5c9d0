"""A campaign's configuration and its seeded-random fault schedules.

A fault is one of:

- ``kill``: the rank is SIGKILLed at a random moment of the step after ``step`` (during its
  forward, backward, allreduce or report);
- ``write``: the rank is SIGKILLed in the middle of writing its next checkpoint file after
  ``step`` (a half-written file in ``checkpoint_NNNNNN.tmp/``);
- ``hang``: the rank SIGSTOPs itself after ``step`` (the run's hang detection,
  ``FailureConfig.worker_timeout_s``, must notice);
- ``driver``: the driver process is SIGKILLed after ``step`` (its workers die with it); the
  campaign then resumes the run from its run directory, as ``Trainer.restore(path).fit()``;
- ``bitflip``: one bit of the rank's first parameter is flipped after ``step`` (silent data
  corruption); the campaign's runs then check their replicas every step
  (``FailureConfig.replica_check_every=1``), which must catch it and roll the run back (see
  docs/fault-tolerance.md, "Silent data corruption"). Needs 2 or more workers.

Steps count ``TrainState.step`` increments: a fault with ``step=5`` fires when the step counter
first becomes 5, and only once per run (a restarted attempt that passes step 5 again does not
fire it again).
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass
from typing import Any

FAULT_KINDS = ("kill", "write", "hang", "driver", "bitflip")
"""The fault kinds a campaign can inject (see the module docstring)."""

DEFAULT_FAULTS = ("kill", "write", "hang", "driver")
"""The kinds a campaign draws from unless told (``bitflip`` is asked for by name)."""

_WHAT = {"kill": "kill", "write": "kill mid-write", "hang": "SIGSTOP", "bitflip": "bit flip"}

VERDICTS = ("EXACT", "DIVERGED", "HUNG", "ERRORED", "ORPHANS")
"""A faulty run's verdict, best first (see docs/chaos.md)."""


@dataclass(frozen=True)
class Fault:
    """One injected failure.

    Attributes:
        kind: one of :data:`FAULT_KINDS`.
        rank: the world rank that fails (for ``driver``: the rank that kills the driver).
        step: fires when ``TrainState.step`` first reaches this value (>= 1).
        delay_frac: ``kill`` only: the kill lands this fraction of one step's duration after
            ``step`` (0 <= delay_frac < 1), so that it hits a random point of the next step.
    """

    kind: str
    rank: int
    step: int
    delay_frac: float = 0.0

    def describe(self) -> str:
        """``kill rank 1 @ step 5``."""
        if self.kind == "driver":
            return f"driver kill @ step {self.step}"
        what = {
            "kill": "kill",
            "write": "kill mid-write",
            "hang": "SIGSTOP",
            "bitflip": "bit flip",
        }[self.kind]
        return f"{what} rank {self.rank} @ step {self.step}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ChaosConfig:
    """How a campaign runs (``ringtrain chaos`` options, one for one).

    Attributes:
        runs: faulty runs per world size (``--runs``, >= 1).
        seed: the seed of every fault schedule (``--seed``); the same seed, script and world
            sizes give the same schedules.
        faults: the fault kinds to draw from (``--faults``), a subset of :data:`FAULT_KINDS`.
        faults_per_run: faults injected into each faulty run (``--faults-per-run``, >= 1).
        workers: world sizes to run the campaign at (``--workers 2,3``), each >= 1.
        steps: stop every run cleanly when ``TrainState.step`` would pass this many steps
            (``--steps``; ``None``: the training's own length). Checkpoints up to this step are
            compared.
        hang_timeout_s: the runs' ``FailureConfig.worker_timeout_s`` in seconds
            (``--hang-timeout``; ``None`` or 0 on the command line: no hang detection, so a
            SIGSTOP fault leaves the run HUNG).
        budget_s: wall time a faulty run may take from its first training step, all its
            drivers together, before it is killed and counted HUNG (``--budget``): seconds, or
            a string ``"3x"`` for a multiple of the clean run's wall time; ``None``: 5 x the
            clean run's wall time + 60 s. Its start-up, before the first step, may take as
            long again (a busy machine's slow start does not use up the budget).
        out_dir: where the campaign's runs, logs and report go (``--out``).
    """

    runs: int = 3
    seed: int = 0
    faults: tuple[str, ...] = DEFAULT_FAULTS
    faults_per_run: int = 2
    workers: tuple[int, ...] = (2,)
    steps: int | None = None
    hang_timeout_s: float | None = 10.0
    budget_s: float | str | None = None
    out_dir: str = "./chaos"

    def __post_init__(self) -> None:
        for name, flag in (("runs", "--runs"), ("faults_per_run", "--faults-per-run")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"ChaosConfig.{name} ({flag}) must be a whole number >= 1, got {value!r}"
                )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"ChaosConfig.seed (--seed) must be an int, got {self.seed!r}")
        faults = tuple(self.faults)
        bad = [f for f in faults if f not in FAULT_KINDS]
        if not faults or bad:
            raise ValueError(
                f"ChaosConfig.faults (--faults) must be a non-empty subset of "
                f"{','.join(FAULT_KINDS)}, got {','.join(map(str, faults)) or 'nothing'}"
            )
        object.__setattr__(self, "faults", faults)
        workers = tuple(self.workers)
        if not workers or any(
            isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in workers
        ):
            raise ValueError(
                f"ChaosConfig.workers (--workers) must be world sizes >= 1, e.g. 2,3; got "
                f"{workers!r}"
            )
        object.__setattr__(self, "workers", tuple(dict.fromkeys(workers)))
        if "bitflip" in faults and min(self.workers) < 2:
            raise ValueError(
                "ChaosConfig.faults (--faults) has bitflip, which replicas detect: every world "
                f"size must be 2 or more (--workers), got {','.join(map(str, self.workers))}"
            )
        if self.steps is not None and (
            isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 2
        ):
            raise ValueError(
                f"ChaosConfig.steps (--steps) must be a whole number >= 2 or None (the "
                f"training's own length), got {self.steps!r}"
            )
        self._check_budget()
        for name, flag in (("hang_timeout_s", "--hang-timeout"),):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not value > 0
                or value == float("inf")
            ):
                raise ValueError(
                    f"ChaosConfig.{name} ({flag}) must be a positive number of seconds or None, "
                    f"got {value!r}"
                )
        if not isinstance(self.out_dir, (str, os.PathLike)) or not str(self.out_dir):
            raise ValueError(
                f"ChaosConfig.out_dir (--out) must be a directory, got {self.out_dir!r}"
            )
        object.__setattr__(self, "out_dir", os.fspath(self.out_dir))

    def _check_budget(self) -> None:
        budget = self.budget_s
        if budget is None:
            return
        text = str(budget).strip()
        factor = text.endswith("x")
        try:
            value = float(text[:-1] if factor else text)
        except ValueError:
            value = float("nan")
        if isinstance(budget, bool) or not value > 0 or value == float("inf"):
            raise ValueError(
                "ChaosConfig.budget_s (--budget) must be a positive number of seconds, or a "
                f"multiple of the clean run's wall time like '3x', got {budget!r}"
            )
        object.__setattr__(self, "budget_s", f"{value:g}x" if factor else value)

    def budget_for(self, clean_wall_s: float) -> float:
        """The wall time (seconds) a faulty run may take, given the clean run's."""
        budget = self.budget_s
        if budget is None:
            return 5.0 * clean_wall_s + 60.0
        if isinstance(budget, str):
            return float(budget[:-1]) * clean_wall_s
        return float(budget)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def run_seed(seed: int, world_size: int, index: int) -> str:
    """The seed of one run's schedule, printed with its verdict so that it can be replayed."""
    return f"{seed}:{world_size}:{index}"


def make_plan(
    config: ChaosConfig, world_size: int, index: int, last_step: int
) -> tuple[Fault, ...]:
    """The fault schedule of faulty run ``index`` at ``world_size``: ``faults_per_run`` faults
    of random kinds (from ``config.faults``), random ranks (rank 0 included) and random steps
    in ``[1, last_step - 1]``, ordered by step.

    Args:
        last_step: the clean run's final ``TrainState.step`` (>= 2).

    Raises:
        ValueError: if ``last_step < 2`` (no step to fail at before the end).
    """
    if last_step < 2:
        raise ValueError(
            f"the clean run ended at step {last_step}: a campaign needs a training of at least 2 "
            "TrainState steps (increment state.step once per optimizer step)"
        )
    rng = random.Random(run_seed(config.seed, world_size, index))
    faults = [
        Fault(
            kind=rng.choice(config.faults),
            rank=rng.randrange(world_size),
            step=rng.randint(1, last_step - 1),
            delay_frac=round(rng.random(), 3),
        )
        for _ in range(config.faults_per_run)
    ]
    return tuple(sorted(faults, key=lambda f: f.step))
