"""A Ctrl-C during the driver's first import of torch ends the run (it used to be lost).

``import torch`` initialises NumPy from C and goes on without it whatever the error, so a
``KeyboardInterrupt`` raised inside that NumPy import was swallowed: a driver that first imports
torch when it starts its workers (``ringtrain run``; a script that does not import torch itself)
ignored the Ctrl-C and trained to the end (FINISHED). A meta-path hook in the driver sends the
SIGINT at exactly that moment: the run must end ABORTED, before any worker started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ctrl_c import AS_AT_A_TERMINAL, ctrl_c_driver

pytestmark = pytest.mark.timeout(300)

_DRIVER = AS_AT_A_TERMINAL + textwrap.dedent(
    """
    import os, signal, sys

    class CtrlCOnNumpy:  # the SIGINT arrives as torch's C start-up imports NumPy
        def find_spec(self, name, path=None, target=None):
            if name == "numpy":
                sys.meta_path.remove(self)
                with open(sys.argv[2], "w") as f:
                    f.write("torch" if "torch" in sys.modules else "not torch")
                os.kill(os.getpid(), signal.SIGINT)
            return None

    sys.meta_path.insert(0, CtrlCOnNumpy())
    import ringtrain as rt
    rt.Trainer(print, rt.ScalingConfig(num_workers=2, warm_start=False),
               rt.RunConfig(name="c", storage_path=sys.argv[1], progress="plain"),
               train_loop_config={"trained": True}).fit()
    """
)


def test_a_ctrl_c_during_the_drivers_torch_import_ends_the_run(tmp_path):
    marker = tmp_path / "ctrl-c-sent"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    driver = subprocess.run(
        ctrl_c_driver(_DRIVER, str(tmp_path), str(marker)),
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = driver.stdout + driver.stderr
    assert marker.read_text() == "torch", f"NumPy was first imported elsewhere: {out[-3000:]}"
    assert driver.returncode != 0 and "KeyboardInterrupt" in driver.stderr, out[-3000:]
    assert "'trained': True" not in out, f"the Ctrl-C was lost: the workers ran\n{out[-3000:]}"
    saved = json.loads((tmp_path / "c" / "result.json").read_text())
    assert saved["status"] == "ABORTED", out[-3000:]


_TRAINING = AS_AT_A_TERMINAL + textwrap.dedent(
    """
    import sys, time
    import ringtrain as rt

    def train_fn(config):
        for i in range(10_000):
            time.sleep(0.05)
            rt.report({"i": i})
            if i == 3 and rt.get_context().world_rank == 0:
                open(config["marker"], "w").close()

    rt.Trainer(train_fn, rt.ScalingConfig(num_workers=2),
               rt.RunConfig(name="cc", storage_path=sys.argv[1], progress="off"),
               train_loop_config={"marker": sys.argv[2]}).fit()
    """
)


def test_a_ctrl_c_through_the_python_api_ends_in_a_few_lines_and_ls_says_interrupted(tmp_path):
    """Ctrl-C of a script that calls ``rt.Trainer(...).fit()`` (issue 40): the traceback is the
    user's line, ``fit`` and one ``KeyboardInterrupt`` line naming how to continue (it was 30
    lines through the controller and ``queue.get``), and ``ringtrain ls`` says the run was
    interrupted (it said "driver gone")."""
    import signal
    import time

    marker = tmp_path / "training"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("RINGTRAIN_DEBUG", None)
    driver = subprocess.Popen(
        ctrl_c_driver(_TRAINING, str(tmp_path), str(marker)),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not marker.exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    driver.send_signal(signal.SIGINT)
    _, err = driver.communicate(timeout=120)
    assert driver.returncode != 0, err
    lines = err.strip().splitlines()
    assert len(lines) <= 8, err
    last = lines[-1]
    assert last.startswith("KeyboardInterrupt: run 'cc' stopped: interrupted by Ctrl-C"), err
    assert f"rt.Trainer.restore({str(tmp_path / 'cc')!r}).fit()" in last, err
    saved = json.loads((tmp_path / "cc" / "result.json").read_text())
    assert saved["status"] == "ABORTED"
    listed = subprocess.run(
        [sys.executable, "-m", "ringtrain.cli", "ls", str(tmp_path)],
        env={**env, "COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "interrupted by Ctrl-C" in listed.stdout and "driver gone" not in listed.stdout, (
        listed.stdout
    )
