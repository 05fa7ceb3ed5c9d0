"""The "same math" policies of elastic training (issue 8, requirement 3): ``elastic_batch_policy``.

Pure policy math first (micro-batch and accumulation choice, LR factor, indivisible global
batches, bad config values), then real elastic runs over gloo where workers SIGKILL themselves:
under ``"accumulate"`` the parameters after the resize equal, bit for bit, those of a run at the
new size resumed from the same checkpoint with the same micro-batches; under ``"scale_lr"`` the
learning rate each optimizer step uses follows ``W / max`` over two resizes (3 -> 2 -> 1 workers)
without compounding, while param groups, snapshots and checkpoints keep the unscaled one.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from torch.utils.data import DataLoader

import ringtrain as rt
from ringtrain.elastic import batch as eb
from support import run_job
from workloads import IndexedDataset, _kill_self

# ------------------------------------------------------------------ the workload


def batch_policy_fn(config):
    """Regression with a TrainState whose step is one optimizer step over
    ``loader.micro_batches(batch, model, max_size=config.get("max_size"))``. Per step, every rank
    appends ``{world, rank, step, ids, micro, lr_step, lr_group}`` to ``{log}/{pid}.jsonl``
    (``micro``: the micro-batch sizes; ``lr_step``: the lr seen inside ``optimizer.step()``;
    ``lr_group``: the lr in the param group outside it). ``kills``: ``[world, rank, step]``
    triples: that rank SIGKILLs itself after that step (and its report) at that world size
    (first attempt). A report with a checkpoint at the steps in ``report_steps``; rank 0 saves
    the final
    parameters and optimizer state to ``out``."""
    ctx = rt.get_context()
    torch.manual_seed(0)
    model = rt.prepare_model(torch.nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=config.get("momentum", 0.9))
    in_step: list[float] = []
    optimizer.register_step_pre_hook(lambda opt, a, k: in_step.append(opt.param_groups[0]["lr"]))
    loader = rt.prepare_data_loader(
        DataLoader(IndexedDataset(config["n"]), batch_size=config["batch_size"], shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    log = os.path.join(config["log"], f"{os.getpid()}.jsonl")
    for _epoch in state.epochs(config.get("epochs", 1)):
        for batch in loader:
            optimizer.zero_grad()
            micro = []
            for (x, y, ids), weight in loader.micro_batches(batch, model, config.get("max_size")):
                micro.append(len(ids))
                (torch.nn.functional.mse_loss(model(x), y) * weight).backward()
            optimizer.step()
            state.step += 1
            world, rank = rt.get_context().world_size, rt.get_context().world_rank
            record = {
                "world": world,
                "rank": rank,
                "step": state.step,
                "ids": batch[2].tolist(),
                "micro": micro,
                "lr_step": in_step[-1],
                "lr_group": optimizer.param_groups[0]["lr"],
                "bias": float(next(model.parameters()).detach().sum()),
            }
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            if state.step in config.get("report_steps", ()):
                rt.report({"step": state.step}, checkpoint=state)
            if ctx.attempt == 0 and [world, rank, state.step] in config.get("kills", []):
                _kill_self()
    if rt.get_context().world_rank == 0:
        module = model.module if hasattr(model, "module") else model
        torch.save(
            {"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": state.step},
            config["out"],
        )


def _fit(tmp_path, name, workers, scaling, config, restore_from=None):
    """``scaling``: ScalingConfig fields besides num_workers (``workers``)."""
    log = tmp_path / f"{name}_log"
    log.mkdir()
    cfg = {"log": str(log), "out": str(tmp_path / f"{name}.pt"), **config}
    result = run_job(
        batch_policy_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=name,
        restore_from=restore_from,
        max_failures=3,
        async_save=False,  # written before a kill
        train_loop_config=cfg,
        **scaling,
    )
    records = [json.loads(line) for f in sorted(log.glob("*.jsonl")) for line in f.open()]
    return result, records, torch.load(cfg["out"], weights_only=True)


def _resizes(result):
    with open(f"{result.path}/events.jsonl") as f:
        events = [json.loads(line) for line in f]
    return [(e["old_world_size"], e["new_world_size"]) for e in events if e["type"] == "resize"]


# ------------------------------------------------------------------ end to end


def test_accumulate_matches_a_run_at_the_new_size_with_the_same_micro_batches(tmp_path):
    # Global batch 12: 3 workers x 4, then 2 workers x 6 = 2 micro-batches of 3 (<= 4).
    # 72 samples: 6 steps per epoch, 12 in all; rank 1 dies after step 3.
    config = {"n": 72, "batch_size": 4, "epochs": 2, "kills": [[3, 1, 3]], "report_steps": [3]}
    scaling = {"elastic_batch_policy": "accumulate"}
    result, records, elastic = _fit(tmp_path, "acc", (2, 3), scaling, config)
    assert result.error is None and _resizes(result) == [(3, 2)]
    assert {tuple(r["micro"]) for r in records if r["world"] == 3} == {(4,)}
    after = [r for r in records if r["world"] == 2]
    assert sorted({r["step"] for r in after}) == list(range(4, 13))
    assert {tuple(r["micro"]) for r in after} == {(3, 3)}  # never more than batch_size=4
    assert {len(r["ids"]) for r in after} == {6}  # the global batch is kept
    # The reference: the run's own disk checkpoint of step 3 (its only one), resumed by 2
    # non-elastic workers with 6 samples each, cut into micro-batches of at most 4.
    ref_config = {**config, "batch_size": 6, "max_size": 4, "kills": [], "report_steps": []}
    _, ref_records, reference = _fit(tmp_path, "ref", 2, {}, ref_config, restore_from=result.path)
    assert sorted({r["step"] for r in ref_records}) == list(range(4, 13))
    assert {tuple(r["micro"]) for r in ref_records} == {(3, 3)}
    assert reference["step"] == elastic["step"] == 12
    for key, value in reference["model"].items():
        assert torch.equal(value, elastic["model"][key]), f"{key} differs"


def test_scale_lr_follows_the_world_size_without_compounding(tmp_path):
    # Per-worker batch 2 at every size; 36 samples: 2 steps at 3 workers (12 samples), 3 at 2
    # (12), 6 at 1 (12); positions stay whole global batches, so no sample is seen twice.
    config = {
        "n": 36,
        "batch_size": 2,
        "momentum": 0.0,
        "kills": [[3, 1, 2], [2, 1, 5]],
        "report_steps": [11],
    }
    scaling = {"elastic_batch_policy": "scale_lr"}
    result, records, final = _fit(tmp_path, "lr", (1, 3), scaling, config)
    assert result.error is None and _resizes(result) == [(3, 2), (2, 1)]
    expected = {3: 0.05, 2: 0.05 * 2 / 3, 1: 0.05 / 3}
    for r in records:
        assert r["lr_step"] == pytest.approx(expected[r["world"]], rel=1e-12), r
        assert r["lr_group"] == 0.05, r  # restored exactly after each step
        assert len(r["ids"]) == 2  # the per-worker batch is kept
    assert sorted({r["step"] for r in records if r["world"] == 1}) == list(range(6, 12))
    kept = {(3, 1), (3, 2), (2, 3), (2, 4), (2, 5)}
    seen = sorted(
        i for r in records if (r["world"], r["step"]) in kept or r["world"] == 1 for i in r["ids"]
    )
    assert seen == list(range(36))  # every sample once across both resizes
    # What the snapshots and the disk checkpoint hold is the unscaled learning rate.
    assert final["optimizer"]["param_groups"][0]["lr"] == 0.05
    ckpt = torch.load(os.path.join(result.checkpoint.path, "train_state.pt"), weights_only=True)
    assert ckpt["objects"]["optimizer"]["param_groups"][0]["lr"] == 0.05


# ------------------------------------------------------------------ policy math


@pytest.mark.parametrize(
    ("policy", "batch", "world", "lo", "hi", "per_worker", "steps", "micro", "lr"),
    [
        ("resize_batch", 4, 3, 2, 3, 4, 1, 4, 1.0),  # at max: nothing changes
        ("resize_batch", 4, 2, 2, 3, 6, 1, 6, 1.0),
        ("accumulate", 4, 2, 2, 4, 8, 2, 4, 1.0),  # global 16 at (2, 4): 2 x 4 at 2 workers
        ("accumulate", 4, 2, 2, 3, 6, 2, 3, 1.0),
        ("accumulate", 3, 1, 1, 4, 12, 4, 3, 1.0),
        ("accumulate", 5, 4, 2, 4, 5, 1, 5, 1.0),
        ("accumulate", 5, 2, 2, 4, 10, 2, 5, 1.0),
        ("accumulate", 2, 3, 3, 6, 4, 2, 2, 1.0),
        ("accumulate", 4, 4, 2, 5, 5, 2, 3, 1.0),  # 5 per worker: micro-batches of 3 and 2
        ("scale_lr", 5, 3, 2, 4, 5, 1, 5, 0.75),
        ("scale_lr", 5, 2, 2, 4, 5, 1, 5, 0.5),
    ],
)
def test_plan_batch(policy, batch, world, lo, hi, per_worker, steps, micro, lr):
    plan = eb.plan_batch(policy, batch, world, lo, hi)
    assert (plan.per_worker_batch, plan.accumulation_steps, plan.micro_batch_size) == (
        per_worker,
        steps,
        micro,
    )
    assert plan.lr_scale == lr
    assert plan.micro_batch_size <= batch or policy == "resize_batch"
    if policy != "scale_lr":
        assert plan.global_batch == batch * hi  # the global batch is kept


@pytest.mark.parametrize("policy", ["resize_batch", "accumulate"])
def test_an_indivisible_global_batch_names_the_sizes_that_work_and_scale_lr(policy):
    with pytest.raises(ValueError) as info:
        eb.plan_batch(policy, 5, 2, 2, 3)  # global 15 over 2 workers
    message = str(info.value)
    assert "global batch 15" in message and "does not divide by 2" in message
    assert "a multiple of 2 (2, 4, 6, ...)" in message
    assert "elastic_batch_policy='scale_lr'" in message
    plan = eb.plan_batch("scale_lr", 5, 2, 2, 3)  # keeps the per-worker batch: always fits
    assert plan.per_worker_batch == 5 and plan.lr_scale == pytest.approx(2 / 3)


@pytest.mark.parametrize(("lo", "hi"), [(1, 1), (2, 3), (2, 4), (3, 4), (2, 6), (5, 8)])
def test_compatible_batch_sizes_are_the_smallest_that_every_world_size_divides(lo, hi):
    sizes = eb.compatible_batch_sizes(lo, hi)
    fits = [b for b in range(1, sizes[-1] + 1) if all(b * hi % w == 0 for w in range(lo, hi + 1))]
    assert sizes == fits[:3]


def test_plan_batch_rejects_bad_values():
    with pytest.raises(ValueError, match="must be one of"):
        eb.plan_batch("linear", 4, 2, 2, 4)
    with pytest.raises(ValueError, match="world_size <= max_workers"):
        eb.plan_batch("accumulate", 4, 5, 2, 4)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        eb.plan_batch("accumulate", 0, 2, 2, 4)


def test_scaling_config_validates_the_policy():
    assert rt.ScalingConfig(num_workers=(2, 4)).elastic_batch_policy == "resize_batch"
    cfg = rt.ScalingConfig(num_workers=(2, 4), elastic_batch_policy="accumulate")
    assert rt.ScalingConfig(**cfg.to_dict()) == cfg  # config.json round trip
    with pytest.raises(ValueError) as info:
        rt.ScalingConfig(num_workers=(2, 4), elastic_batch_policy="linear")
    assert "ScalingConfig.elastic_batch_policy must be one of" in str(info.value)
    assert "'scale_lr'" in str(info.value)
    with pytest.raises(ValueError) as info:
        rt.ScalingConfig(num_workers=4, elastic_batch_policy="scale_lr")
    assert "elastic runs only" in str(info.value) and "num_workers=(min, max)" in str(info.value)


# ------------------------------------------------------------------ micro-batches


def test_split_batch_cuts_along_dim_0_with_weights():
    x = torch.arange(20.0).reshape(10, 2)
    batch = {"x": x, "ids": torch.arange(10), "names": list("abcdefghij"), "scale": 3}
    parts = eb.split_batch(batch, 4)  # 10 samples, at most 4: 4 + 3 + 3
    assert [len(p["ids"]) for p, _ in parts] == [4, 3, 3]
    assert [w for _, w in parts] == [0.4, 0.3, 0.3]
    assert torch.equal(torch.cat([p["x"] for p, _ in parts]), x)
    assert [n for p, _ in parts for n in p["names"]] == list("abcdefghij")
    assert {p["scale"] for p, _ in parts} == {3}
    assert eb.split_batch(batch, 10) == [(batch, 1.0)]
    assert eb.split_batch(7, 2) == [(7, 1.0)]  # nothing with a batch dimension
    with pytest.raises(ValueError, match="max_size must be an integer >= 1"):
        eb.split_batch(batch, 0)


def test_weighted_micro_batches_give_the_gradient_of_the_whole_batch():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(10, 3), torch.randn(10, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    sizes = []
    for (mx, my), weight in eb.micro_batches((x, y), model, 3):
        sizes.append(len(mx))
        (torch.nn.functional.mse_loss(model(mx), my) * weight).backward()
    assert sizes == [3, 3, 2, 2]
    for p, g in zip(model.parameters(), whole, strict=True):
        torch.testing.assert_close(p.grad, g)


# ------------------------------------------------------------------ the LR hooks


@pytest.fixture
def lr_hooks():
    scale = {"value": 1.0}
    handles = eb.install_lr_scaling(lambda: scale["value"])
    yield scale
    for handle in handles:
        handle.remove()


def test_lr_scaling_applies_to_the_step_only_and_never_compounds(lr_hooks):
    p = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    lr_hooks["value"] = 0.5
    deltas = []
    for _ in range(3):
        before = p.item()
        p.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
        deltas.append(before - p.item())
    # lr 0.1, 0.05, 0.025 from the schedule, each step scaled by 0.5 (not 0.5 ** k).
    assert deltas == pytest.approx([0.05, 0.025, 0.0125])
    assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert optimizer.state_dict()["param_groups"][0]["lr"] == 0.1 * 0.5**3
    lr_hooks["value"] = 1.0  # back at max workers
    before = p.item()
    optimizer.step()
    assert before - p.item() == pytest.approx(0.0125)


def test_lr_scale_is_one_outside_an_elastic_scale_lr_run():
    assert eb.current_lr_scale() == 1.0
    assert math.isclose(eb.plan_batch("scale_lr", 2, 3, 1, 4).lr_scale, 0.75)
