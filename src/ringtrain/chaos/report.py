"""What a campaign found: a :class:`RunReport` per run and the :class:`CampaignReport`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from ringtrain.chaos.plan import VERDICTS, ChaosConfig


@dataclass
class RunReport:
    """One run of a campaign (the clean run has ``index == 0`` and no faults).

    Attributes:
        world_size: W.
        index: 1..runs for faulty runs, 0 for the clean run.
        seed: the schedule's seed, ``"SEED:W:INDEX"``.
        faults: the planned faults, each with ``injected`` (bool), ``time``, ``fired_at_step``,
            ``recovery_s`` (seconds from the fault to the first training step after the
            restart), ``failure_seen_s`` (to the controller's failure event; None for a driver
            kill), ``file`` (a ``write`` fault's half-written file) and ``detected`` (a ``hang``
            fault: the controller failed the rank as hung).
        verdict: one of :data:`~ringtrain.chaos.plan.VERDICTS` (``"CLEAN"`` for the clean run).
        detail: why, in one sentence (for DIVERGED: which state differs from which step).
        wall_s: the run's wall time, all its drivers together (seconds).
        drivers: how many driver processes the run took (1 + driver kills resumed).
        failures: the failures the run's controller recorded (``kind``, ``rank``, ``message``).
        orphans: processes found alive 1 s after a driver ended (pid, command line).
        last_step: the ``TrainState.step`` of the run's last checkpoint.
        run_dir: the run directory.
    """

    world_size: int
    index: int
    seed: str
    faults: list[dict[str, Any]]
    verdict: str = "ERRORED"
    detail: str = ""
    wall_s: float = 0.0
    drivers: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)
    orphans: list[dict[str, Any]] = field(default_factory=list)
    last_step: int | None = None
    run_dir: str = ""

    @property
    def recovery_s(self) -> list[float]:
        return [f["recovery_s"] for f in self.faults if f.get("recovery_s") is not None]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "recovery_s": self.recovery_s}


@dataclass
class CampaignReport:
    """What a campaign found: ``clean`` (one :class:`RunReport` per world size) and ``runs``."""

    config: ChaosConfig
    clean: list[RunReport] = field(default_factory=list)
    runs: list[RunReport] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every faulty run is EXACT."""
        return bool(self.runs) and all(r.verdict == "EXACT" for r in self.runs)

    def summary(self, world_size: int) -> dict[str, Any]:
        """Counts per verdict, orphans and the mean recovery time of one world size."""
        runs = [r for r in self.runs if r.world_size == world_size]
        recovery = [s for r in runs for s in r.recovery_s]
        counts = {v.lower(): sum(r.verdict == v for r in runs) for v in VERDICTS}
        return {
            "world_size": world_size,
            "runs": len(runs),
            **counts,
            "orphan_processes": sum(len(r.orphans) for r in runs),
            "faults_injected": sum(bool(f.get("injected")) for r in runs for f in r.faults),
            "mean_recovery_s": round(sum(recovery) / len(recovery), 3) if recovery else None,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "ok": self.ok,
            "summary": [self.summary(w) for w in self.config.workers],
            "clean": [r.to_dict() for r in self.clean],
            "runs": [r.to_dict() for r in self.runs],
        }

    def write_json(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1, default=repr)
