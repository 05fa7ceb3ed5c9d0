"""``ringtrain run`` after a preemption notice: exit status 75 (EX_TEMPFAIL) with the resume
command, ``ringtrain ls`` shows the run as resumable, and ``ringtrain run --resume`` finishes it
from the step reached (issue 19)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from support import wait_until

RINGTRAIN = shutil.which("ringtrain") or os.path.join(os.path.dirname(sys.executable), "ringtrain")

pytestmark = pytest.mark.timeout(240)

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    import ringtrain as rt

    marker = sys.argv[1]
    model = rt.prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rt.TrainState(model=model, optimizer=opt)
    state.restore()
    start = state.step
    while state.step < 200:
        loss = model(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        if state.step == 3 and rt.get_context().world_rank == 0 and not os.path.exists(marker):
            open(marker, "w").close()  # the test now sends SIGTERM to the driver
            while not os.path.exists(marker + ".sent"):
                time.sleep(0.05)
        if start == 0 and os.path.exists(marker + ".sent"):
            time.sleep(0.1)  # the notice reaches every rank within a few steps, not at 200
        if state.step % 5 == 0:
            rt.report({"step": state.step, "start": start}, checkpoint=state)
    rt.report({"step": state.step, "start": start}, checkpoint=state)
    """
)


def _ringtrain(*args, cwd):
    return subprocess.run([RINGTRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=200)


def test_run_exits_75_when_preempted_and_resume_finishes(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    marker = str(tmp_path / "noticed")
    # The driver (`ringtrain run`) gets SIGTERM, a scheduler's notice, once rank 0 reached step 3.
    proc = subprocess.Popen(
        [RINGTRAIN, "run", "-n", "2", "--name", "spot", "--progress", "off", str(script), marker],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(lambda: os.path.exists(marker) or proc.poll() is not None, timeout_s=150)
        proc.send_signal(signal.SIGTERM)
        open(marker + ".sent", "w").close()
        _, stderr = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr)
    assert first.returncode == 75, first.stderr
    assert "run preempted" in first.stderr and "ringtrain run --resume" in first.stderr
    run_dir = tmp_path / "runs" / "spot"
    saved = json.loads((run_dir / "result.json").read_text())
    assert (saved["status"], saved["preemptions"]) == ("PREEMPTED", 1)
    stop_step = saved["metrics"]["preempted_step"]
    assert 3 < stop_step < 200  # saved at the step reached, not the last periodic checkpoint
    ls = _ringtrain("ls", "runs", cwd=tmp_path)
    assert "PREEMPTED (resumable)" in ls.stdout, ls.stdout
    second = _ringtrain("run", "--resume", str(run_dir), "--progress", "off", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    final = json.loads((run_dir / "result.json").read_text())
    assert final["status"] == "FINISHED"
    assert final["metrics"] == {"step": 200, "start": stop_step}
