"""DiLoCo on real gloo processes (issue 41): the method against data parallelism.

With ``sync_every=1``, outer SGD at learning rate 1 and no momentum, DiLoCo is data parallelism:
the new global parameters are the mean of the replicas' parameters after one inner step each,
``g - mean_i(g - (g - lr * u_i)) = g - lr * mean_i(u_i)``, and with momentum SGD as the inner
optimizer ``u_i`` is linear in the gradients, so the mean of the replicas' momentum updates is
DDP's. It is not bit-exact: DiLoCo averages parameter *differences* ``g - local`` (each rounded
to float32) where DDP averages gradients, so the two runs round differently; the difference stays
at float32 resolution of the parameters (~1e-7 here after 20 steps; asserted below 1e-6), while
a real DiLoCo run (H=2) differs from DDP by ~1e-2.
"""

from __future__ import annotations

import pytest
import torch

import diloco_workloads as dw
import ringtrain as rt

pytestmark = pytest.mark.timeout(900)

EPOCHS = 2  # 20 inner steps
H1 = {"sync_every": 1, "outer_lr": 1.0, "outer_momentum": 0.0}


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"])


@pytest.fixture(scope="module")
def ddp3(tmp_path_factory):
    return dw.run_diloco(tmp_path_factory.mktemp("ddp3"), "ddp", 3, epochs=EPOCHS, strategy="ddp")[
        1
    ]


def test_sync_every_1_with_outer_sgd_lr_1_is_data_parallelism(tmp_path, ddp3):
    _, states = dw.run_diloco(tmp_path, "h1", 3, epochs=EPOCHS, diloco=H1)
    for rank, (ddp, diloco) in enumerate(zip(ddp3, states, strict=True)):
        assert _max_diff(ddp, diloco) < 1e-6, rank
        assert diloco["counters"] == [20, 20]  # one outer step per inner step
        # After each outer step the local parameters are the global ones, on every replica.
        local = list(diloco["model"].values())
        assert all(torch.equal(g, p) for g, p in zip(diloco["global"], local, strict=True))
    # The check can fail: two inner steps per outer step are not data parallelism.
    _, h2 = dw.run_diloco(tmp_path, "h2", 3, epochs=EPOCHS, diloco={**H1, "sync_every": 2})
    assert _max_diff(ddp3[0], h2[0]) > 1e-3


def test_islands_ddp_inside_diloco_across_is_data_parallelism_at_h1(tmp_path, tmp_path_factory):
    """ParallelConfig(dp_replicate=2, dp_shard=2): DDP inside each island of 2 ranks, DiLoCo
    across the 2 islands; at H=1 it is DDP over the 4 ranks."""
    _, ddp4 = dw.run_diloco(tmp_path_factory.mktemp("ddp4"), "ddp", 4, epochs=1, strategy="ddp")
    job = {"parallel": rt.ParallelConfig(dp_replicate=2, dp_shard=2)}
    _, states = dw.run_diloco(tmp_path, "islands", 4, epochs=1, job=job, diloco=H1)
    for rank in range(4):
        assert _max_diff(ddp4[rank], states[rank]) < 1e-6, rank


def test_diloco_replicas_share_global_parameters_and_train_apart(tmp_path):
    """H=4 with AdamW inside and Nesterov outside, 20 inner steps on 3 replicas: the global
    parameters and the outer momentum are bit-identical on every replica (nothing but the
    exchange keeps them so), after the last sync (step 20) every replica's local parameters are
    the global ones, and the inner AdamW moments are each replica's own."""
    config = {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}
    _, states = dw.run_diloco(tmp_path, "h4", 3, epochs=EPOCHS, diloco=config, inner="adamw")
    first = states[0]
    assert first["counters"] == [20, 5]
    for state in states:
        local = list(state["model"].values())
        assert all(torch.equal(g, p) for g, p in zip(state["global"], local, strict=True))
    for state in states[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first["global"], state["global"], strict=True))
        for i, s in first["outer"].items():
            assert torch.equal(s["momentum_buffer"], state["outer"][i]["momentum_buffer"])
        # inner AdamW moments are each replica's own
        assert not torch.equal(first["optimizer"][0]["exp_avg"], state["optimizer"][0]["exp_avg"])
