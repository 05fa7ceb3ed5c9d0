"""A partition, decided without processes: a rank whose host stops answering is called
unreachable (not frozen), its worker is fenced off before anything else and no stacks are asked
of it; a flap clears the fact; the fence refuses a lost worker's writes; a guarded publication
refuses a round a lost worker touched."""

from __future__ import annotations

import time

import pytest

from ringtrain.checkpoint import fence
from ringtrain.checkpoint.fence import Fence, WorkerFenced
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import CheckpointConfig
from ringtrain.controller import events
from ringtrain.controller.effects import DumpStacks, FenceOff
from ringtrain.controller.generation import Generation
from ringtrain.controller.health import Health
from ringtrain.wire.channel import CheckpointDone, Heartbeat, Hello, HostSilent, Report


def _cut_gen(silent_s: float) -> Generation:
    """Three ranks; rank 2 (on h3, pid 42) unheard for ``silent_s`` s, its peers blocked in
    the collective with it (heartbeating, no progress since then)."""
    gen = Generation(0, 3)
    gen.health.started_at -= 100
    now = time.monotonic()
    for rank in range(3):
        events.handle(gen, Hello(rank=rank, pid=40 + rank, hostname=f"h{rank + 1}"),
                      generation=0, grow=None)  # fmt: skip
        gen.health.seen(rank, now if rank != 2 else now - silent_s)
        # the peers fetched their next batch, then blocked on the cut rank's part of the step
        gen.health.progressed(rank, now - silent_s + (0.5 if rank != 2 else 0))
    return gen


def test_a_silent_rank_whose_host_does_not_answer_is_unreachable_and_fenced_off_first():
    gen = _cut_gen(11.0)
    silent = HostSilent(rank=2, time=time.time(), host="10.77.0.3", since=time.time() - 9.5)
    assert events.handle(gen, silent, generation=0, grow=None) == []
    assert 2 not in gen.health.last_seen or gen.health.last_seen[2] < time.monotonic() - 10
    effects = events.hang(gen, 10.0)
    assert effects[0] == FenceOff(0, "h3:42")  # before the failure is even written
    assert not any(isinstance(e, DumpStacks) for e in effects)  # nothing reaches its host
    failure = gen.failures[2]
    assert failure.kind == "unreachable"
    assert failure.message.startswith("rank 2 on host 10.77.0.3 is unreachable: nothing heard")
    assert "a network partition or a lost host" in failure.message


def test_the_partition_is_blamed_when_a_waiting_peer_crosses_the_timeout_first():
    # Rank 0's last progress is older than the cut rank's (it was already waiting in the
    # allreduce): the progress check would blame rank 0, but its host answers and rank 2's
    # does not.
    gen = _cut_gen(6.0)
    gen.health.progressed(0, time.monotonic() - 10.5)
    events.handle(gen, HostSilent(2, time.time(), "10.77.0.3", time.time() - 5.5),
                  generation=0, grow=None)  # fmt: skip
    events.hang(gen, 10.0)
    assert list(gen.failures) == [2] and gen.failures[2].kind == "unreachable"


def test_a_flap_clears_the_fact_and_a_frozen_rank_stays_frozen():
    gen = _cut_gen(11.0)
    now = time.time()
    events.handle(gen, HostSilent(2, now, "10.77.0.3", now - 3), generation=0, grow=None)
    events.handle(gen, HostSilent(2, now, "10.77.0.3", now - 3, answered=True),
                  generation=0, grow=None)  # fmt: skip
    assert gen.health.host_silent == {}
    effects = events.hang(gen, 10.0)
    assert effects[0] == DumpStacks((2,))  # its host answers: a frozen process, asked for stacks
    assert gen.failures[2].kind == "hang"


def test_a_host_that_does_not_answer_is_no_failure_before_the_timeout():
    health = Health(2, check_interval_s=0.0)
    health.seen(0, 100.0)
    health.seen(1, 100.0)
    health.host_silent[1] = ("10.77.0.2", 0.0)
    assert health.unreachable(10.0, {}, 105.0, 5.0, stalled=False) is None  # a short flap
    assert health.unreachable(10.0, {}, 106.0, 6.0, stalled=True) is not None
    assert health.unreachable(10.0, {1: -9}, 120.0, 20.0, stalled=False) is None  # it exited
    health.heartbeat(Heartbeat(rank=1, time=0.0, progress_age_s=0.0), 119.0)
    health.seen(1, 119.0)
    assert health.unreachable(10.0, {}, 120.0, 20.0, stalled=True) is None  # it is heard


def test_the_fence_refuses_a_lost_worker_and_any_worker_of_an_earlier_attempt(tmp_path):
    import fsspec

    fs = fsspec.filesystem("file")
    fence.check(fs, str(tmp_path), 0, "h3:42")  # no fence yet: nothing is fenced
    fence.write(fs, str(tmp_path), Fence(0, ("h3:42",)))
    assert fence.read(fs, str(tmp_path)) == Fence(0, ("h3:42",))
    fence.check(fs, str(tmp_path), 0, "h1:40")  # a survivor writes on
    with pytest.raises(WorkerFenced, match=r"declared this worker \(h3:42, attempt 0\) lost"):
        fence.check(fs, str(tmp_path), 0, "h3:42")
    fence.write(fs, str(tmp_path), Fence(1))
    with pytest.raises(WorkerFenced, match="attempt 0 has ended"):
        fence.check(fs, str(tmp_path), 0, "h1:40")
    assert not issubclass(WorkerFenced, Exception)  # a train function's except does not eat it


def test_a_guarded_publication_drops_strays_and_refuses_a_file_that_differs(tmp_path):
    import fsspec

    from ringtrain.checkpoint import storage

    manager = CheckpointManager(
        fsspec.filesystem("file"), str(tmp_path / "run"), CheckpointConfig()
    )
    fs, staging = manager.staging_path(3)
    fs.makedirs(staging, exist_ok=True)
    (tmp_path / "run" / "checkpoint_000003.tmp" / "model.pt").write_bytes(b"current")
    (tmp_path / "run" / "checkpoint_000003.tmp" / "rank_2.pt").write_bytes(b"a lost worker's")
    files = {"model.pt": storage.file_digest(fs, f"{staging}/model.pt")}
    assert manager.settle_staging(3, files) is None
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoint_000003.tmp").iterdir()) == [
        "model.pt"
    ]
    (tmp_path / "run" / "checkpoint_000003.tmp" / "model.pt").write_bytes(b"overwritten")
    assert manager.settle_staging(3, files) == "model.pt differs from what its rank wrote"


def test_an_unreachable_ranks_pending_write_does_not_hold_the_restart():
    # Every rank reported round 0 with a background write; ranks 0 and 1 finished theirs, and
    # rank 2 was then cut off: its write will never be reported, so the restart does not wait
    # checkpoint_grace_s (120 s by default) for it.
    gen = Generation(0, 3)
    for rank in range(3):
        report = Report(rank, 0, time.time(), {"step": 2}, checkpoint_pending=True)
        events.handle(gen, report, generation=0, grow=None)
    for rank in (0, 1):
        events.handle(gen, CheckpointDone(rank, 0, {}), generation=0, grow=None)
    gen.health.started_at -= 100
    now = time.monotonic()
    for rank in range(3):
        events.handle(gen, Hello(rank=rank, pid=40 + rank, hostname=f"h{rank + 1}"),
                      generation=0, grow=None)  # fmt: skip
        gen.health.seen(rank, now if rank != 2 else now - 11)
        gen.health.progressed(rank, now - 11)
    events.handle(gen, HostSilent(2, time.time(), "10.77.0.3", time.time() - 10),
                  generation=0, grow=None)  # fmt: skip
    assert gen.rounds.writes_in_flight(set())  # rank 2 owes its write
    events.hang(gen, 10.0)
    assert gen.failures[2].kind == "unreachable"
    assert gen.drained(failure_grace_s=0.0, checkpoint_grace_s=3600.0)
