"""Hot spares (``ScalingConfig.spares``, issue 42): the validation before any process starts,
and the pure deciders that hand a lost rank to a ready spare (no processes here; the hand-over
on real workers is in tests/multiprocess/test_spares.py)."""

from __future__ import annotations

import time

import pytest

import ringtrain as rt
from ringtrain.config.spares import spares_run_refusal
from ringtrain.controller import spares
from ringtrain.controller.effects import Say, Write
from ringtrain.controller.generation import Generation
from ringtrain.elastic.policy import ElasticAction, ElasticPolicy
from ringtrain.result import WorkerFailure
from ringtrain.wire.channel import Exited, Hello, Interrupted, JoinReady


def test_spares_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match=r"ScalingConfig\.spares must be >= 0, got -1"):
        rt.ScalingConfig(num_workers=3, spares=-1)
    for bad in (1.5, "1", True):
        with pytest.raises(TypeError, match=r"ScalingConfig\.spares must be an int"):
            rt.ScalingConfig(num_workers=3, spares=bad)
    assert rt.ScalingConfig(num_workers=3).spares == 0
    assert not rt.ScalingConfig(num_workers=3).in_place
    assert rt.ScalingConfig(num_workers=3, spares=2).in_place


@pytest.mark.parametrize(
    ("fields", "names"),
    [
        ({"backend": "ray"}, ["backend='ray'", "spares=0 with num_workers=(min, max)"]),
        ({"use_gpu": True}, ["use_gpu=True", "use_gpu=False"]),
        ({"parallel": rt.ParallelConfig(dp_shard=-1)}, ["parallel=", "parallel=None"]),
    ],
)
def test_spares_where_they_cannot_serve_are_refused_naming_the_field_and_the_fix(fields, names):
    with pytest.raises(ValueError, match=r"ScalingConfig\(spares=1\)") as info:
        rt.ScalingConfig(num_workers=2, spares=1, **fields)
    for name in names:
        assert name in str(info.value)


def test_spares_without_failures_to_spend_or_with_a_script_are_refused():
    assert spares_run_refusal(0, max_failures=0, script=True) is None
    assert spares_run_refusal(1, max_failures=-1, script=False) is None
    no_failures = spares_run_refusal(1, max_failures=0, script=False)
    assert no_failures is not None and "FailureConfig(max_failures=N)" in no_failures
    script = spares_run_refusal(1, max_failures=3, script=True)
    assert script is not None and "pass a train function to rt.Trainer" in script


def test_fit_refuses_spares_before_any_process_starts(tmp_path):
    def never_called(config):  # a worker would fail to import a local function anyway
        raise AssertionError("a worker started")

    trainer = rt.Trainer(
        never_called,
        rt.ScalingConfig(num_workers=2, spares=1),
        rt.RunConfig(name="r", storage_path=str(tmp_path), progress="off"),
    )
    with pytest.raises(ValueError, match=r"max_failures=0"):
        trainer.fit()
    assert not (tmp_path / "r").exists()  # nothing written either


def _lost(world: int, rank: int, snapshot_steps: dict[int, int]) -> Generation:
    gen = Generation(0, world)
    gen.failures[rank] = WorkerFailure(rank, "signal", f"rank {rank} was killed by SIGKILL")
    gen.exited[rank] = -9
    for r, step in snapshot_steps.items():
        gen.interrupted[r] = Interrupted(r, time.time(), "RuntimeError", "lost", step, step)
    return gen


def _decide(policy: ElasticPolicy, gen: Generation, ready: int):
    return policy.decide(gen.world_size, gen.failures, gen.interrupted, set(), 0.0, spares=ready)


def test_a_ready_spare_keeps_a_fixed_size_group_in_place_and_none_falls_back():
    policy = ElasticPolicy(3, 3)
    gen = _lost(3, 1, {0: 7, 2: 7})
    assert _decide(policy, gen, 0).action is ElasticAction.FALLBACK
    decision = _decide(policy, gen, 1)
    assert (decision.action, decision.spares) == (ElasticAction.RESIZE, 1)
    assert "spare" in decision.reason


def test_the_spare_takes_the_lost_rank_and_the_survivors_keep_theirs():
    gen = _lost(3, 1, {0: 7, 2: 8})  # rank 2's allreduce completed: one step ahead
    decision = _decide(ElasticPolicy(3, 3), gen, 1)
    failure = gen.failures[1]
    plan = spares.replace(gen, decision, failure, [5], generation=0, next_round=2, failures=1)
    assert plan.assignment == {0: 0, 5: 1, 2: 2}
    # Everyone resumes from the newest point, broadcast from the survivor holding it.
    assert {o.source_rank for o in plan.orders.values()} == {2}
    assert {o.snapshot_step for o in plan.orders.values()} == {8}
    assert plan.info["spare_ranks"] == [1]
    assert (plan.info["old_world_size"], plan.info["new_world_size"]) == (3, 3)


def test_the_book_follows_a_spare_from_start_to_promotion_or_loss():
    book = spares.SpareBook(1)
    assert spares.to_start(book, steady=True) == 1
    assert spares.to_start(book, steady=False) == 0
    spares.started(book, [3])
    assert spares.to_start(book, steady=True) == 0
    assert spares.spare_of(book, JoinReady(rank=3, time=0.0)) == 3
    assert spares.spare_of(book, JoinReady(rank=1, time=0.0)) is None
    spares.observe(book, Hello(rank=3, pid=4321, hostname="h"))
    assert book.pids == {3: 4321}
    assert book.ready_ids == []
    spares.observe(book, JoinReady(rank=3, time=0.0))
    assert book.ready_ids == [3]
    # A ready spare that dies: said and written; the next one starts at once.
    effects = spares.observe(book, Exited(rank=3, time=0.0, returncode=-9))
    assert 3 not in book and spares.to_start(book, steady=True) == 1
    said = [e.text for e in effects if isinstance(e, Say)]
    assert said and "spare 3 was killed by signal 9" in said[0]
    (written,) = [e.record for e in effects if isinstance(e, Write)]
    assert (written.action, written.spare) == ("lost", 3)


def test_spares_that_die_before_they_are_ready_back_off():
    book = spares.SpareBook(1)
    for n in range(1, 4):
        spares.started(book, [10 + n])
        spares.observe(book, Exited(rank=10 + n, time=0.0, returncode=1))
        assert spares.to_start(book, steady=True) == 0  # not at once: no crash loop
        assert book.retry_at - time.monotonic() == pytest.approx(2.0 ** (n - 1), abs=0.5)
