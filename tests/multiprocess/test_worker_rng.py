"""Every worker starts from its own random state, as a freshly started process does (issue 40).

Workers forked from the warm pool's zygote used to share ``torch.initial_seed()`` and NumPy's
global stream (Python's ``random`` is reseeded by Python at every fork): unseeded data order,
augmentation, dropout masks and weight initialisation were the same on every rank, and a
Horovod script that forgets ``broadcast_parameters`` ended with identical weights under
``ringtrain run`` but not under torchrun. The reference is torchrun: the same probe at W=3 under
``python -m torch.distributed.run`` and under ringtrain (CLI and Python API, both forking from
the zygote), unseeded and seeded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from support import run_job

W = 3

# What each rank draws first from every global stream, unseeded (or seeded with --seed).
PROBE = textwrap.dedent(
    """
    import json, os, random, sys
    import numpy as np
    import torch

    out, seed = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None
    if seed is not None:
        torch.manual_seed(int(seed)); np.random.seed(int(seed)); random.seed(int(seed))
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().replace(b"\\0", b" ").decode()
    net = torch.nn.Linear(4, 4)  # a model nobody broadcast: torch's stream initialises it
    draws = {
        "torch_initial_seed": torch.initial_seed(),
        "torch": torch.rand(3).tolist(),
        "numpy": np.random.rand(3).tolist(),
        "random": [random.random() for _ in range(3)],
        "init": net.weight.sum().item(),
        "loader_base_seed": torch.empty((), dtype=torch.int64).random_().item(),
        "parent": parent,
    }
    with open(os.path.join(out, f"rank_{os.environ['RANK']}.json"), "w") as f:
        json.dump(draws, f)
    """
)
STREAMS = ("torch_initial_seed", "torch", "numpy", "random", "init", "loader_base_seed")


def probe_fn(config):
    """The probe as a train function (the Python API's workers)."""
    import runpy

    sys.argv = ["probe", config["out"], *config["seed"]]
    runpy.run_path(config["probe"], run_name="__main__")


def _read(out: Path) -> list[dict]:
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(W)]
    return ranks


def _distinct(ranks: list[dict]) -> dict[str, int]:
    """How many different values each stream drew over the ranks."""
    return {s: len({json.dumps(r[s]) for r in ranks}) for s in STREAMS}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}


def _torchrun(probe: Path, out: Path, *seed: str) -> list[dict]:
    out.mkdir()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(W),
         "--master-port", "0", str(probe), str(out), *seed],
        cwd=out.parent, env=_env(), check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    return _read(out)


def _ringtrain_run(probe: Path, out: Path, *seed: str) -> list[dict]:
    out.mkdir()
    ringtrain = Path(sys.executable).with_name("ringtrain")
    done = subprocess.run(
        [str(ringtrain), "run", "-n", str(W), "--storage-path", str(out.parent / "runs"),
         "--progress", "off", str(probe), str(out), *seed],
        cwd=out.parent, env=_env(), capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return _read(out)


@pytest.mark.timeout(600)
def test_unseeded_workers_draw_different_numbers_as_under_torchrun(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    everyone = {s: W for s in STREAMS}

    torchrun = _torchrun(probe, tmp_path / "torchrun")
    assert _distinct(torchrun) == everyone  # the reference: each process its own streams

    cli = _ringtrain_run(probe, tmp_path / "cli")
    assert all("ringtrain.launch.zygote" in r["parent"] for r in cli), cli[0]["parent"]
    assert _distinct(cli) == everyone, cli

    out = tmp_path / "api"
    out.mkdir()
    run_job(
        probe_fn,
        W,
        storage_path=tmp_path / "runs",
        name="api",
        train_loop_config={"out": str(out), "probe": str(probe), "seed": []},
    )
    api = _read(out)
    assert all("ringtrain.launch.zygote" in r["parent"] for r in api), api[0]["parent"]
    assert _distinct(api) == everyone, api


@pytest.mark.timeout(600)
def test_a_seeded_script_draws_the_same_numbers_on_every_rank_as_under_torchrun(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    torchrun = _torchrun(probe, tmp_path / "torchrun", "7")
    cli = _ringtrain_run(probe, tmp_path / "cli", "7")
    for ranks in (torchrun, cli):
        assert _distinct(ranks) == {s: 1 for s in STREAMS}
    strip = lambda r: {s: r[s] for s in STREAMS}
    assert strip(cli[0]) == strip(torchrun[0])  # the user's seed, nothing of ringtrain's
