"""Hot spares (issue 42): ``ScalingConfig(num_workers=W, spares=1)`` keeps a spare worker
started, warmed up and connected; when a member is SIGKILLed, the spare takes its rank with the
state of a peer and the group goes on at full size, ending with the parameters of a run that
never failed (bit for bit).

The workload (``workloads.elastic_fn``) logs every rank's steps (pid, world size, rank, step) and
SIGKILLs the ranks in ``kill_ranks`` right after step ``KILL_STEP`` of the first group.
"""

from __future__ import annotations

import io
import random

import pytest
import torch
from rich.console import Console

import workloads
from ringtrain.monitor.render import render_run, render_runs
from ringtrain.monitor.runs import list_runs, load_run
from support import read_events as _events
from support import read_jsonl_dir as _records
from support import run_job

EPOCHS = 2  # 120 samples, global batch 4 x W: 120 / (4 W) steps per epoch
KILL_STEP = 3


def _fit(tmp_path, name, workers, **config):
    log = tmp_path / f"{name}_log"
    log.mkdir()
    loop = {"epochs": EPOCHS, "log": str(log), "out": str(tmp_path / f"{name}.pt")}
    loop["first_world"] = workers
    loop["run_dir"] = str(tmp_path / "runs" / name)
    loop.update(config.pop("loop", {}))
    result = run_job(
        workloads.elastic_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=name,
        train_loop_config=loop,
        **config,
    )
    return result, _records(log), torch.load(loop["out"], weights_only=True)


def _show(path: str) -> str:
    """What ``ringtrain show`` prints for the run."""
    buf = io.StringIO()
    render_run(load_run(path), Console(file=buf, width=200, color_system=None))
    return buf.getvalue()


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_spare_takes_the_lost_rank_and_the_run_ends_bit_exact(tmp_path, workers):
    lost = workers - 1
    result, records, final = _fit(
        tmp_path,
        "spare",
        workers,
        spares=1,
        max_failures=2,
        loop={"kill_ranks": [lost], "kill_step": KILL_STEP},
    )
    assert result.error is None
    assert [f.kind for f in result.failures] == ["signal"]
    # No restart from disk: one attempt; the group stayed at full size.
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    assert {r["world"] for r in records} == {workers}
    (resize,) = _events(result.path, "resize")
    assert (resize["old_world_size"], resize["new_world_size"]) == (workers, workers)
    assert resize["spare_ranks"] == [lost]
    spare_events = _events(result.path, "spare")
    promoted = [e for e in spare_events if e["action"] == "promoted"]
    assert [(e["spare"], e["rank"]) for e in promoted] == [(workers, lost)]
    assert next(e["spare"] for e in spare_events if e["action"] == "ready") == workers
    assert _show(result.path).count(f"spare {workers} took rank {lost}") == 1
    # The spare's process trained rank `lost` after the kill; the survivors kept theirs.
    before = {r["rank"]: r["pid"] for r in records if r["step"] <= KILL_STEP}
    after = {r["rank"]: r["pid"] for r in records if r["step"] > KILL_STEP + 1}
    assert after[lost] != before[lost]
    assert all(after[r] == before[r] for r in range(workers) if r != lost)
    steps = -(-120 // (4 * workers)) * EPOCHS  # the last batch of an epoch may be short
    # The parameters of an uninterrupted run at the same size.
    _, _, reference = _fit(tmp_path, "ref", workers)
    assert reference["step"] == final["step"] == steps
    _same_parameters(final, reference)
    # `ringtrain ls`: the spare beside the world size.
    listed = {run.name: run for run in list_runs(str(tmp_path / "runs"))}
    assert (listed["spare"].spares, listed["ref"].spares) == (1, 0)
    buf = io.StringIO()
    render_runs(list(listed.values()), Console(file=buf, width=120, color_system=None))
    assert f" {workers}+1 " in next(line for line in buf.getvalue().splitlines() if "spare" in line)


def _same_parameters(final, reference) -> None:
    assert reference["step"] == final["step"]
    for key, value in reference["model"].items():
        assert torch.equal(value, final["model"][key]), f"{key} differs"


def test_a_spare_that_dies_is_replaced_and_the_run_goes_on(tmp_path):
    # The ready spare (id 3) is SIGKILLed at step 2; the run goes on, says so, and starts
    # another (id 4), which takes rank 1 when that member is killed at step 6.
    result, records, final = _fit(
        tmp_path,
        "spare_dies",
        3,
        spares=1,
        max_failures=1,
        loop={"kill_spare_step": 2, "kill_ranks": [1], "kill_step": 6, "spares_ready": 2},
    )
    assert result.error is None
    assert [f.rank for f in result.failures] == [1]  # the spare's death is no failure of the run
    spare_events = _events(result.path, "spare")
    (lost,) = [e for e in spare_events if e["action"] == "lost"]
    assert lost["spare"] == 3 and "killed by signal 9" in lost["reason"]
    promoted = [(e["spare"], e["rank"]) for e in spare_events if e["action"] == "promoted"]
    assert promoted == [(4, 1)]
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    assert {r["world"] for r in records} == {3}
    shown = _show(result.path)
    assert "spare 3 lost: spare 3 was killed by signal 9" in shown
    assert "spare 4 took rank 1" in shown
    _, _, reference = _fit(tmp_path, "ref", 3)
    _same_parameters(final, reference)


def test_a_kill_during_the_hand_over_falls_back_to_the_disk_restart_bit_exact(tmp_path):
    # Rank 1 dies at step 6; the spare takes its place; rank 0 dies as it re-enters the train
    # function, before the re-formed group's first step. No spare is ready yet (the next one
    # starts once the group trains again), so the group restarts from the disk checkpoint.
    result, _records, final = _fit(
        tmp_path,
        "handover_kill",
        3,
        spares=1,
        max_failures=3,
        loop={"kill_ranks": [1], "kill_step": 6, "kill_on_reentry": 0},
    )
    assert result.error is None
    assert [f.rank for f in result.failures] == [1, 0]
    assert [e["action"] for e in _events(result.path, "spare")].count("promoted") == 1
    (fallback,) = _events(result.path, "resize_fallback")
    assert "fewer than min=3" in fallback["reason"]
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0, 1]
    _, _, reference = _fit(tmp_path, "ref", 3)
    _same_parameters(final, reference)


def test_a_preemption_notice_hands_the_rank_to_a_spare_before_it_leaves(tmp_path):
    # Rank 1 SIGTERMs itself after step 4 (once the spare is ready): the members pause at the
    # agreed step 5, the spare takes rank 1 with that step's state, rank 1's process leaves.
    # No failure, no step recomputed, full size throughout.
    result, records, final = _fit(
        tmp_path,
        "notice",
        3,
        spares=1,
        max_failures=1,
        loop={
            "notice_step": 4,
            "sigterm_ranks": [1],
            "spares_ready": 1,
            "spares_ready_step": 4,
            "kill_ranks": [1],
            "rank_noise": True,
        },
    )
    assert result.error is None and result.failures == [] and result.preemptions == 1
    (resize,) = _events(result.path, "resize")
    assert (resize["old_world_size"], resize["new_world_size"]) == (3, 3)
    assert resize["spare_ranks"] == [1] and resize["steps_rolled_back"] == 0
    assert resize["snapshot_step"] == 5
    before = {r["rank"]: r["pid"] for r in records if r["step"] <= 5}
    after = {r["rank"]: r["pid"] for r in records if r["step"] > 5}
    assert after[1] != before[1] and (after[0], after[2]) == (before[0], before[2])
    assert sorted(r["step"] for r in records if r["rank"] == 1) == list(range(1, 21))
    _, _, reference = _fit(tmp_path, "ref", 3, loop={"rank_noise": True})
    _same_parameters(final, reference)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_seeded_campaign_of_kills_ends_bit_exact_at_full_size(tmp_path, workers):
    seed = 42 + workers
    rng = random.Random(seed)
    steps = -(-120 // (4 * workers)) * EPOCHS
    at = sorted(rng.sample(range(2, steps - 2, 3), 3))  # 3 kills, 3 steps apart at least
    campaign = [[step, rng.randrange(workers)] for step in at]
    note = f"seed {seed}: kills (step, rank) {campaign}"
    # Per-rank randomness: each rank adds noise from its own stream, which the spare that takes
    # its place continues (the snapshot's gathered RNG states).
    result, records, final = _fit(
        tmp_path,
        "campaign",
        workers,
        spares=1,
        max_failures=3,
        loop={"campaign": campaign, "rank_noise": True},
    )
    assert result.error is None, note
    assert [f.rank for f in result.failures] == [rank for _, rank in campaign], note
    resizes = _events(result.path, "resize")
    assert [r["spare_ranks"] for r in resizes] == [[rank] for _, rank in campaign], note
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0], note
    assert {r["world"] for r in records} == {workers}, note
    _, _, reference = _fit(tmp_path, "ref", workers, loop={"rank_noise": True})
    _same_parameters(final, reference)
