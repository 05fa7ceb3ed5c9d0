"""A partition at W=3 on three hosts: a worker's host has its link cut mid-run and left down.
Its processes keep running, cut off; the run must notice within the heartbeat timeout, call it
unreachable (not frozen, not killed), restart on the two hosts left (they have room), and end
bit-identical to an uninterrupted run. No split brain: the cut-off worker's own attempt to save
a checkpoint when its step fails (a common pattern in training loops) comes after the
controller declared it lost and must be refused; every published checkpoint verifies. When the
link heals, nothing of the old worker is left on that host."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from faults import worker_procs
from support import assert_bit_identical, read_events, wait_until
from test_ray_hosts import STEPS, reference

pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")

pytestmark = pytest.mark.xdist_group("ray")

TIMEOUT_S = 10.0  # FailureConfig.worker_timeout_s of the run

_DRIVER = """
import ringtrain as rt
import hosts_workload
result = rt.Trainer(
    hosts_workload.train_fn,
    rt.ScalingConfig(num_workers=3, backend="ray", placement_strategy="SPREAD"),
    rt.RunConfig(
        name="cut", storage_path={runs!r}, progress="off",
        failure_config=rt.FailureConfig(max_failures=2, worker_timeout_s={timeout}),
    ),
    train_loop_config={{"steps": {steps}, "out": {out!r}, "sleep": 0.2, "save_on_error": 40}},
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
    if name.startswith("checkpoint_"):
        read_manifest(fs, os.path.join(run, name), verify_checksums=True)
        print("verified", name)
"""


def test_a_cut_host_is_unreachable_and_the_run_ends_exact_without_split_brain(
    ray_bed, tmp_path, tmp_path_factory, lost_hosts
):
    bed = ray_bed.bed
    h1 = bed.hosts[0]
    runs, out = tmp_path / "runs", tmp_path / "cut.pt"
    script = _DRIVER.format(runs=str(runs), timeout=TIMEOUT_S, steps=STEPS, out=str(out))
    env = {"PYTHONPATH": str(Path(__file__).resolve().parent)}
    driver = ray_bed.popen(
        h1,
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(driver.stdout), daemon=True)
    reader.start()
    cut = None
    try:
        # Cut the host of a worker other than the driver's once a few checkpoints are out.
        assert wait_until(
            lambda: (runs / "cut" / "checkpoint_000005").exists() or driver.poll() is not None,
            timeout_s=400,
        )
        victim = next((h for h in ("h3", "h2") if worker_procs(bed, bed.host(h))), None)
        if victim is not None and driver.poll() is None:
            cut = bed.host(victim)
            lost_hosts.append(cut)
            bed.cut(cut)
        driver.wait(timeout=600)
        reader.join(timeout=10)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        output = "".join(lines)
    assert cut is not None, output[-3000:]
    assert driver.returncode == 0 and "STATUS FINISHED" in output, output[-4000:]
    assert_bit_identical(torch.load(out, weights_only=True), reference(tmp_path_factory))

    run = runs / "cut"
    failures = read_events(run, "failure")
    assert failures, output[-3000:]
    first = failures[0]
    assert first["kind"] == "unreachable", first
    assert "unreachable" in first["message"] and cut.address in first["message"], first
    assert not any("SIGKILL" in f["message"] for f in failures), failures

    # The cut-off worker kept trying to save once its step failed: every try after the
    # controller acted on its loss (the restart decision, written after the fence) is refused.
    decided = min(e["time"] for e in read_events(run, "decision"))
    records = lambda: sorted(tmp_path.glob(f"cut.pt.on_error.{cut.name}.A0.*.json"))

    def late_tries() -> list[dict]:
        return [
            t
            for f in records()
            for t in json.loads(f.read_text())["tries"]
            if t["started"] > decided
        ]

    assert wait_until(lambda: len(late_tries()) >= 2, timeout_s=120), output[-2000:]
    assert all(t["outcome"].startswith("WorkerFenced") for t in late_tries()), late_tries()
    verified = ray_bed.run(h1, [sys.executable, "-c", _VERIFY, str(run)], check=False)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert not list(run.glob("checkpoint_*.tmp")), list(run.iterdir())

    bed.heal(cut)
    assert wait_until(lambda: worker_procs(bed, cut) == [], timeout_s=90), worker_procs(bed, cut)
