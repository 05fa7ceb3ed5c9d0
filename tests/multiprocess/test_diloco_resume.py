"""DiLoCo resumes bit-exactly (issue 41): SIGKILLed workers, at W=2, 3 and 4, end with exactly
the state of an uninterrupted run on **every** rank: local parameters, inner AdamW moments,
global parameters, outer Nesterov momentum, step counters.

Kill moments: after an inner step (mid-period, where replicas' local parameters differ), before
an epoch's first batch, half-way through a checkpoint file, and **mid-exchange** (``["exchange",
n]``: right after the rank launched its n-th outer all-reduce or all-gather, its peers inside the
collective). Streaming DiLoCo (3 fragments, ``sync_delay=1``) is checkpointed with an exchange in
flight: the test asserts that some resumed attempt started from such a checkpoint (the outer
gradient is re-sent after the resume and gives the same average).
"""

from __future__ import annotations

import os
import random

import pytest

import diloco_workloads as dw
import ringtrain as rt

pytestmark = pytest.mark.timeout(900)
SHARES_RUNS = True  # cached baselines: one pytest worker runs the module (conftest)

EPOCHS = 3  # 30 inner steps at every world size; reports every 4 steps and at epoch ends
PLAIN = {"sync_every": 4, "outer_lr": 0.7, "outer_momentum": 0.9}
STREAMING_INT8 = {"sync_every": 6, "fragments": 3, "sync_delay": 1, "outer_dtype": "int8"}
STREAMING_BF16 = {**STREAMING_INT8, "outer_dtype": "bf16"}
ISLANDS = {"parallel": rt.ParallelConfig(dp_replicate=2, dp_shard=2)}

_baselines: dict[tuple, list[dict]] = {}


def _run(tmp_path, name, workers, diloco, job=None, **config):
    return dw.run_diloco(
        tmp_path, name, workers, epochs=EPOCHS, job=job, diloco=diloco, inner="adamw", **config
    )


def _baseline(tmp_path_factory, workers, diloco, islands=False):
    key = (workers, tuple(sorted(diloco.items())), islands)
    if key not in _baselines:
        job = dict(ISLANDS) if islands else None
        result, states = _run(tmp_path_factory.mktemp("clean"), "clean", workers, diloco, job)
        assert result.failures == []
        _baselines[key] = states
    return _baselines[key]


# (workers, DiLoCo config, islands, async checkpoints, kills as [attempt, rank, *moment])
MATRIX = {
    "w2_plain": (2, PLAIN, False, False, [[0, 1, "step", 5], [1, 0, "exchange", 2]]),
    "w3_plain": (
        3,
        PLAIN,
        False,
        True,
        [[0, 1, "step", 7], [1, 2, "exchange", 2], [2, 0, "write", 5, 300]],
    ),
    "w4_streaming_int8": (
        4,
        STREAMING_INT8,
        False,
        True,
        [[0, 1, "step", 7], [1, 3, "exchange", 3], [2, 0, "epoch_start", 2]],
    ),
    "w4_islands": (4, PLAIN, True, True, [[0, 3, "step", 6], [1, 0, "exchange", 1]]),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_sigkill_resumes_bit_exactly(tmp_path, tmp_path_factory, case):
    workers, diloco, islands, async_save, kills = MATRIX[case]
    clean = _baseline(tmp_path_factory, workers, diloco, islands)
    job = {"max_failures": len(kills), "async_save": async_save, **(ISLANDS if islands else {})}
    result, got = _run(tmp_path, case, workers, diloco, job, kills=kills)
    assert [(f.attempt, f.rank, f.kind) for f in result.failures] == [
        (attempt, rank, "signal") for attempt, rank, *_ in kills
    ]
    dw.assert_states_equal(clean, got, f"({case}, kills {kills})")
    assert result.outer_steps == clean[0]["counters"][1]  # restored counts included
    if diloco.get("sync_delay"):
        resumed = [r for rank in range(workers) for r in dw.resumes(tmp_path / case, rank)]
        assert any(in_flight for _, _, in_flight in resumed), resumed


def _random_schedule(rng: random.Random, workers: int) -> list[list]:
    kills = []
    for attempt in range(rng.randint(1, 2)):
        kind = rng.choice(["step", "step", "exchange", "epoch_start", "write"])
        if kind == "step":
            moment: list = ["step", rng.randint(1, 29)]
        elif kind == "exchange":
            moment = ["exchange", rng.randint(1, 6)]
        elif kind == "epoch_start":
            moment = ["epoch_start", rng.randint(1, 2)]
        else:
            moment = ["write", rng.randint(1, 9), rng.choice([100, 300, 1000])]
        kills.append([attempt, rng.randrange(workers), *moment])
    return kills


def _campaign_seeds() -> list[int]:
    text = os.environ.get("RT_DILOCO_SEEDS", "")
    return [int(s) for s in text.split(",") if s] or [41_1]  # more: RT_DILOCO_SEEDS=1,2,3


@pytest.mark.parametrize("seed", _campaign_seeds())
def test_randomized_kill_campaign(tmp_path, tmp_path_factory, seed):
    """A seeded schedule (1 or 2 kills, any rank, any moment) at W=2, 3 or 4, plain or streaming
    DiLoCo; re-run a seed with ``RT_DILOCO_SEEDS=seed``. A kill whose moment a resumed attempt
    never reaches does not fire."""
    rng = random.Random(seed)
    workers = rng.choice([2, 3, 4])
    diloco = rng.choice([PLAIN, STREAMING_INT8, STREAMING_BF16])
    kills = _random_schedule(rng, workers)
    context = f"(seed {seed}: W={workers}, {diloco}, kills {kills}; RT_DILOCO_SEEDS={seed})"
    print(context)
    clean = _baseline(tmp_path_factory, workers, diloco)
    result, got = _run(tmp_path, f"seed{seed}", workers, diloco, {"max_failures": 2}, kills=kills)
    assert len(result.failures) <= len(kills), context
    dw.assert_states_equal(clean, got, context)


@pytest.mark.parametrize(("workers", "diloco"), [(2, PLAIN), (3, STREAMING_INT8)])
def test_a_preemption_notice_stops_at_an_agreed_sync_step_and_resumes_exactly(
    tmp_path, tmp_path_factory, workers, diloco
):
    """SIGTERM to the driver after step 5: the ranks agree on the stop step only at sync steps
    (``DiLoCoConfig.preempt_at_sync``: no collective of every rank between syncs), so they stop
    at one (a step where a fragment leaves; with ``sync_delay=1`` its exchange is still in
    flight), save, and the resumed run ends bit-identical to an uninterrupted one."""
    from support import read_events, run_job

    clean = _baseline(tmp_path_factory, workers, diloco)
    config = {
        "epochs": EPOCHS,
        "out": str(tmp_path / "run"),
        "diloco": diloco,
        "inner": "adamw",
        "how": "driver-SIGTERM",
        "notice_step": 5,
        "marker": str(tmp_path / "marker"),
        "driver_pid": os.getpid(),
    }
    first = run_job(
        dw.diloco_fn, workers, storage_path=tmp_path / "runs", name="run", train_loop_config=config
    )
    assert (first.status, first.failures) == ("PREEMPTED", [])
    (saved,) = read_events(first.path, "preemption_saved")
    offsets = {rt.DiLoCoConfig(**diloco).offset(f) for f in range(diloco.get("fragments", 1))}
    assert saved["step"] > 5 and saved["step"] % diloco["sync_every"] in offsets, saved
    resumed, got = dw.run_diloco(
        tmp_path, "run", workers, epochs=EPOCHS, diloco=diloco, inner="adamw"
    )
    dw.assert_states_equal(clean, got, f"(preempted at step {saved['step']})")
    # The resumed run reports the run's outer steps, those before the preemption included.
    assert resumed.outer_steps == clean[0]["counters"][1], saved
