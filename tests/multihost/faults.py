"""One W=3 Ray job on three namespace hosts with one network fault injected mid-run, and what
came of it: shared by the fault tests (tests/multihost/test_netfaults.py) and the randomized
campaign (benchmarks/netfaults.py).

The job is ``hosts_workload.train_fn`` (a checkpoint every 2 steps, ``sleep`` s per step), its
driver on h1 (the Ray head), ``SPREAD`` over h1-h3 with ``worker_timeout_s``. A fault hits the
host of a worker other than the driver's once its ``at_round``-th checkpoint is published
(``checkpoint_{2 * at_round - 1}``: a report every step, a checkpoint every 2), plus
``delay_s``:

* ``host_loss``: every process of the host killed at once (its Ray node too);
* ``partition``: its link cut and left down until the run ends (its processes keep running);
* ``flap``: its link down for ``flap_s`` (less than the timeout), then back;
* ``brownout``: its link at 1 Mbit/s for ``brownout_s``, then unlimited again.

:func:`run_with_fault` returns an :class:`Outcome` and leaves the bed as it found it (the
victim healed, unlimited, its Ray node alive), so runs can follow each other on one bed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
FAULTS = ("host_loss", "partition", "flap", "brownout")
TIMEOUT_S = 10.0  # FailureConfig.worker_timeout_s of the runs
STEPS = 24
BROWNOUT_MBIT = 1.0

_DRIVER = """
import ringtrain as rt
import hosts_workload
result = rt.Trainer(
    hosts_workload.train_fn,
    rt.ScalingConfig(num_workers=3, backend="ray", placement_strategy="SPREAD"),
    rt.RunConfig(
        name={name!r}, storage_path={runs!r}, progress="off",
        failure_config=rt.FailureConfig(max_failures=3, worker_timeout_s={timeout}),
    ),
    train_loop_config={{"steps": {steps}, "out": {out!r}, "sleep": {sleep},
                        "save_on_error": {save_on_error}}},
).fit()
print("STATUS", result.status, flush=True)
"""

_VERIFY = """
import os, sys
import fsspec
from ringtrain.checkpoint.storage import read_manifest
run = sys.argv[1]
fs = fsspec.filesystem("file")
for name in sorted(os.listdir(run)):
    if name.startswith("checkpoint_") and not name.endswith(".tmp"):
        read_manifest(fs, os.path.join(run, name), verify_checksums=True)
"""


@dataclass
class Outcome:
    """What one run under a fault came to.

    Attributes:
        fault, victim: what was done to which host (``"h2"``/``"h3"``; ``None``: the run ended
            before the fault could be injected).
        status: the run's final status (``FINISHED``, ...; ``HANG`` if the driver did not end
            within the run's time limit and was killed).
        exact: the final parameters and optimizer state equal the reference's, bit for bit.
        failures: ``(kind, message)`` of every failure event.
        restarts: attempts after the first.
        detect_s: fault -> the first failure event (s; ``None``: none).
        decided_s: fault -> the failure policy's first decision, written once the lost
            group is torn down (s).
        recover_s: fault -> the first report of the attempt that replaced the lost one (s).
        orphans: ringtrain processes still on the hosts once the run ended and the link healed.
        split_brain: writes the cut-off worker made after the controller declared it lost
            (tries that were not refused), plus published checkpoints that fail verification
            and staging directories left behind.
        output: the driver's output's last 3000 characters.
    """

    fault: str
    victim: str | None
    status: str
    exact: bool
    failures: list[tuple[str, str]] = field(default_factory=list)
    restarts: int = 0
    detect_s: float | None = None
    decided_s: float | None = None
    recover_s: float | None = None
    orphans: list[str] = field(default_factory=list)
    split_brain: list[str] = field(default_factory=list)
    output: str = ""

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("output")
        return out


def env() -> dict[str, str]:
    return {"PYTHONPATH": str(HERE)}


def reference(workdir: Path, steps: int = STEPS) -> dict:
    """The same job on 3 local worker processes (``ringtrain run -n 3``), uninterrupted: its
    final state."""
    out = workdir / "reference.pt"
    cmd = [sys.executable, "-m", "ringtrain.cli", "run", "-n", "3", "--storage-path"]
    cmd += [str(workdir / "runs"), "--name", "reference", str(HERE / "hosts_workload.py")]
    cmd += ["--steps", str(steps), "--sleep", "0", "--out", str(out)]
    import os

    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **env()}
    )
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-3000:] + done.stderr[-3000:])
    return torch.load(out, weights_only=True)


def same_bits(a: dict, b: dict) -> bool:
    """Two final states (step, parameters, SGD momentum) equal tensor by tensor."""
    if a["step"] != b["step"] or a["model"].keys() != b["model"].keys():
        return False
    if not all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]):
        return False
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]) for i in sa
    )


def worker_procs(bed: Any, host: Any) -> list[str]:
    """ringtrain's processes on ``host``: worker processes and their Ray actors."""
    found = []
    for pid in bed.pids(host):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "ringtrain.launch.worker" in cmd or "RayWorker" in cmd:
            found.append(f"{host.name}:{pid} {cmd[:80]}")
    return found


def _wait(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def _events(run: Path) -> list[dict]:
    path = run / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_with_fault(
    ray_bed: Any,
    workdir: Path,
    fault: str,
    ref: dict,
    *,
    at_round: int = 4,
    delay_s: float = 0.0,
    victim: str | None = None,
    flap_s: float = 3.0,
    brownout_s: float = 6.0,
    sleep: float = 0.2,
    steps: int = STEPS,
    limit_s: float = 400.0,
    save_on_error: float = 30.0,
    name: str = "fault",
) -> Outcome:
    """Run the job on ``ray_bed`` with ``fault`` (one of :data:`FAULTS`, or several joined by
    ``+``, injected one after the other) and say what came of it (:class:`Outcome`).
    ``victim``: ``"h2"`` or ``"h3"`` (``None``: h3, or h2 if no worker landed on h3). Times
    in seconds; ``limit_s`` bounds the run (past it: a hang).

    Raises:
        ValueError: an unknown fault.
    """
    if not set(fault.split("+")) <= set(FAULTS):
        raise ValueError(f"fault must be one of {FAULTS} or several joined by '+', got {fault!r}")
    bed = ray_bed.bed
    h1 = bed.hosts[0]
    runs, out = workdir / "runs", workdir / f"{name}.pt"
    script = _DRIVER.format(
        name=name, runs=str(runs), timeout=TIMEOUT_S, steps=steps, out=str(out),
        sleep=sleep, save_on_error=save_on_error,
    )  # fmt: skip
    driver = ray_bed.popen(
        h1,
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(driver.stdout), daemon=True)
    reader.start()
    run = runs / name
    host = None
    fault_at = None
    hang = False
    try:
        _wait(
            lambda: (
                (run / f"checkpoint_{2 * at_round - 1:06d}").exists() or driver.poll() is not None
            ),
            limit_s,
        )
        time.sleep(delay_s)
        candidates = [victim] if victim else ["h3", "h2"]
        chosen = next((h for h in candidates if worker_procs(bed, bed.host(h))), None)
        if chosen is not None and driver.poll() is None:
            host = bed.host(chosen)
            fault_at = time.time()
            for one in fault.split("+"):  # one after the other
                _inject(ray_bed, host, one, flap_s, brownout_s)
        try:
            driver.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            hang = True
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        reader.join(timeout=10)
        output = "".join(lines)
        if host is not None and bed.is_cut(host):
            bed.heal(host)
        if host is not None:
            bed.limit(host, None)
    status = "HANG" if hang else (re.findall(r"STATUS (\w+)", output) or ["ERRORED"])[-1]
    outcome = Outcome(fault=fault, victim=host.name if host else None, status=status,
                      exact=False, output=output[-3000:])  # fmt: skip
    if out.exists():
        outcome.exact = same_bits(torch.load(out, weights_only=True), ref)
    _measure(outcome, _events(run), fault_at)
    outcome.split_brain = _split_brain(ray_bed, workdir, run, name, host)
    outcome.orphans = _orphans(bed)
    if host is not None and {"host_loss", "partition"} & set(fault.split("+")):
        revive(ray_bed, host)
    return outcome


def _inject(ray_bed: Any, host: Any, fault: str, flap_s: float, brownout_s: float) -> None:
    bed = ray_bed.bed
    if fault == "host_loss":
        bed.kill_host(host)
    elif fault == "partition":
        bed.cut(host)
    elif fault == "flap":
        bed.cut(host)
        time.sleep(flap_s)
        bed.heal(host)
    else:
        bed.limit(host, BROWNOUT_MBIT)
        time.sleep(brownout_s)
        bed.limit(host, None)


def _measure(outcome: Outcome, events: list[dict], fault_at: float | None) -> None:
    failures = [e for e in events if e["type"] == "failure"]
    outcome.failures = [(str(e.get("kind")), str(e.get("message"))[:300]) for e in failures]
    starts = [e for e in events if e["type"] == "run_start"]
    outcome.restarts = max(0, len(starts) - 1)
    if fault_at is None:
        return
    if failures:
        outcome.detect_s = round(failures[0]["time"] - fault_at, 2)
    decisions = [e for e in events if e["type"] == "decision"]
    if decisions:
        outcome.decided_s = round(decisions[0]["time"] - fault_at, 2)
    after = False
    for e in events:
        replaced = e["type"] == "resize" or (
            e["type"] == "run_start" and (e.get("attempt") or 0) > 0
        )
        if replaced and e["time"] > fault_at:
            after = True
        elif after and e["type"] == "report":
            outcome.recover_s = round(e["time"] - fault_at, 2)
            break


def _split_brain(ray_bed: Any, workdir: Path, run: Path, name: str, host: Any) -> list[str]:
    """Writes that must not have happened: a cut-off worker's checkpoint try after the
    controller decided to replace it that was not refused, a published checkpoint that does
    not verify, a staging directory left behind."""
    bad = []
    decisions = [e["time"] for e in _events(run) if e["type"] == "decision"]
    if host is not None and decisions:
        for f in sorted(workdir.glob(f"{name}.pt.on_error.{host.name}.A0.*.json")):
            for t in json.loads(f.read_text())["tries"]:
                if t["started"] > min(decisions) and not t["outcome"].startswith("WorkerFenced"):
                    bad.append(f"{f.name}: a try at {t['started']:.1f}: {t['outcome']}")
    if run.exists():
        cmd = [sys.executable, "-c", _VERIFY, str(run)]
        done = ray_bed.run(ray_bed.bed.hosts[0], cmd, check=False)
        if done.returncode != 0:
            bad.append(f"a published checkpoint does not verify: {done.stderr[-500:]}")
        bad += [f"staging left: {p.name}" for p in run.glob("checkpoint_*.tmp")]
    return bad


def _orphans(bed: Any, wait_s: float = 90.0) -> list[str]:
    """ringtrain's processes still on any host ``wait_s`` after the run ended (the victim's
    link healed): a cut-off worker must exit by itself, not rejoin."""
    found: list[str] = []

    def none_left() -> bool:
        found[:] = [p for h in bed.hosts for p in worker_procs(bed, h)]
        return not found

    _wait(none_left, wait_s, interval_s=0.5)
    return found


def revive(ray_bed: Any, host: Any) -> None:
    """Start the victim's Ray node again for the next run: a lost host's node is gone, and a
    partitioned one is declared dead by Ray once the partition outlasts its health checks (a
    new node replaces it either way)."""
    ray_bed.restart_node(host)
    ray_bed.wait_for_nodes(len(ray_bed.bed.hosts))


__all__ = [
    "FAULTS",
    "STEPS",
    "TIMEOUT_S",
    "Outcome",
    "reference",
    "revive",
    "run_with_fault",
    "same_bits",
    "worker_procs",
]
