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
from pathlib import Path

import pytest

from hvd_parity_workloads import CHECKS
from support import run_torchrun_style

SHARES_RUNS = True  # its tests share cached runs: one pytest worker runs them all (conftest)

HERE = Path(__file__).resolve().parents[1]
_RESULTS: dict[int, list[dict]] = {}


def _run(world_size: int) -> list[dict]:
    script = str(HERE / "hvd_parity_workloads.py")
    outs = run_torchrun_style([script], world_size, timeout_s=180, pythonpath=[str(HERE)])
    ranks = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    return sorted(ranks, key=lambda o: o["rank"])


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
