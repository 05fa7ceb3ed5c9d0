"""Elastic training (issue 8): shrink in place on real worker processes over gloo.

The workload (``workloads.elastic_fn``) logs, per step and rank, the process id, world size and
the ids of the samples it trained on, so the tests can check that survivors keep their processes,
that every sample of an epoch is trained on exactly once across the resize, and compare the final
parameters with a run that switches world size through a disk checkpoint at the same step.
"""

from __future__ import annotations

import collections
import os
import signal

import pytest
import torch

import ringtrain as rt
import workloads
from ringtrain.elastic.policy import ElasticAction, ElasticPolicy
from ringtrain.result import WorkerFailure
from ringtrain.wire.channel import Interrupted
from support import read_events as _events
from support import read_jsonl_dir as _records
from support import run_job

EPOCHS = 2  # 120 samples, global batch 12 (3 x 4 or 2 x 6): 10 steps per epoch, 20 in all
KILL_STEP = 5


def _fit(tmp_path, name, num_workers, *, max_failures=3, restore_from=None, scaling=None, **config):
    log = tmp_path / f"{name}_log"
    log.mkdir()
    cfg = {"epochs": EPOCHS, "log": str(log), "out": str(tmp_path / f"{name}.pt"), **config}
    result = run_job(
        workloads.elastic_fn,
        num_workers,
        storage_path=tmp_path / "runs",
        name=name,
        restore_from=restore_from,
        max_failures=max_failures,
        train_loop_config=cfg,
        **(scaling or {}),
    )
    return result, _records(log), torch.load(cfg["out"], weights_only=True)


@pytest.fixture(scope="module")
def shrunk(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("shrink")
    # elastic_grow_after_s=None: stays at 2 workers (growing back is tested below).
    return _fit(
        tmp,
        "elastic",
        (2, 3),
        kill_ranks=[1],
        kill_step=KILL_STEP,
        scaling={"elastic_grow_after_s": None},
    )


def test_losing_a_worker_shrinks_in_place(shrunk):
    result, records, _final = shrunk
    assert [f.kind for f in result.failures] == ["signal"]
    assert result.error is None
    (resize,) = _events(result.path, "resize")
    assert (resize["old_world_size"], resize["new_world_size"]) == (3, 2)
    assert resize["cause"] == "rank 1 was killed by SIGKILL"
    assert resize["snapshot_step"] == KILL_STEP
    assert resize["resume_s"] is not None and resize["resume_s"] >= 0
    # No full restart: one attempt, one group start.
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    # The survivors (old ranks 0 and 2) carry on in their own processes as ranks 0 and 1.
    before = {r["rank"]: r["pid"] for r in records if r["world"] == 3}
    after = {r["rank"]: r["pid"] for r in records if r["world"] == 2}
    assert after == {0: before[0], 1: before[2]}
    steps_after = sorted({r["step"] for r in records if r["world"] == 2})
    assert steps_after == list(range(KILL_STEP + 1, 10 * EPOCHS + 1))


def test_every_sample_of_the_epoch_is_seen_exactly_once(shrunk):
    result, records, _final = shrunk
    (resize,) = _events(result.path, "resize")
    snap = resize["snapshot_step"]
    # The trajectory that counts: the first group up to the snapshot, the resized one after it.
    kept = [
        r
        for r in records
        if (r["world"] == 3 and r["step"] <= snap) or (r["world"] == 2 and r["step"] > snap)
    ]
    for epoch in range(EPOCHS):
        seen = collections.Counter(i for r in kept if r["epoch"] == epoch for i in r["ids"])
        assert sorted(seen) == list(range(120)), f"epoch {epoch}: samples skipped"
        assert max(seen.values()) == 1, f"epoch {epoch}: samples seen twice"
    # Global batch kept: 3 x 4 before, 2 x 6 after.
    assert {len(r["ids"]) for r in kept if r["world"] == 3} == {4}
    assert {len(r["ids"]) for r in kept if r["world"] == 2} == {6}


def test_loss_continues_after_the_resize(shrunk):
    _result, records, _final = shrunk
    loss = {(r["world"], r["step"]): r["loss"] for r in records if r["rank"] == 0}
    first = loss[(3, 1)]
    # The resized group goes on from the snapshot's parameters, not from a fresh model.
    assert loss[(2, KILL_STEP + 1)] < 0.5 * first
    before = [loss[(3, s)] for s in range(1, KILL_STEP + 1)]
    last_epoch = [loss[(2, s)] for s in range(11, 10 * EPOCHS + 1)]
    assert sum(last_epoch) / len(last_epoch) < sum(before) / len(before)


def test_parameters_match_a_run_at_the_new_size_from_the_same_state(shrunk, tmp_path):
    *_, elastic_final = shrunk
    # The same 3 workers to the same step, saved to disk; then 2 workers (global batch kept:
    # 6 each) resume from that checkpoint through the ordinary restart path.
    first, _, _ = _fit(tmp_path, "ref", 3, stop_at=KILL_STEP)
    assert first.checkpoint is not None
    _, _, reference = _fit(tmp_path, "ref2", 2, restore_from=first.path, batch_size=6)
    assert reference["step"] == elastic_final["step"] == 10 * EPOCHS
    for key, value in reference["model"].items():
        assert torch.equal(value, elastic_final["model"][key]), f"{key} differs"


def test_losing_rank_0_shrinks_in_place_without_waiting_for_the_timeout(tmp_path):
    # Rank 0 dying used to leave rank 1 blocked in gloo's ring allreduce, waiting for data from
    # rank 2 (alive, but already out of the collective), until the driver gave up after 30 s
    # and restarted from disk. Rank 2 now shuts its gloo connections down when its collective
    # fails, which wakes rank 1 at once (ringtrain/elastic/sockets.py).
    result, records, final = _fit(
        tmp_path,
        "rank0",
        (2, 3),
        kill_ranks=[0],
        kill_step=KILL_STEP,
        scaling={"elastic_grow_after_s": None},
    )
    assert result.error is None
    assert _events(result.path, "resize_fallback") == []
    (resize,) = _events(result.path, "resize")
    assert resize["cause"] == "rank 0 was killed by SIGKILL"
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    before = {r["rank"]: r["pid"] for r in records if r["world"] == 3}
    after = {r["rank"]: r["pid"] for r in records if r["world"] == 2}
    assert after == {0: before[1], 1: before[2]}
    assert final["step"] == 10 * EPOCHS


def test_reentry_without_restore_still_starts_ddp_from_rank_0s_parameters(tmp_path):
    # On re-entering after a resize, DDP is built without its initial broadcast (the snapshot
    # restore overwrites the parameters anyway: 400 MB saved for a 100 M-parameter model). A
    # train function that does not restore, with a different model on each rank, must still
    # get rank 0's parameters everywhere, as DDP's constructor would give it.
    result, _records, _final = _fit(
        tmp_path,
        "unrestored",
        (2, 3),
        kill_ranks=[1],
        kill_step=KILL_STEP,
        scaling={"elastic_grow_after_s": None},
        unrestored_reentry=True,
        save_every_rank=True,
    )
    assert result.error is None
    (resize,) = _events(result.path, "resize")
    assert resize["new_world_size"] == 2
    ranks = [torch.load(tmp_path / f"unrestored.pt.rank{r}", weights_only=True) for r in (0, 1)]
    for key, value in ranks[0]["model"].items():
        assert torch.equal(value, ranks[1]["model"][key]), f"{key} differs between the ranks"


def test_deferred_sync_only_when_reentering_with_a_snapshot(tmp_path):
    from ringtrain.checkpoint.checkpoint import Checkpoint
    from ringtrain.elastic import snapshot as snapshots
    from ringtrain.elastic.worker import (
        RESTORED_ATTR,
        ElasticRuntime,
        deferred_sync_generation,
        mark_restored,
    )
    from ringtrain.wire.worker_config import ElasticSettings
    from ringtrain.worker import session as session_module

    current = session_module.current_session()
    assert deferred_sync_generation() is None  # not elastic
    runtime = ElasticRuntime(current, ElasticSettings(min_workers=2, max_workers=3))
    runtime.generation = 3
    current.hooks.register(runtime)  # as run_elastic does
    assert deferred_sync_generation() is None  # elastic, fresh start
    disk = Checkpoint(str(tmp_path))
    current.latest_checkpoint = disk
    assert deferred_sync_generation() is None  # resumed from disk: DDP syncs as usual
    current.latest_checkpoint = snapshots.SnapshotCheckpoint.__new__(snapshots.SnapshotCheckpoint)
    assert deferred_sync_generation() == 3
    module = torch.nn.Linear(2, 2)
    mark_restored(module, disk)
    assert RESTORED_ATTR not in module.__dict__
    mark_restored(module, current.latest_checkpoint)
    assert module.__dict__[RESTORED_ATTR] == 3


def test_below_min_falls_back_to_a_full_restart_from_disk(tmp_path):
    # The kills wait for the ranks' own write of the step-5 checkpoint (on a loaded machine the
    # background write could still run at step 7, and the round would then be lost with them).
    result, records, final = _fit(
        tmp_path, "fallback", (2, 3), kill_ranks=[1, 2], kill_step=7, kill_after_own_write=True
    )
    assert result.error is None and final["step"] == 10 * EPOCHS
    (fallback,) = _events(result.path, "resize_fallback")
    assert "1 of 3 workers remain, fewer than min=2" in fallback["reason"]
    assert _events(result.path, "resize") == []
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0, 1]
    (resume,) = _events(result.path, "resume")
    assert resume["checkpoint"].endswith("checkpoint_000000")  # the report at step 5
    restarted = sorted({r["step"] for r in records if r["attempt"] == 1})
    assert restarted[0] == 6 and {r["world"] for r in records if r["attempt"] == 1} == {3}


def test_a_member_stuck_after_the_resize_is_a_hang_not_a_wait_for_the_collective_timeout(
    tmp_path, capfd
):
    # After the shrink, new rank 0 hangs before its first step (its peer waits on it in DDP's
    # first collective). Re-forming a group used to count as start-up, never a hang: the run
    # waited for the collective timeout (2 * worker_timeout_s + 10 s; 1,210 s by default).
    # A member of a resized group now has worker_timeout_s from the resize to progress.
    result, records, final = _fit(
        tmp_path,
        "stuck",
        (2, 3),
        kill_ranks=[1],
        kill_step=KILL_STEP,
        kill_after_own_write=True,
        hang_after_resize=0,
        scaling={"elastic_grow_after_s": None, "worker_timeout_s": 4.0},
    )
    assert result.error is None and final["step"] == 10 * EPOCHS
    (resize,) = _events(result.path, "resize")
    assert (resize["old_world_size"], resize["new_world_size"]) == (3, 2)
    assert [f.kind for f in result.failures][:2] == ["signal", "hang"]
    hang = result.failures[1]
    assert "after the group was resized" in hang.message, hang.message
    assert "beyond worker_timeout_s=4" in hang.message
    # The hung rank's stacks reached the driver's output before it was stopped.
    assert "in _hang_after_resize" in capfd.readouterr().err
    # Then a full restart from the disk checkpoint of step 5 finished the run.
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0, 1]
    assert {r["world"] for r in records if r["attempt"] == 1} == {3}


# ------------------------------------------------------------------ growing back to max

GROW = {"elastic_grow_after_s": 0.0}  # start a joining worker as soon as the shrink resumed
SLOW = {"slow_world": 2, "slow_s": 0.6, "hold_step": 15}  # slow steps at 2 workers, and a
# wait at step 15 for the driver's GrowRequest: time for a worker to start, however loaded


@pytest.fixture(scope="module")
def grown(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grow")
    return _fit(tmp, "grow", (2, 3), kill_ranks=[1], kill_step=KILL_STEP, scaling=GROW, **SLOW)


def _phases(records, grow_step):
    """The kept trajectory: 3 workers up to the kill's snapshot, 2 up to the grow, 3 after."""
    return (
        [r for r in records if r["world"] == 3 and r["step"] <= KILL_STEP],
        [r for r in records if r["world"] == 2 and r["step"] > KILL_STEP],
        [r for r in records if r["world"] == 3 and r["step"] > grow_step],
    )


def test_a_returning_worker_joins_without_restarting_the_members(grown):
    result, records, final = grown
    assert result.error is None and final["step"] == 10 * EPOCHS
    assert [f.kind for f in result.failures] == ["signal"]  # a grow is not a failure
    shrink, grow = _events(result.path, "resize")
    assert (shrink["old_world_size"], shrink["new_world_size"]) == (3, 2)
    assert (grow["old_world_size"], grow["new_world_size"]) == (2, 3)
    assert grow["cause"] == "capacity returned" and grow["steps_rolled_back"] == 0
    assert grow["resume_s"] >= grow["paused_s"] >= 0
    assert grow["generation"] == 2 and _events(result.path, "grow_failed") == []
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]  # no restart
    g = grow["snapshot_step"]
    assert KILL_STEP < g < 10 * EPOCHS
    first, small, regrown = _phases(records, g)
    pids = [{r["rank"]: r["pid"] for r in phase} for phase in (first, small, regrown)]
    assert pids[1] == {0: pids[0][0], 1: pids[0][2]}
    # The members keep their processes and ranks; a new process joins as rank 2.
    assert {0: pids[2][0], 1: pids[2][1]} == pids[1]
    assert pids[2][2] not in pids[0].values()
    # No step rolled back: the grown group goes on right after the step it paused at.
    assert sorted({r["step"] for r in small}) == list(range(KILL_STEP + 1, g + 1))
    assert sorted({r["step"] for r in regrown}) == list(range(g + 1, 10 * EPOCHS + 1))
    assert {r["rank"] for r in regrown if r["step"] == g + 1} == {0, 1, 2}


def test_growing_back_keeps_the_global_batch_and_sees_every_sample_once(grown):
    _result, records, _final = grown
    (grow,) = [e for e in _events(_result.path, "resize") if e["new_world_size"] == 3]
    phases = _phases(records, grow["snapshot_step"])
    for epoch in range(EPOCHS):
        seen = collections.Counter(
            i for phase in phases for r in phase if r["epoch"] == epoch for i in r["ids"]
        )
        assert sorted(seen) == list(range(120)), f"epoch {epoch}: samples skipped"
        assert max(seen.values()) == 1, f"epoch {epoch}: samples seen twice"
    # Global batch 12 throughout: 3 x 4, 2 x 6, then 3 x 4 again.
    assert [{len(r["ids"]) for r in phase} for phase in phases] == [{4}, {6}, {4}]


def test_grown_parameters_match_runs_switching_size_through_disk_at_the_same_steps(grown, tmp_path):
    result, _, elastic_final = grown
    (grow,) = [e for e in _events(result.path, "resize") if e["new_world_size"] == 3]
    g = grow["snapshot_step"]
    # 3 workers to the kill's step, 2 workers (6 each) to the grow's step, then 3 again
    # (4 each), each switch through the ordinary restart from a disk checkpoint.
    first, _, _ = _fit(tmp_path, "ref", 3, stop_at=KILL_STEP)
    _fit(tmp_path, "ref2", 2, restore_from=first.path, batch_size=6, every=1, stop_at=g)
    _, _, reference = _fit(tmp_path, "ref3", 3, restore_from=first.path)
    assert reference["step"] == elastic_final["step"] == 10 * EPOCHS
    for key, value in reference["model"].items():
        assert torch.equal(value, elastic_final["model"][key]), f"{key} differs"


def test_a_joining_worker_that_dies_falls_back_cleanly(tmp_path, monkeypatch):
    """The first joining worker is killed while it starts (the grow is given up and tried
    again); the second dies right after joining (the group shrinks in place again); the third
    joins. No restart from disk, no hang, no process left behind."""
    from ringtrain.launch.local import LocalWorkerGroup

    original = LocalWorkerGroup.grow
    started = []

    def grow(self, ranks):
        ranks = original(self, ranks)
        started.extend(self._procs[r].pid for r in ranks)
        if len(started) == 1:
            os.killpg(started[0], signal.SIGKILL)  # dies before it is ready to join
        return ranks

    monkeypatch.setattr(LocalWorkerGroup, "grow", grow)
    result, records, final = _fit(
        tmp_path,
        "joinfail",
        (2, 3),
        kill_ranks=[1],
        kill_step=3,
        scaling=GROW,
        kill_joiner_once=str(tmp_path / "joiner-killed"),
        epochs=4,
        **SLOW,
    )
    assert result.error is None and final["step"] == 40
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    (failed,) = _events(result.path, "grow_failed")
    assert "joining rank 2 was killed by SIGKILL" in failed["reason"] and failed["retry_s"] == 0
    sizes = [(e["old_world_size"], e["new_world_size"]) for e in _events(result.path, "resize")]
    assert sizes == [(3, 2), (2, 3), (3, 2), (2, 3)]
    causes = [e["cause"] for e in _events(result.path, "resize")]
    assert causes[2] == "rank 2 was killed by SIGKILL"
    assert [f.kind for f in result.failures] == ["signal", "signal"]
    assert len(started) == 3 and started[2] in {r["pid"] for r in records if r["step"] == 40}
    for pid in {r["pid"] for r in records} | set(started):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every worker, member or joiner, is gone


# ------------------------------------------------------------------ config and policy


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ((3, 2), "min must be <= max"),
        ((0, 2), "num_workers[0] (min) must be >= 1"),
        ((1, 2, 3), "an int or a (min, max) pair"),
        ((1, 2.5), "num_workers[1] (max) must be an int"),
    ],
)
def test_scaling_config_rejects_bad_ranges(value, error):
    with pytest.raises((ValueError, TypeError)) as info:
        rt.ScalingConfig(num_workers=value)
    assert error in str(info.value)


def test_scaling_config_range_and_int_forms():
    elastic = rt.ScalingConfig(num_workers=[2, 4])  # as config.json gives it back
    assert elastic.num_workers == (2, 4) and elastic.elastic
    assert (elastic.min_workers, elastic.max_workers) == (2, 4)
    fixed = rt.ScalingConfig(num_workers=3)
    assert not fixed.elastic and fixed.num_workers == 3
    assert (fixed.min_workers, fixed.max_workers) == (3, 3)
    # tests/backends/test_ray_elastic.py
    assert rt.ScalingConfig(num_workers=(1, 2), backend="ray").elastic
    with pytest.raises(ValueError, match="snapshot_interval_steps"):
        rt.FailureConfig(snapshot_interval_steps=0)


def _lost(rank):
    return WorkerFailure(rank=rank, kind="signal", message=f"rank {rank} was killed", time=1.0)


def _interrupted(rank, step):
    return Interrupted(rank=rank, time=1.0, exc_type="E", message="m", snapshot_step=step)


def test_policy_decisions():
    policy = ElasticPolicy(2, 4, wait_s=5.0)
    lost = {1: _lost(1)}
    wait = policy.decide(4, lost, {0: _interrupted(0, 3)}, set(), 1.0)
    assert wait.action is ElasticAction.WAIT
    late = policy.decide(4, lost, {0: _interrupted(0, 3)}, set(), 6.0)
    assert late.action is ElasticAction.FALLBACK and "[2, 3] did not" in late.reason
    assert late.stuck == (2, 3) and wait.stuck == ()
    everyone = {r: _interrupted(r, 3) for r in (0, 2, 3)}
    ok = policy.decide(4, lost, everyone, set(), 1.0)
    assert ok.action is ElasticAction.RESIZE
    assert ok.survivors == (0, 2, 3) and ok.source is None and ok.snapshot_step == 3
    ahead = policy.decide(4, lost, {**everyone, 3: _interrupted(3, 4)}, set(), 1.0)
    assert ahead.source == 2 and ahead.snapshot_step == 4  # new rank of old rank 3
    too_few = policy.decide(4, {1: _lost(1), 2: _lost(2), 3: _lost(3)}, {}, set(), 0.0)
    assert too_few.action is ElasticAction.FALLBACK and "fewer than min=2" in too_few.reason
    bug = WorkerFailure(rank=1, kind="exception", message="rank 1 raised ValueError", time=1.0)
    assert policy.decide(4, {1: bug}, everyone, set(), 1.0).action is ElasticAction.FALLBACK
    none = policy.decide(4, lost, {**everyone, 0: _interrupted(0, None)}, set(), 1.0)
    assert none.action is ElasticAction.FALLBACK and "no in-memory snapshot" in none.reason


@pytest.mark.parametrize("value", [-1.0, float("nan"), "10", True])
def test_grow_delay_is_validated(value):
    with pytest.raises(ValueError, match=r"ScalingConfig\.elastic_grow_after_s must be a number"):
        rt.ScalingConfig(num_workers=(2, 3), elastic_grow_after_s=value)
    assert (
        rt.ScalingConfig(num_workers=(2, 3), elastic_grow_after_s=None).elastic_grow_after_s is None
    )


def test_policy_grow_decisions():
    policy = ElasticPolicy(2, 4, grow_after_s=10.0)
    assert policy.grow_ranks(2, 9.9, 0) == []  # too early
    assert policy.grow_ranks(2, 10.0, 0) == [2, 3]
    assert policy.grow_ranks(4, 100.0, 0) == []  # at max already
    assert policy.grow_ranks(3, 15.0, 1) == []  # after a failed grow: twice the delay
    assert policy.grow_ranks(3, 20.0, 1) == [3]
    assert policy.grow_delay_s(100) == 640.0  # backoff capped at 64x
    assert ElasticPolicy(2, 4).grow_ranks(2, 1e9, 0) == []  # None: never grows


class _ScriptedGroup:
    """A worker group that delivers one scripted batch of events per poll and records what the
    controller asks of it (resize, grow, discard, send)."""

    def __init__(self, world_size, script):
        self.world_size = world_size
        self.script = list(script)
        self.calls = []

    def poll(self, timeout_s):
        return self.script.pop(0) if self.script else []

    def stop(self, grace_s=5.0):
        self.calls.append(("stop",))

    def pids(self):
        return {}

    def dump_stacks(self, ranks):
        pass

    def resize(self, assignment, orders):
        self.calls.append(("resize", dict(assignment), dict(orders)))
        self.world_size = len(assignment)

    def grow(self, ranks):
        self.calls.append(("grow", list(ranks)))
        return list(ranks)

    def discard(self, ranks):
        self.calls.append(("discard", list(ranks)))

    def send(self, rank, message):
        self.calls.append(("send", rank, message))


def test_a_joiner_lost_while_the_members_paused_reforms_them_from_the_same_snapshot(tmp_path):
    from ringtrain.checkpoint.manager import CheckpointManager
    from ringtrain.config import CheckpointConfig, FailureConfig
    from ringtrain.controller.controller import Controller
    from ringtrain.controller.policy import FailurePolicy
    from ringtrain.launch.base import WorkerSpec
    from ringtrain.monitor.progress import make_progress
    from ringtrain.rundir import RunDirectory
    from ringtrain.wire.channel import Done, Exited, GrowRequest, Hello, JoinReady, Resumed

    def paused(rank, generation, step, grow=True):
        return Interrupted(
            rank=rank, time=2.0, exc_type="E", message="m", snapshot_step=step,
            step=step, generation=generation, grow=grow,
        )  # fmt: skip

    group = _ScriptedGroup(
        3,
        [
            [Hello(rank=r, pid=r, hostname="h") for r in range(3)],
            [Exited(rank=2, time=1.0, returncode=-9)],
            [paused(0, 0, 3, grow=False), paused(1, 0, 3, grow=False)],  # shrink 3 -> 2
            [Resumed(rank=0, time=1.5, generation=1, step=4)],  # -> starts a joiner (rank 2)
            [JoinReady(rank=2, time=2.0)],  # -> GrowRequest to the members
            [paused(0, 1, 6), paused(1, 1, 6), Exited(rank=2, time=2.5, returncode=-9)],
            [Resumed(rank=0, time=3.0, generation=2, step=7)],
            [Done(rank=r, time=4.0, rounds=0) for r in (0, 1)]
            + [Exited(rank=r, time=4.0, returncode=0) for r in (0, 1)],
        ],
    )
    run_dir = RunDirectory(str(tmp_path), "run")
    run_dir.create()

    class Launcher:
        def start(self, spec):
            return group

    controller = Controller(
        launcher=Launcher(),
        make_spec=lambda attempt, start, latest: WorkerSpec(world_size=3, run_dir=run_dir.uri),
        world_size=3,
        run_dir=run_dir,
        checkpoints=CheckpointManager(run_dir.fs, run_dir.path, CheckpointConfig()),
        failure_policy=FailurePolicy(FailureConfig(max_failures=3)),
        progress=make_progress("off"),
        failure_grace_s=0.0,
        poll_interval_s=0.0,
        elastic=ElasticPolicy(2, 3, grow_after_s=0.0),
    )
    result = controller.run()
    assert result.error is None and len(result.failures) == 1  # the grow's loss is no failure
    kinds = [c[0] for c in group.calls]
    assert kinds[:6] == ["resize", "grow", "send", "send", "discard", "resize"]
    assert [c[2] for c in group.calls if c[0] == "send"][:2] == [GrowRequest(1)] * 2
    _, assignment, orders = group.calls[5]
    assert assignment == {0: 0, 1: 1}  # the members, as they were
    assert {o.world_size for o in orders.values()} == {2}
    assert {(o.generation, o.snapshot_step, o.source_rank) for o in orders.values()} == {
        (2, 6, None)
    }
    (failed, *_) = _events(result.path, "grow_failed")
    assert failed["reason"] == "joining rank 2 was killed by SIGKILL" and failed["ranks"] == [2]
    reform = _events(result.path, "resize")[1]
    assert (reform["old_world_size"], reform["new_world_size"]) == (2, 2)
    assert reform["steps_rolled_back"] == 0 and "re-formed" in reform["cause"]
