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


@pytest.mark.parametrize(
    ("config", "job", "names"),
    [
        (
            {"diloco": {"sync_every": 4, "fragments": 2}},  # the MLP has 3 layers
            {},
            r"DiLoCoConfig\.fragments=2 does not divide the model's 3 layers",
        ),
        (
            {"diloco": {"sync_every": 4}},
            {"parallel": rt.ParallelConfig(dp_replicate=1, dp_shard=2)},
            r"ParallelConfig\(dp_replicate=1\) makes one island",
        ),
        (
            {"diloco": {"sync_every": 4}, "model_kwargs": {"comm_hook": "bf16"}},
            {},
            r"comm_hook configure a gradient all-reduce at every step",
        ),
    ],
)
def test_bad_input_fails_the_run_before_any_step_naming_the_field(tmp_path, config, job, names):
    from support import run_job

    with pytest.raises(rt.TrainingFailedError, match=names):
        run_job(
            dw.diloco_fn,
            2,
            storage_path=tmp_path,
            train_loop_config={"epochs": 1, "out": str(tmp_path / "out"), **config},
            **job,
        )
    assert not list(tmp_path.glob("out_*.pt"))


def test_low_precision_outer_gradients_cost_fewer_bytes_and_stay_close(tmp_path):
    """H=4 on 2 replicas for 20 inner steps: bf16 and int8 outer gradients send 1/2 and about
    1/4 of fp32's bytes (ring all-reduce vs all-gather counts at R=2: 4n, 2n and n + 4 per
    tensor) and end within 1 % of the fp32 run's global parameters; streaming (3 fragments: one
    Linear each, 448, 2080 and 99 parameters) exchanges one fragment every 2 steps, its peak
    the largest fragment."""
    base = {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}
    runs = {}
    results = {}
    for name, extra in {
        "fp32": {},
        "bf16": {"outer_dtype": "bf16"},
        "int8": {"outer_dtype": "int8"},
        "streaming": {"sync_every": 6, "fragments": 3},
    }.items():
        result, states = dw.run_diloco(tmp_path, name, 2, epochs=EPOCHS, diloco={**base, **extra})
        runs[name], results[name] = states[0], result
        _assert_observed(result, states)
    # Result.outer_steps: steps // sync_every; streaming counts each fragment's exchange
    assert results["fp32"].outer_steps == 20 // 4
    assert results["streaming"].outer_steps == 10
    numel = sum(v.numel() for v in runs["fp32"]["model"].values())
    tensors = len(runs["fp32"]["model"])
    # + one element (4, 2 bytes) or one float32 (int8) per exchange: the replica's weight
    assert runs["fp32"]["stats"] == [5 * 4 * (numel + 1), 4 * (numel + 1), 5]  # 5 syncs
    assert runs["bf16"]["stats"] == [5 * 2 * (numel + 1), 2 * (numel + 1), 5]
    int8 = numel + 4 * tensors + 4
    assert runs["int8"]["stats"] == [5 * int8, int8, 5]
    # fragments 0, 1, 2 leave at steps 2, 4, 6 (mod 6): 0 four times in 20 steps, 1 and 2 three
    sizes = [4 * (448 + 1), 4 * (2080 + 1), 4 * (99 + 1)]
    assert runs["streaming"]["stats"] == [4 * sizes[0] + 3 * sizes[1] + 3 * sizes[2], sizes[1], 10]
    reference = torch.cat([g.reshape(-1) for g in runs["fp32"]["global"]])
    for name in ("bf16", "int8"):
        got = torch.cat([g.reshape(-1) for g in runs[name]["global"]])
        assert (got - reference).norm() / reference.norm() < 1e-2, name
        assert not torch.equal(got, reference), name


def _assert_observed(result: rt.Result, states: list[dict]) -> None:
    """The outer loop as the run directory shows it (issue 41, observability): every rank's
    timing windows carry the bytes its exchanges sent (per inner step: summed over the windows'
    steps they are exactly ``SyncStats.bytes_sent``), the seconds spent in outer syncs and
    the outer-step count, which is ``Result.outer_steps`` and the one in the final state."""
    from ringtrain.monitor.outer_loop import outer_by_rank
    from support import read_events

    windows = read_events(result.path, "timing")
    figures = outer_by_rank(windows)
    assert sorted(figures) == list(range(len(states)))
    for rank, state in enumerate(states):
        got = figures[rank]
        bytes_sent, _, exchanges = state["stats"]
        assert got.bytes_per_step > 0 and got.sync_s >= 0 and 0 <= got.sync_frac <= 1, got
        assert round(got.bytes_per_step * got.steps) == bytes_sent, (rank, got)
        assert got.exchanges == exchanges and got.outer_steps == state["counters"][1], got
    assert result.outer_steps == states[0]["counters"][1]
