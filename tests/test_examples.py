"""The README's main job, run as a user runs it: real MNIST digits, 2 worker processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_mnist_main_job_reaches_95_percent_on_held_out_digits(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "mnist.py"), "--storage-path", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"held-out accuracy: (\d\.\d+)", proc.stdout)
    assert match, proc.stdout[-2000:]
    accuracy = float(match.group(1))
    assert accuracy >= 0.95
    result = json.loads((tmp_path / "mnist" / "result.json").read_text())
    assert result["status"] == "FINISHED"
    assert result["metrics"]["val_acc"] == accuracy
    assert set(result["metrics_per_rank"]) == {"0", "1"}
    kept = sorted(p.name for p in (tmp_path / "mnist").glob("checkpoint_*"))
    assert 1 <= len(kept) <= 3  # num_to_keep=2 best by val_acc, plus the latest
