"""ringtrain.horovod's round plan (horovod/matching.py): operations matched by name as Horovod's
coordinator does, ``join()`` as a stand-in for allreduce, and a refusal instead of a hang."""

from __future__ import annotations

import torch

from ringtrain.horovod.matching import JOIN_KEY, Member, plan_round, unnamed_key
from ringtrain.horovod.metadata import NAME, hash63, metadata_row


def row(kind: str, key: str, shape=(2,), extra: int = 0) -> tuple[int, ...]:
    return (*metadata_row(kind, key, [torch.ones(shape)], False, extra, 0, None), 0, 0)


def member(rank: int, *rows, blocking: bool = True, join_age: int = -1, seq: int = 0) -> Member:
    return Member(rank, blocking, join_age, seq, tuple(rows))


JOINED = row("join", JOIN_KEY)


def test_an_operation_queued_on_every_rank_is_ready():
    plan = plan_round([member(0, row("allreduce", "a")), member(1, row("allreduce", "a"))])
    assert [(r.key, r.participants, r.error) for r in plan.ready] == [(hash63("a"), (0, 1), None)]
    assert plan.deadlock is None


def test_ready_operations_follow_the_first_ranks_order():
    a, b = row("allreduce", "a"), row("allgather", "b")
    plan = plan_round([member(0, a, b, blocking=False), member(1, b, a, blocking=False)])
    assert [r.key for r in plan.ready] == [hash63("a"), hash63("b")]


def test_a_name_queued_on_one_rank_waits_while_a_peer_is_elsewhere():
    # Horovod's duplicate-name test: rank 0 submitted "dup" and goes on; rank 1 is in barrier
    plan = plan_round(
        [
            member(0, row("allreduce", "dup"), blocking=False),
            member(1, row("barrier", unnamed_key(0))),
        ]
    )
    assert plan.ready == () and plan.deadlock is None
    plan = plan_round(
        [
            member(0, row("allreduce", "dup"), row("barrier", unnamed_key(0))),
            member(1, row("barrier", unnamed_key(0))),
        ]
    )
    assert [(r.key, r.error) for r in plan.ready] == [(hash63(unnamed_key(0)), None)]


def test_ranks_that_wait_for_operations_that_never_meet_get_an_error_not_a_hang():
    plan = plan_round(
        [member(0, row("allreduce", "x"), seq=3), member(1, row("barrier", unnamed_key(5)), seq=6)]
    )
    assert plan.ready == ()
    assert plan.deadlock is not None and "rank 0 waits in allreduce" in plan.deadlock
    assert "rank 1 waits in barrier" in plan.deadlock
    assert plan.seq == 6  # unnamed keys line up again afterwards


def test_same_name_with_another_shape_or_operation_raises_on_every_participant():
    shape = plan_round([member(0, row("allreduce", "a")), member(1, row("allreduce", "a", (3,)))])
    kind = plan_round([member(0, row("allreduce", "a")), member(1, row("broadcast", "a"))])
    for plan in (shape, kind):
        (ready,) = plan.ready
        assert ready.error is not None and ready.error[0] is RuntimeError
        assert "mismatched calls across ranks" in ready.error[1]


def test_a_joined_rank_contributes_zeros_to_allreduce_only():
    ar = plan_round([member(0, JOINED, join_age=2), member(1, row("allreduce", "a"))])
    (ready,) = ar.ready
    assert ready.participants == (1,) and ready.zero_fill == (0,) and ready.error is None
    bc = plan_round([member(0, JOINED, join_age=0), member(1, row("broadcast", "b"))])
    (ready,) = bc.ready
    assert ready.error is not None and ready.error[0] is RuntimeError
    assert "not supported with Join" in ready.error[1]
    adasum = plan_round([member(0, JOINED, join_age=0), member(1, row("allreduce", "c", extra=2))])
    assert adasum.ready[0].error[0] is NotImplementedError


def test_a_joined_rank_with_the_operation_queued_takes_part_with_its_tensor():
    a = row("allreduce", "a")
    plan = plan_round(
        [member(0, a, JOINED, join_age=0), member(1, a), member(2, JOINED, join_age=1)]
    )
    (ready,) = plan.ready
    assert ready.participants == (0, 1) and ready.zero_fill == (2,)


def test_join_returns_the_last_rank_to_join_on_every_rank():
    plan = plan_round(
        [
            member(0, JOINED, join_age=3, seq=1),
            member(1, JOINED, join_age=0, seq=4),
            member(2, JOINED, join_age=0, seq=4),
        ]
    )
    assert plan.last_joined == 2 and plan.ready == () and plan.seq == 4


def test_join_entries_are_never_matched_by_name():
    plan = plan_round([member(0, JOINED, join_age=0), member(1, row("allreduce", "a"))])
    assert all(r.key != JOINED[NAME] for r in plan.ready)
