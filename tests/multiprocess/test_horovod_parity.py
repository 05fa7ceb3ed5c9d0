"""Horovod parity on Horovod's own terms (issue 45): the scenarios of Horovod 0.28.1's
test/parallel/test_torch.py where ringtrain.horovod used to differ, run in real gloo ranks at 2
and 3 ranks (tests/hvd_parity_workloads.py): operations matched by name, ``join()`` serving
allreduces with zeros, reducescatter's gradient and scalar error, ``DistributedOptimizer``'s
``_parameter_names``, a rank outside its process set, sparse gradients. Each scenario is one
test; a hang fails the job at its timeout instead of blocking the suite.

The whole module of Horovod's is run by ``benchmarks/horovod_test_module.py`` (docs/benchmarks.md,
"Horovod's own test module").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_parity_workloads import CHECKS

SHARES_RUNS = True  # its tests share cached runs: one pytest worker runs them all (conftest)

HERE = Path(__file__).resolve().parents[1]
_RESULTS: dict[int, list[dict]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(world_size: int) -> list[dict]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "hvd_parity_workloads.py")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=180)  # a hang is the failure, not slowness
            assert p.returncode == 0, err[-3000:]
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return sorted(outs, key=lambda o: o["rank"])


def _results(world_size: int) -> list[dict]:
    if world_size not in _RESULTS:
        _RESULTS[world_size] = _run(world_size)
    return _RESULTS[world_size]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("check", [c.__name__ for c in CHECKS])
def test_horovod_parity(check, world_size):
    ranks = _results(world_size)
    got = {o["rank"]: o["checks"].get(check, "not run") for o in ranks}
    after = {r: o["checks"].get(check + " (barrier after)") for r, o in enumerate(ranks)}
    assert all(v == "ok" for v in got.values()), got
    assert all(v is None for v in after.values()), after
