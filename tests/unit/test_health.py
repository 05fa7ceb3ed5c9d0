"""The hang check's blame on a loaded machine (controller/health.py), with times given
explicitly: no processes, no clock."""

from __future__ import annotations

from ringtrain.controller.health import Health
from ringtrain.wire.channel import Heartbeat


def _beat(health: Health, rank: int, now: float, age: float, count: int, step: int) -> None:
    health.seen(rank, now)
    health.heartbeat(
        Heartbeat(rank=rank, time=now, progress_age_s=age, step=step, progress_count=count), now
    )


def test_the_peer_that_crossed_first_is_not_blamed_for_the_stuck_rank() -> None:
    # Rank 1 hangs right after its step (progress at t=10.2, 26 progress events); rank 0 had
    # fetched the next batch before (t=10.1, 27 events; on a loaded machine rank 1 ran late)
    # and blocks in the collective, heartbeating. Rank 0 crosses the 2 s timeout first.
    health = Health(2, check_interval_s=0.0)
    for now in (11.0, 12.0, 12.15):
        _beat(health, 0, now, now - 10.1, 27, 13)
        _beat(health, 1, now, now - 10.2, 26, 13)
    assert health.hung(2.0, {}, 12.15) is None  # rank 0 is past it, the culprit is not yet
    _beat(health, 0, 12.25, 12.25 - 10.1, 27, 13)
    _beat(health, 1, 12.25, 12.25 - 10.2, 26, 13)
    found = health.hung(2.0, {}, 12.25)
    assert found is not None
    rank, how = found
    assert rank == 1 and how.startswith("made no progress for ")
    assert "ranks [0] are stuck too" in how


def test_a_rank_stuck_alone_is_failed_while_its_peers_progress() -> None:
    health = Health(3, check_interval_s=0.0)
    _beat(health, 0, 20.0, 0.1, 500, 90)
    _beat(health, 1, 20.0, 0.1, 500, 90)
    _beat(health, 2, 20.0, 2.5, 40, 12)  # far fewer events, but alone: the others progress
    found = health.hung(2.0, {}, 20.0)
    assert found is not None and found[0] == 2 and "stuck too" not in found[1]


def test_exited_ranks_and_fresh_progress_are_not_hangs() -> None:
    health = Health(2, check_interval_s=0.0)
    _beat(health, 0, 5.0, 0.2, 10, 3)
    _beat(health, 1, 5.0, 30.0, 1, 0)
    assert health.hung(2.0, {1: 0}, 5.0) is None


def test_a_rank_frozen_just_after_a_heartbeat_is_named_frozen_not_stuck() -> None:
    # Rank 1 made its last progress at t=10.0 (26 events) and its heartbeat thread sent one more
    # beat at t=10.3 before the process was stopped (SIGSTOP). Rank 0 (progress at t=10.05)
    # heartbeats on, blocked in the collective. The progress threshold (2 s) is crossed at
    # t=12.0, before the silence one (t=12.3): the message must still say the process stopped
    # answering.
    health = Health(2, check_interval_s=0.0)
    _beat(health, 1, 10.3, 0.3, 26, 13)
    for now in (10.4, 11.2, 12.0, 12.1):
        _beat(health, 0, now, now - 10.05, 27, 13)
    found = health.hung(2.0, {}, 12.1)
    assert found is not None
    rank, how = found
    assert rank == 1 and how.startswith("stopped answering 1.8 s ago and made no progress for 2.1")
    assert "frozen or stopped" in how and "ranks [0] are stuck too" in how


def test_a_stuck_rank_that_still_heartbeats_is_named_stuck_not_frozen() -> None:
    # The same timeline, but rank 1's heartbeat thread goes on (a deadlock in Python, a sleep).
    health = Health(2, check_interval_s=0.0)
    for now in (10.3, 10.7, 11.1, 11.5, 11.9, 12.1):
        _beat(health, 1, now, now - 10.0, 26, 13)
        _beat(health, 0, now, now - 10.1, 27, 13)
    found = health.hung(2.0, {}, 12.1)
    assert found is not None and found[0] == 1 and found[1].startswith("made no progress for 2.1")


def test_a_resized_generation_counts_from_the_resize_not_from_a_first_progress() -> None:
    # Start-up (no progress yet) is never a hang; a generation re-formed from live processes
    # is not a start-up: a member with no progress worker_timeout_s after the resize is hung.
    fresh = Health(2, check_interval_s=0.0)
    resized = Health(2, check_interval_s=0.0)
    resized.resized(100.0)
    for health in (fresh, resized):
        for rank in (0, 1):
            health.seen(rank, 103.5)  # both heartbeat, neither has stepped since
    assert fresh.hung(2.0, {}, 103.5) is None
    found = resized.hung(2.0, {}, 103.5)
    assert found is not None
    rank, how = found
    assert rank == 0 and how.startswith("has not resumed 3.5 s after the group was resized")
    assert "ranks [1] are stuck too" in how
    # Progress after the resize ends it; a later stall reads as an ordinary one.
    _beat(resized, 0, 104.0, 0.0, 5, 6)
    _beat(resized, 1, 104.0, 0.0, 5, 6)
    assert resized.hung(2.0, {}, 105.0) is None
    resized.seen(0, 106.5)
    resized.seen(1, 106.5)
    found = resized.hung(2.0, {}, 106.5)
    assert found is not None and found[1].startswith("made no progress for 2.5 s")
