"""``ringtrain bench`` end to end: one real run of the command on a tiny script at W = 1, 2 (its
analysis on synthetic measurements: tests/unit/test_bench.py)."""

from __future__ import annotations

import json
import math
import os
import textwrap
from typing import Any

import pytest

from ringtrain import cli

# --------------------------------------------------------------------------------------------
# End to end: the real command on a tiny script
# --------------------------------------------------------------------------------------------

TINY = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import ringtrain as rt

    if rt.get_context().world_rank == 0:
        with open(sys.argv[sys.argv.index("--argv-file") + 1], "w") as f:
            f.write(" ".join(sys.argv[1:]))
    torch.manual_seed(0)
    model = rt.prepare_model(
        nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(),
                      nn.Linear(1024, 10))
    )
    data = TensorDataset(torch.randn(4096, 256), torch.randint(0, 10, (4096,)))
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=64, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(10_000):  # ringtrain bench stops it after --steps steps
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    raise SystemExit("the step limit never came")
    """
)


@pytest.mark.timeout(120)
def test_bench_end_to_end(tmp_path: Any, capsys: Any) -> None:
    script = tmp_path / "tiny.py"
    script.write_text(TINY)
    out = tmp_path / "report"
    argv_file = tmp_path / "argv.txt"
    code = cli.main(
        [
            "bench",
            str(script),
            "--workers",
            "2,1",
            "--steps",
            "30",
            "--out",
            str(out),
            "--",
            "--argv-file",
            str(argv_file),
            "--flag",
        ]
    )
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert argv_file.read_text() == f"--argv-file {argv_file} --flag"

    data = json.loads((out / "scaling.json").read_text())
    assert data["workers"] == [1, 2] and data["steps"] == 30
    scaling = {p["workers"]: p for p in data["scaling"]}
    assert scaling[1]["speedup"] == 1.0 and scaling[1]["efficiency"] == 1.0
    assert scaling[2]["efficiency"] == pytest.approx(scaling[2]["speedup"] / 2, rel=1e-12)
    assert scaling[2]["speedup"] == pytest.approx(
        scaling[2]["throughput"] / scaling[1]["throughput"], rel=1e-12
    )
    for run in data["runs"]:
        assert run["throughput"] > 0
        # The documented warm-up, max(2, ceil(0.2 * 30)) = 6, however coarse the windows.
        assert (run["steps"], run["warmup_steps"]) == (24, 6), run
        assert sum(run["parts"].values()) == pytest.approx(run["step_s"], rel=1e-9)
        assert all(v >= 0 for v in run["parts"].values())
    by_w = {r["workers"]: r for r in data["runs"]}
    assert by_w[1]["comm_bytes"] == 0
    params = 256 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    assert by_w[2]["comm_bytes"] == pytest.approx(4 * params)  # fp32 gradients, every step
    fit = data["allreduce"]["fit"]
    assert fit["alpha_s"] >= 0 and fit["bandwidth_bytes_per_s"] > 0
    assert data["allreduce"]["workers"] == 2
    for sample in data["allreduce"]["samples"]:
        assert 0 < sample["p10_s"] <= sample["seconds"] <= sample["p90_s"]
    assert data["prediction"]["points"][-1]["workers"] == 64
    assert 0 < data["prediction"]["points"][-1]["efficiency"] <= 1
    assert 0 <= data["amdahl"]["p"] <= 1
    assert data["conclusions"] and "W = 2" in data["conclusions"][0]
    assert math.isfinite(data["amdahl"]["rmse"])

    page = (out / "scaling.html").read_text()
    assert page.count('src="data:image/png;base64,') == 5
    for name in ("throughput", "speedup", "efficiency", "step_split", "allreduce"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for run_dir in data["run_dirs"].values():
        with open(os.path.join(run_dir, "result.json")) as f:
            result = json.load(f)
        assert result["status"] == "FINISHED"
    flat = " ".join(printed.out.split())  # rich wraps at the terminal's width
    unwrapped = "".join(printed.out.split())  # a long path may wrap mid-word
    assert "samples/s" in flat and str(out / "scaling.html") in unwrapped, printed.out
    assert flat.count("(24 steps per rank measured after 6 warm-up)") == 2, printed.out
    assert ("p clamped to" in flat) == data["amdahl"]["clamped"], printed.out
