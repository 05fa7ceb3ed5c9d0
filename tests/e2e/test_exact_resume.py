"""Bit-exact resume at every world size (issue 18), on real gloo worker processes.

A restarted worker builds a fresh ``DistributedDataParallel``. torch's DDP reduces its first step
with an initial bucket layout (one bucket, registration order) and rebuilds its buckets in
gradient-ready order after it; with 3 or more ranks an element's position in its bucket decides
the summation order of gloo's ring allreduce, so the first step after every resume differed from
the uninterrupted run at ULP level (2 ranks hide it: a + b == b + a). ringtrain's DDP
(:class:`ringtrain.comm.ddp.FixedOrderDDP`) fixes the layout at construction. Every test compares,
tensor by tensor with ``torch.equal``, every parameter and every optimizer tensor.
"""

from __future__ import annotations

import os
import random

import pytest

import exact_workloads as ew
import ringtrain as rt

SHARES_RUNS = True  # its tests share cached runs: one pytest worker runs them all (conftest)

EPOCHS = 3  # 10 steps per epoch at every world size; reports at 4, 8, 10, 12, 16, 20, 20, 24...


def _run(tmp_path, name, workers, *, max_failures=3, async_save=True, **config):
    job = {"max_failures": max_failures, "async_save": async_save}
    return ew.run_exact(tmp_path, name, workers, epochs=EPOCHS, job=job, **config)


_baselines: dict[tuple, dict] = {}


def _baseline(tmp_path_factory, workers, **config):
    key = (workers, tuple(sorted(config.items())))
    if key not in _baselines:
        result, final = _run(tmp_path_factory.mktemp("clean"), "clean", workers, **config)
        assert result.failures == []
        _baselines[key] = final
    return _baselines[key]


assert_bit_identical = ew.assert_final_states_equal


# ------------------------------------------------------------------ one step of a fresh DDP

VARIANTS = {
    "default": {},
    "300k_small_buckets": {"model": "300k", "bucket_cap_mb": 0.25},
    "300k_default_caps": {"model": "300k"},
    "static_graph": {"static_graph": True},
    "accumulate_2": {"accum": 2},
    "bf16_mixed": {"precision": "bf16-mixed"},
    "fp16_mixed_loss_scaling": {"precision": "16-mixed", "model": "300k", "bucket_cap_mb": 0.25},
    "bf16_hook": {"comm_hook": "bf16", "model": "300k", "bucket_cap_mb": 0.25},
    "fp16_hook": {"comm_hook": "fp16"},
    "powersgd": {
        "comm_hook": "powersgd",
        "comm_hook_options": {"start_powerSGD_iter": 2, "matrix_approximation_rank": 2},
    },
    # torch's own DDP: the canary that shows what the fixed layout fixes
    "torch_rebuild": {"bucket_order": "rebuild"},
    "torch_rebuild_300k": {"bucket_order": "rebuild", "model": "300k", "bucket_cap_mb": 0.25},
}


@pytest.mark.parametrize("workers", [3, 4, 8])
def test_a_fresh_ddp_reduces_its_first_step_like_a_long_lived_one(tmp_path, workers):
    result = rt.Trainer(
        ew.fresh_vs_long_lived_fn,
        rt.ScalingConfig(num_workers=workers),
        rt.RunConfig(name="fresh", storage_path=str(tmp_path), progress="off"),
        train_loop_config={"variants": list(VARIANTS.values())},
    ).fit()
    assert result.error is None, result.error
    for rank, metrics in result.metrics_per_rank.items():
        got = dict(zip(VARIANTS, metrics["results"], strict=True))
        for name, (equal, diff, _) in got.items():
            if name.startswith("torch_rebuild"):
                # torch's DDP: the first step of a fresh instance sums in another order
                assert not equal and 0 < diff < 1e-6, (rank, name, diff)
            else:
                assert equal, f"rank {rank}, {name}: max |diff| {diff:.3g} after a fresh DDP"
        assert got["default"][2] == 1 and got["powersgd"][2] == 1
        for name in ("300k_small_buckets", "300k_default_caps", "bf16_hook"):
            assert got[name][2] >= 2, (name, got[name])


# ------------------------------------------------------------------ kills through rt.Trainer

# Steps 1-30, 10 per epoch; report rounds 1-10 at steps 4, 8, 10, 12, 16, 20, 20, 24, 28, 30.
BEFORE_FIRST_CHECKPOINT = ["step", 3]
MID_EPOCH = ["step", 17]
EPOCH_BOUNDARY = ["epoch_start", 1]
DURING_WRITE = ["write", 5, 300]  # 300 bytes into a file of round 5 (step 16)

# (workers, async checkpoints, DataLoader workers, kills as [attempt, rank, *moment]). Each kill
# moment at W=3 and at W=4, rank 0 at every world size, async and sync checkpoints, DataLoader
# workers 0 and 2. One run chains the kills (an attempt resumes where its predecessor's last
# complete checkpoint was): a restart costs less than a run and a baseline.
MATRIX = {
    "w2": (2, False, 2, [[0, 1, *MID_EPOCH], [1, 0, "write", 7, 300]]),
    "w3": (
        3,
        False,
        0,
        [
            [0, 1, *BEFORE_FIRST_CHECKPOINT],
            [1, 2, *EPOCH_BOUNDARY],  # resumes at step 10 (the epoch's end)
            [2, 0, *DURING_WRITE],  # resumes at step 12
            [3, 1, *MID_EPOCH],  # resumes at step 16
        ],
    ),
    "w4": (
        4,
        True,
        2,
        [
            [0, 3, *BEFORE_FIRST_CHECKPOINT],
            [1, 2, *DURING_WRITE],
            [2, 0, *MID_EPOCH],
            [3, 1, "epoch_start", 2],
        ],
    ),
}


@pytest.mark.parametrize("case", list(MATRIX))
def test_sigkill_resumes_bit_exactly_at_every_world_size(tmp_path, tmp_path_factory, case):
    workers, async_save, loader_workers, kills = MATRIX[case]
    clean = _baseline(tmp_path_factory, workers)
    result, final = _run(
        tmp_path,
        case,
        workers,
        async_save=async_save,
        max_failures=len(kills),
        loader_workers=loader_workers,
        kills=kills,
    )
    assert [(f.attempt, f.rank, f.kind) for f in result.failures] == [
        (attempt, rank, "signal") for attempt, rank, *_ in kills
    ]
    assert_bit_identical(clean, final, f"(kills {kills})")


def _random_schedule(rng: random.Random, workers: int) -> list[list]:
    kills = []
    for attempt in range(rng.randint(1, 2)):
        kind = rng.choice(["step", "step", "epoch_start", "write"])
        if kind == "step":
            moment: list = ["step", rng.randint(1, 29)]
        elif kind == "epoch_start":
            moment = ["epoch_start", rng.randint(1, 2)]
        else:
            moment = ["write", rng.randint(1, 9), rng.choice([100, 300, 1000])]
        kills.append([attempt, rng.randrange(workers), *moment])
    return kills


def _campaign_seeds() -> list[int]:
    text = os.environ.get("RT_EXACT_SEEDS", "")
    return [int(s) for s in text.split(",") if s] or [18_1, 18_2]


@pytest.mark.parametrize("seed", _campaign_seeds())
def test_randomized_kill_campaign(tmp_path, tmp_path_factory, seed):
    """A seeded kill schedule (1 or 2 kills, any rank, any moment) at W=3 or 4; re-run a seed with
    ``RT_EXACT_SEEDS=seed``. A kill whose moment a resumed attempt never reaches does not fire."""
    rng = random.Random(seed)
    workers = rng.choice([3, 4])
    kills = _random_schedule(rng, workers)
    context = f"(seed {seed}: W={workers}, kills {kills}; rerun with RT_EXACT_SEEDS={seed})"
    clean = _baseline(tmp_path_factory, workers)
    result, final = _run(tmp_path, f"seed{seed}", workers, kills=kills)
    assert len(result.failures) <= len(kills), context
    assert_bit_identical(clean, final, context)


# ------------------------------------------------------------------ Horovod API and FSDP2


@pytest.mark.parametrize("strategy", ["hvd", "fsdp"])
def test_horovod_optimizer_and_fsdp_resume_bit_exactly_at_three_ranks(
    tmp_path, tmp_path_factory, strategy
):
    # Horovod: 4 KiB fusion buckets (several); FSDP2: one unit per Linear.
    config = {"strategy": strategy, "fusion_bytes": 4096} if strategy == "hvd" else {}
    config["strategy"] = strategy
    clean = _baseline(tmp_path_factory, 3, **config)
    kills = [[0, 1, *MID_EPOCH]]
    result, final = _run(tmp_path, strategy, 3, kills=kills, **config)
    assert [(f.attempt, f.rank) for f in result.failures] == [(0, 1)]
    assert_bit_identical(clean, final, f"({strategy}, kills {kills})")
