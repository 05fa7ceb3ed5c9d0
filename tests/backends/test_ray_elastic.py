"""Elastic training on the Ray backend (issue 8), on a real two-node Ray cluster started on this
machine (``ray.cluster_utils.Cluster``: a head and a worker node, 2 CPUs each, as in test_ray.py).

The workload is test_elastic.py's (``workloads.elastic_fn``: 3 workers, global batch 12, 20 steps,
a per-step log of pid, world size, rank and sample ids). Losing rank 0's *actor* matters most on
Ray: without elasticity rank 0's actor hosts the rendezvous store, so the survivors could not
re-form the group; an elastic run keeps the store in the driver. The final parameters are
compared, tensor by tensor, with test_elastic.py's reference: the same 3 workers to the snapshot
step on the local backend, saved to disk, then 2 workers (6 samples each) resumed from it.
"""

from __future__ import annotations

import pytest
import torch

import workloads

ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")
pytest.importorskip("ray.util.state", reason="the Ray state API needs ray[default]")

from ray_cluster import assert_torn_down  # noqa: E402
from support import read_events as _events  # noqa: E402
from support import read_jsonl_dir as _records  # noqa: E402
from support import run_job  # noqa: E402

# One local Ray cluster at a time: the Ray tests share one pytest worker (pyproject addopts).
pytestmark = pytest.mark.xdist_group("ray")

EPOCHS = 2  # 120 samples, global batch 12 (3 x 4, then 2 x 6): 10 steps per epoch
STEPS = 10 * EPOCHS
VICTIM = 2  # the rank whose actor is killed


def _fit(
    tmp_path, name, num_workers, *, backend="ray", callbacks=(), restore_from=None, grow=None, **cfg
):
    """``grow``: ``elastic_grow_after_s`` (``None``: the group stays smaller after a shrink)."""
    log = tmp_path / f"{name}_log"
    log.mkdir()
    config = {"epochs": EPOCHS, "log": str(log), "out": str(tmp_path / f"{name}.pt"), **cfg}
    elastic = {"elastic_grow_after_s": grow} if isinstance(num_workers, tuple) else {}
    result = run_job(
        workloads.elastic_fn,
        num_workers,
        storage_path=tmp_path / "runs",
        name=name,
        restore_from=restore_from,
        backend=backend,
        max_failures=3,
        callbacks=list(callbacks),
        train_loop_config=config,
        **elastic,
    )
    return result, _records(log), torch.load(config["out"], weights_only=True)


class _KillActor:
    """Driver-side callback: ``ray.kill`` the actor of bundle ``bundle`` (its rank under PACK:
    ranks follow bundles on one node, and bundle 0 is always rank 0) once that rank has
    reported round 0 (step 5)."""

    def __init__(self, run_name: str, bundle: int) -> None:
        self.prefix = f"ringtrain-{run_name}-a0-w{bundle}-"
        self.rank = bundle
        self.killed: list[str] = []

    def on_report(self, rank, round_, metrics):
        if self.killed or rank != self.rank or round_ != 0:
            return
        names = [n for n in ray.util.list_named_actors() if n.startswith(self.prefix)]
        assert len(names) == 1, names
        ray.kill(ray.get_actor(names[0]), no_restart=True)
        self.killed.append(names[0])


def test_a_killed_actor_shrinks_in_place(cluster, tmp_path):
    killer = _KillActor("ray_elastic", bundle=VICTIM)
    result, records, final = _fit(tmp_path, "ray_elastic", (2, 3), callbacks=[killer])
    assert len(killer.killed) == 1
    assert result.error is None and final["step"] == STEPS
    # A lost worker (its process dies with the actor), not an exception: resized away.
    assert [(f.rank, f.kind, f.message) for f in result.failures] == [
        (VICTIM, "signal", f"rank {VICTIM} was killed by SIGKILL")
    ]
    (resize,) = _events(result.path, "resize")
    assert (resize["old_world_size"], resize["new_world_size"]) == (3, 2)
    assert resize["resume_s"] is not None and resize["resume_s"] >= 0
    snap = resize["snapshot_step"]
    assert 5 <= snap < STEPS
    # No restart: one attempt; the survivors go on in their own processes, renumbered.
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    assert _events(result.path, "resize_fallback") == []
    before = {r["rank"]: r["pid"] for r in records if r["world"] == 3}
    after = {r["rank"]: r["pid"] for r in records if r["world"] == 2}
    assert after == dict(enumerate(pid for r, pid in sorted(before.items()) if r != VICTIM))
    assert sorted({r["step"] for r in records if r["world"] == 2}) == list(
        range(snap + 1, STEPS + 1)
    )
    assert_torn_down()

    # test_elastic.py's reference, on the local backend: 3 workers to the snapshot step (a
    # checkpoint there), then 2 workers with the global batch kept resume from it.
    first, _, _ = _fit(tmp_path, "ref", 3, backend="local", stop_at=snap, every=snap)
    assert first.checkpoint is not None
    _, _, reference = _fit(
        tmp_path, "ref2", 2, backend="local", restore_from=first.path, batch_size=6, every=snap
    )
    assert reference["step"] == STEPS
    for key, value in reference["model"].items():
        assert torch.equal(value, final["model"][key]), f"{key} differs"


def test_below_min_falls_back_to_a_full_restart(cluster, tmp_path):
    # As the local test: the kills wait for the ranks' own write of the step-5 checkpoint.
    result, records, final = _fit(
        tmp_path, "ray_fallback", (2, 3), kill_ranks=[1, 2], kill_step=7, kill_after_own_write=True
    )
    assert result.error is None and final["step"] == STEPS
    (fallback,) = _events(result.path, "resize_fallback")
    assert "1 of 3 workers remain, fewer than min=2" in fallback["reason"]
    assert _events(result.path, "resize") == []
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0, 1]
    (resume,) = _events(result.path, "resume")
    assert resume["checkpoint"].endswith("checkpoint_000000")  # the report at step 5
    restarted = sorted({r["step"] for r in records if r["attempt"] == 1})
    assert restarted[0] == 6 and {r["world"] for r in records if r["attempt"] == 1} == {3}
    assert_torn_down()


def test_growing_back_starts_a_joiner_in_the_freed_bundle(cluster, tmp_path):
    """A worker SIGKILLed at step 5 is resized away in place (3 -> 2 from the step-5 snapshot,
    the survivors in their own processes, renumbered); its bundle stays in the placement
    group: a joining worker starts there in a new actor and the group grows back to 3 without
    restarting a member."""
    result, records, final = _fit(
        tmp_path,
        "ray_grow",
        (2, 3),
        grow=0.0,  # grow back as soon as the shrink resumed
        kill_ranks=[1],
        kill_step=5,
        slow_world=2,  # slow steps at 2 workers: time for the joiner to start
        slow_s=0.4,
        hold_step=STEPS - 3,  # and wait there for the GrowRequest, however loaded the machine
    )
    assert result.error is None and final["step"] == STEPS
    # one failure, the kill (a grow is not a failure)
    assert [(f.rank, f.kind, f.message) for f in result.failures] == [
        (1, "signal", "rank 1 was killed by SIGKILL")
    ]
    shrink, grow = _events(result.path, "resize")
    assert (shrink["old_world_size"], shrink["new_world_size"], shrink["snapshot_step"]) == (
        3,
        2,
        5,
    )
    assert (grow["old_world_size"], grow["new_world_size"]) == (2, 3)
    assert grow["cause"] == "capacity returned" and grow["steps_rolled_back"] == 0
    assert [e["attempt"] for e in _events(result.path, "run_start")] == [0]
    g = grow["snapshot_step"]
    first = {r["rank"]: r["pid"] for r in records if r["world"] == 3 and r["step"] <= 5}
    small = {r["rank"]: r["pid"] for r in records if r["world"] == 2}
    regrown = {r["rank"]: r["pid"] for r in records if r["world"] == 3 and r["step"] > g}
    assert small == {0: first[0], 1: first[2]}
    assert {0: regrown[0], 1: regrown[1]} == small and regrown[2] not in first.values()
    assert sorted({r["step"] for r in records if r["world"] == 3 and r["step"] > g}) == list(
        range(g + 1, STEPS + 1)
    )
    assert_torn_down()
