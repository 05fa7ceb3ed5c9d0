"""``run_campaign``: a clean run, then K runs under seeded-random faults, each compared with it.

For each world size W: the user's train function runs once without faults (the reference), then
``runs`` times with a fault schedule of :func:`~ringtrain.chaos.plan.make_plan`. Each run has its
own driver process (so that the driver itself can be killed and the run resumed from its run
directory); every checkpoint of a faulty run is compared with the clean run's of the same round
(:mod:`ringtrain.chaos.compare`), and the run gets a verdict:

EXACT     every checkpoint equals the clean run's, bit for bit, and no process outlived a driver;
DIVERGED  a checkpoint differs (the report says which state, from which step, after which resume);
HUNG      the run did not finish within the budget (it was killed, with every process it had);
ERRORED   the run failed (beyond its max_failures, or its driver died unexpectedly);
ORPHANS   the state is exact, but a process of the run was alive 1 s after its driver ended.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

from ringtrain.chaos import compare, procs
from ringtrain.chaos.plan import DEFAULT_FAULTS, ChaosConfig, Fault, make_plan, run_seed
from ringtrain.chaos.report import CampaignReport, RunReport
from ringtrain.chaos.worker import ChaosTrainFn, read_log
from ringtrain.launch.backends import backend_for
from ringtrain.rundir.reader import run_events
from ringtrain.rundir.schema import FailureEvent

ORPHAN_GRACE_S = 1.0
"""A process of a run still alive this long after its driver ended is an orphan."""


def campaign_tag(out_dir: str) -> str:
    """The prefix of the process tags of the campaign in ``out_dir`` (one tag per run)."""
    import hashlib

    return hashlib.sha256(os.path.abspath(out_dir).encode()).hexdigest()[:12]


class ChaosError(RuntimeError):
    """The campaign cannot run (the clean run failed, or checkpoints nothing to compare)."""


def run_campaign(
    train_fn: Callable[..., Any],
    *,
    train_loop_config: dict[str, Any] | None = None,
    scaling_config: Any = None,
    steps: int | None = None,
    runs: int = 3,
    seed: int = 0,
    faults: tuple[str, ...] = DEFAULT_FAULTS,
    faults_per_run: int = 2,
    workers: tuple[int, ...] | None = None,
    hang_timeout_s: float | None = 10.0,
    budget_s: float | str | None = None,
    out_dir: str = "./chaos",
    display: Any = None,
) -> CampaignReport:
    """Verify that ``train_fn`` resumes exactly: run it clean, then ``runs`` times per world
    size under seeded-random faults, and compare every checkpoint with the clean run's.

    ``train_fn`` must save a ``TrainState`` with ``report(metrics, checkpoint=state)`` every few
    steps and increment ``state.step`` once per optimizer step (the faults are placed by step,
    and divergence is localised to the checkpoints). See docs/chaos.md.

    Args:
        train_fn: the per-worker train function, as for :class:`ringtrain.Trainer`.
        train_loop_config: its ``config``.
        scaling_config: a local ``ScalingConfig`` (its ``num_workers`` is the default world
            size; ``workers`` overrides it).
        steps, runs, seed, faults, faults_per_run, workers, hang_timeout_s, budget_s, out_dir:
            see :class:`~ringtrain.chaos.plan.ChaosConfig`.
        display: receives progress (default: a :class:`~ringtrain.chaos.display.Display` that
            prints plain lines).

    Returns:
        The :class:`CampaignReport` (``report.ok``: every faulty run EXACT).

    Raises:
        ValueError: for a bad option (before anything runs), naming it.
        ChaosError: when a clean run fails or writes no checkpoint.
    """
    import ringtrain as rt

    scaling = scaling_config if scaling_config is not None else rt.ScalingConfig(num_workers=2)
    if not isinstance(scaling, rt.ScalingConfig):
        raise ValueError(f"scaling_config must be a ringtrain.ScalingConfig, got {scaling!r}")
    if not backend_for(scaling).local_processes or scaling.in_place:  # it kills pids
        raise ValueError(
            "ringtrain chaos runs local, fixed-size runs without hot spares: use "
            "ScalingConfig(backend='local', num_workers=W, spares=0), got "
            f"backend={scaling.backend!r}, num_workers={scaling.num_workers!r}, "
            f"spares={scaling.spares!r}"
        )
    if not callable(train_fn):
        raise ValueError(f"train_fn must be callable, got {type(train_fn).__name__}")
    config = ChaosConfig(
        runs=runs,
        seed=seed,
        faults=tuple(faults),
        faults_per_run=faults_per_run,
        workers=tuple(workers) if workers else (scaling.max_workers,),
        steps=steps,
        hang_timeout_s=hang_timeout_s,
        budget_s=budget_s,
        out_dir=out_dir,
    )
    if display is None:
        from ringtrain.chaos.display import Display

        display = Display("plain")
    report = CampaignReport(config)
    campaign = _Campaign(train_fn, train_loop_config, scaling, config, display)
    for world_size in config.workers:
        clean = campaign.run(world_size, 0, ())
        report.clean.append(clean)
        if clean.verdict != "CLEAN":
            raise ChaosError(f"the clean run at world size {world_size} failed: {clean.detail}")
        last = clean.last_step
        if last is None:
            raise ChaosError(
                f"the clean run at world size {world_size} ({clean.run_dir}) wrote no TrainState "
                "checkpoint: chaos compares checkpoints, so train_fn must call "
                "ringtrain.report(metrics, checkpoint=state) with a ringtrain.TrainState every "
                "few steps"
            )
        for index in range(1, config.runs + 1):
            plan = make_plan(config, world_size, index, last)
            result = campaign.run(world_size, index, plan, clean=clean)
            report.runs.append(result)
    display.finished(report)
    return report


class _Campaign:
    def __init__(
        self,
        train_fn: Callable[..., Any],
        train_loop_config: dict[str, Any] | None,
        scaling: Any,
        config: ChaosConfig,
        display: Any,
    ) -> None:
        self.train_fn = train_fn
        self.train_loop_config = train_loop_config
        self.scaling = scaling
        self.config = config
        self.display = display
        self.root = os.path.abspath(config.out_dir)
        self.storage = os.path.join(self.root, "runs")
        self.clean_wall: dict[int, float] = {}

    def run(
        self, world_size: int, index: int, plan: tuple[Fault, ...], clean: RunReport | None = None
    ) -> RunReport:
        """One run (index 0: the clean reference) from start to verdict."""
        import dataclasses

        from ringtrain.wire.payload import dumps

        name = f"w{world_size}_clean" if index == 0 else f"w{world_size}_run{index:02d}"
        run_path = os.path.join(self.storage, name)
        chaos_dir = os.path.join(self.root, "chaos", name)
        for stale in (run_path, chaos_dir):  # a campaign run again starts its runs afresh
            shutil.rmtree(stale, ignore_errors=True)
        os.makedirs(chaos_dir)
        report = RunReport(
            world_size,
            index,
            run_seed(self.config.seed, world_size, index),
            [{**f.to_dict(), "injected": False} for f in plan],
            run_dir=run_path,
        )
        fn = ChaosTrainFn(self.train_fn, plan, chaos_dir, self.config.steps)
        payload = os.path.join(chaos_dir, "payload.pkl")
        with open(payload, "wb") as f:
            f.write(dumps((fn, self.train_loop_config)))
        scaling = dataclasses.replace(self.scaling, num_workers=world_size).to_dict()
        failure = {
            "max_failures": sum(f.kind != "driver" for f in plan) + 1,
            "worker_timeout_s": self.config.hang_timeout_s,
            # Bit flips are caught by the replica check (the clean run checks too, alike).
            "replica_check_every": 1 if "bitflip" in self.config.faults else 0,
        }
        budget = self.config.budget_for(self.clean_wall.get(world_size, 120.0))
        tag = f"{campaign_tag(self.root)}-{uuid.uuid4().hex[:12]}"
        self.display.run_started(report, [f.describe() for f in plan])
        start = time.monotonic()
        status, detail = self._drive(
            report, tag, chaos_dir, run_path, payload, scaling, failure, budget
        )
        report.wall_s = round(time.monotonic() - start, 3)
        report.failures = _failures(run_path)
        self._read_log(report, chaos_dir)
        if index == 0:
            self.clean_wall[world_size] = report.wall_s
            report.verdict = "CLEAN" if status == "finished" else "ERRORED"
            report.detail = detail
            report.last_step = _last_step(run_path)
        else:
            assert clean is not None
            report.verdict, report.detail = self._verdict(status, detail, report, clean)
        self.display.run_finished(report)
        return report

    def _drive(
        self,
        report: RunReport,
        tag: str,
        chaos_dir: str,
        run_path: str,
        payload: str,
        scaling: dict[str, Any],
        failure: dict[str, Any],
        budget_s: float,
    ) -> tuple[str, str]:
        """Start the run's driver, resume it after each planned driver kill; ``(status,
        detail)`` with status ``finished``, ``errored`` or ``hung``."""
        outcome = os.path.join(chaos_dir, "outcome.json")
        mode = "start"
        log = os.path.join(chaos_dir, "driver.log")
        budget = _Budget(budget_s, chaos_dir)
        try:
            while True:
                spec = os.path.join(chaos_dir, f"driver_{report.drivers}.json")
                with open(spec, "w") as f:
                    json.dump(
                        {
                            "mode": mode,
                            "payload": payload,
                            "run_path": run_path,
                            "name": os.path.basename(run_path),
                            "storage_path": self.storage,
                            "scaling_config": scaling,
                            "failure_config": failure,
                            "outcome": outcome,
                        },
                        f,
                    )
                proc = procs.start_driver(spec, tag, log)
                report.drivers += 1
                code = procs.wait_driver(
                    proc, budget.deadline, lambda: self.display.tick(report, time.monotonic())
                )
                if code is None:
                    procs.kill_tagged(tag)
                    proc.wait()
                    return "hung", (
                        f"not finished within its budget of {budget_s:.0f} s {budget.counted}; "
                        "killed with every process of the run"
                    )
                time.sleep(ORPHAN_GRACE_S)
                left = procs.tagged(tag)
                report.orphans += [o.to_dict() for o in left]
                procs.kill_tagged(tag)
                if code == -signal.SIGKILL and self._driver_fault_fired(chaos_dir, proc.pid):
                    mode = "resume"
                    continue
                if code == 0:
                    return "finished", ""
                return "errored", _error_of(outcome, code, log)
        except BaseException:
            procs.kill_tagged(tag)
            raise

    @staticmethod
    def _driver_fault_fired(chaos_dir: str, pid: int) -> bool:
        return any(
            e.get("event") == "fault" and e.get("driver_pid") == pid for e in read_log(chaos_dir)
        )

    @staticmethod
    def _read_log(report: RunReport, chaos_dir: str) -> None:
        """Mark the faults that fired, and their recovery: fault time -> the first step of a
        worker started after it (``recovery_s``), and -> the controller's next failure event
        (``failure_seen_s``). A SIGSTOP fault is ``detected`` when the controller recorded a
        hang of its rank (``report.failures`` must be read first)."""
        log = read_log(chaos_dir)
        starts = sorted((e["started"], e["time"]) for e in log if e.get("event") == "first_step")
        for e in log:
            if e.get("event") != "fault" or not 0 <= e.get("index", -1) < len(report.faults):
                continue
            fault = report.faults[e["index"]]
            fault.update(injected=True, time=e["time"], fired_at_step=e.get("step"))
            if fault["kind"] == "hang":
                fault["detected"] = any(
                    f["kind"] == "hang" and f["rank"] == fault["rank"] for f in report.failures
                )
            if e.get("file"):
                fault["file"] = (
                    os.path.basename(os.path.dirname(e["file"]))
                    + "/"
                    + (os.path.basename(e["file"]))
                )
            after = [t for started, t in starts if started > e["time"]]
            fault["recovery_s"] = round(min(after) - e["time"], 3) if after else None
            # events.jsonl: when the controller saw the failure (None for a driver kill)
            seen = [f["time"] for f in report.failures if (f.get("time") or 0) >= e["time"]]
            fault["failure_seen_s"] = round(min(seen) - e["time"], 3) if seen else None

    def _verdict(
        self, status: str, detail: str, report: RunReport, clean: RunReport
    ) -> tuple[str, str]:
        if status == "hung":
            return "HUNG", detail
        if status == "errored":
            return "ERRORED", detail
        report.last_step = _last_step(report.run_dir)
        try:
            diff = compare.compare_runs(clean.run_dir, report.run_dir)
        except (ValueError, OSError) as exc:
            return "ERRORED", f"cannot compare the checkpoints: {exc}"
        if diff is not None:
            return "DIVERGED", diff.message()
        if report.orphans:
            pids = ", ".join(str(o["pid"]) for o in report.orphans)
            return "ORPHANS", (
                f"state exact, but {len(report.orphans)} process(es) outlived the driver by "
                f">{ORPHAN_GRACE_S:g} s: {pids}"
            )
        injected = sum(bool(f["injected"]) for f in report.faults)
        return "EXACT", (
            f"all {len(compare.list_checkpoints(report.run_dir))} checkpoints bit-identical to "
            f"the clean run's; {injected} of {len(report.faults)} faults injected"
        )


def _last_step(run_path: str) -> int | None:
    ckpts = compare.list_checkpoints(run_path) if os.path.isdir(run_path) else {}
    if not ckpts:
        return None
    try:
        return compare.checkpoint_step(compare.load_checkpoint(list(ckpts.values())[-1]))
    except (ValueError, OSError):
        return None


def _failures(run_path: str) -> list[dict[str, Any]]:
    keys = ("attempt", "rank", "kind", "message", "time")
    return [
        {k: getattr(ev, k) for k in keys}
        for ev in run_events(run_path)
        if isinstance(ev, FailureEvent)
    ]


def _error_of(outcome: str, code: int, log: str) -> str:
    try:
        with open(outcome) as f:
            error = json.load(f).get("error")
        if error:
            return str(error).strip().splitlines()[0][:300]
    except (OSError, ValueError):
        pass
    reason = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
    return f"the driver ended unexpectedly ({reason}); see {log}"


class _Budget:
    """The deadline of one faulty run (``ChaosConfig.budget_s``): ``budget_s`` from the run's
    first training step (the chaos log's first ``first_step`` event), all its drivers
    together. Until that step, ``budget_s`` from the driver's start, so that a start-up slowed
    by a busy machine does not use up the run's budget (the fault would never fire and the run
    would be called HUNG for it), and a run that never reaches a step still ends."""

    def __init__(self, budget_s: float, chaos_dir: str) -> None:
        self.budget_s = budget_s
        self.chaos_dir = chaos_dir
        self.at = time.monotonic() + budget_s
        self.stepped = False

    @property
    def counted(self) -> str:
        return "from its first step" if self.stepped else "and no step reached"

    def deadline(self) -> float:
        """``time.monotonic()`` at which the run is out of budget, as far as known now."""
        if not self.stepped and any(
            e.get("event") == "first_step" for e in read_log(self.chaos_dir)
        ):
            self.stepped = True
            self.at = time.monotonic() + self.budget_s
        return self.at
