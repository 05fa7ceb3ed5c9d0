"""Silent data corruption on real gloo workers: a bit flipped on purpose in one rank's parameters
or optimizer state is caught by the replica check within ``replica_check_every`` steps, the run
rolls back to the newest checkpoint that passed a check and ends with exactly the parameters of
a run that was never corrupted. At W >= 3 the right rank is named at once (the minority); at
W = 2 both are suspects, and the re-run says whether it can tell (here it cannot: the flipped
parameter changed that rank's gradient, which the allreduce spread to the other replica before
the check). A rank that corrupts twice is excluded (elastic) or stops the run naming its rank
and host."""

from __future__ import annotations

import socket

import pytest
import torch

import integrity_workloads
import ringtrain as rt
from support import assert_bit_identical, read_events, run_job

pytestmark = pytest.mark.timeout(300)

CHECK_EVERY = 3
_clean: dict[int, dict] = {}


def _run(tmp_path, name, workers, inject=None, **config):
    out = tmp_path / f"{name}.pt"
    result = run_job(
        integrity_workloads.sdc_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=name,
        train_loop_config={"inject": inject, "out": str(out)},
        **{"replica_check_every": CHECK_EVERY, **config},
    )
    return result, out


def _clean_state(tmp_path_factory, workers: int) -> dict:
    if workers not in _clean:
        tmp = tmp_path_factory.mktemp(f"clean{workers}")
        result, out = _run(tmp, "clean", workers)
        assert result.status == "FINISHED"
        assert not [e for e in read_events(result.path) if e["type"] == "replica_mismatch"]
        _clean[workers] = torch.load(out, weights_only=True)
    return _clean[workers]


def _mismatches(result) -> list[dict]:
    return [e for e in read_events(result.path) if e["type"] == "replica_mismatch"]


@pytest.mark.parametrize(
    ("workers", "where"),
    [(2, "param"), (3, "param"), (4, "param"), (3, "optimizer")],  # the state is one fingerprint
)
def test_a_flipped_bit_is_caught_named_and_rolled_back_to_an_exact_end(
    tmp_path, tmp_path_factory, workers, where
):
    culprit, flip_step = workers - 1, 7
    result, out = _run(
        tmp_path, f"{where}{workers}", workers, {"rank": culprit, "where": where, "step": flip_step}
    )
    assert result.status == "FINISHED" and result.error is None
    assert_bit_identical(
        torch.load(out, weights_only=True), _clean_state(tmp_path_factory, workers)
    )
    events = _mismatches(result)
    first = events[0]
    assert first["check"] == "replica" and first["action"] == "rollback"
    assert 0 < first["step"] - flip_step <= CHECK_EVERY, first  # caught within N steps
    if workers >= 3:  # the minority is named at once
        assert (first["ranks"], first["named"]) == ([culprit], True)
    else:  # two replicas: both suspects; the re-run reaches that step and cannot tell either
        assert (sorted(first["ranks"]), first["named"]) == ([0, 1], False)
        rerun = [e for e in events if e["action"] in ("named", "unresolved")]
        assert [(e["action"], e["ranks"], e["step"]) for e in rerun] == [
            ("unresolved", [0, 1], first["step"])
        ]
    assert first["hosts"][first["ranks"].index(culprit)] == socket.gethostname()
    assert result.failures == []  # a rollback counts no failure against max_failures
    set_aside = [e for e in read_events(result.path) if e["type"] == "checkpoint_invalid"]
    assert set_aside, "the checkpoints after the last passed check were set aside"


def test_a_flip_after_the_last_periodic_check_is_caught_by_the_final_check(
    tmp_path, tmp_path_factory
):
    # 16 steps, checks at 3, 6, ..., 15: the flip at step 16 is seen only by the check of the
    # final state when the train function returns.
    result, out = _run(tmp_path, "last", 3, {"rank": 1, "where": "param", "step": 16})
    assert result.status == "FINISHED" and result.error is None
    first = _mismatches(result)[0]
    assert (first["step"], first["ranks"], first["action"]) == (16, [1], "rollback"), first
    assert_bit_identical(torch.load(out, weights_only=True), _clean_state(tmp_path_factory, 3))


def test_a_rank_that_corrupts_every_step_stops_the_run_naming_it(tmp_path):
    with pytest.raises(rt.TrainingFailedError) as failed:
        _run(tmp_path, "faulty", 3, {"rank": 2, "where": "param", "step": 4, "every": True})
    error = failed.value
    assert error.failures[-1].kind == "corruption" and error.failures[-1].rank == 2
    message = str(error)
    assert "rank 2 on " + socket.gethostname() in message and "a second time" in message
    events = read_events(str(tmp_path / "runs" / "faulty"))
    actions = [e["action"] for e in events if e["type"] == "replica_mismatch"]
    assert actions == ["rollback", "fail"], actions


def test_two_replicas_that_corrupt_again_stop_the_run_naming_both(tmp_path):
    with pytest.raises(rt.TrainingFailedError) as failed:
        _run(tmp_path, "faulty2", 2, {"rank": 1, "where": "param", "step": 4, "every": True})
    message = str(failed.value)
    assert "one of rank 0 on" in message and "rank 1 on" in message and "again" in message


def test_an_elastic_run_excludes_a_rank_caught_twice_and_finishes(tmp_path):
    result, _ = _run(
        tmp_path,
        "exclude",
        (2, 3),
        {"rank": 2, "where": "param", "step": 4, "every": True},
        elastic_grow_after_s=None,
    )
    assert result.status == "FINISHED"
    actions = [e["action"] for e in _mismatches(result)]
    assert actions == ["rollback", "exclude"], actions
    starts = [e for e in read_events(result.path) if e["type"] == "run_start"]
    assert starts[-1]["world_size"] == 2


def test_bad_settings_are_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="replica_check_every must be >= 0"):
        rt.FailureConfig(replica_check_every=-1)
    with pytest.raises(TypeError, match="replay_check_every must be an int"):
        rt.FailureConfig(replay_check_every=1.5)


def test_a_layout_without_replicas_is_refused_when_the_model_is_prepared(tmp_path):
    with pytest.raises(rt.TrainingFailedError) as failed:
        run_job(
            integrity_workloads.fsdp_fn,
            2,
            storage_path=tmp_path / "runs",
            name="fsdp",
            replica_check_every=1,
        )
    root = failed.value.failures[-1]
    assert root.exc_type == "ValueError" and "has none: FSDP" in root.message
    assert "dp_replicate=R" in root.message and "replay_check_every" in root.message


REPLAY_EVERY = 2


def _replay_run(tmp_path, name, workers, inject=None, **config):
    """The replay check alone (no replica check)."""
    return _run(
        tmp_path,
        name,
        workers,
        inject,
        replica_check_every=0,
        replay_check_every=REPLAY_EVERY,
        **config,
    )


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_a_gradient_flip_the_replica_check_cannot_see_is_caught_by_the_replay(
    tmp_path, tmp_path_factory, workers
):
    # Step 4 is a replay step, where every rank's step is replayed by the next rank in the
    # ring; the flip armed after step 3 corrupts the last rank's backward of step 4.
    culprit = workers - 1
    inject = {"rank": culprit, "where": "gradient", "step": 3}
    result, out = _replay_run(tmp_path, f"grad{workers}", workers, inject)
    assert result.status == "FINISHED"
    assert_bit_identical(
        torch.load(out, weights_only=True), _clean_state(tmp_path_factory, workers)
    )
    [first, *_] = _mismatches(result)
    assert (first["check"], first["step"], first["action"]) == ("replay", 4, "rollback")
    # A transient flip: the pair (culprit, its replayer) disagrees, and either may be wrong.
    assert (first["ranks"], first["named"]) == (sorted([culprit, 0]), False)


def test_a_rank_whose_gradient_is_always_wrong_is_named_and_stops_the_run(tmp_path):
    inject = {"rank": 1, "where": "gradient", "step": 2, "every": True}
    with pytest.raises(rt.TrainingFailedError) as failed:
        _replay_run(tmp_path, "faulty_grad", 3, inject)
    events = read_events(str(tmp_path / "runs" / "faulty_grad"), "replica_mismatch")
    assert [(e["check"], e["ranks"], e["action"]) for e in events] == [
        ("replay", [1], "rollback"),
        ("replay", [1], "fail"),
    ]
    assert "rank 1 on " in str(failed.value)
    # Its record and its replay of rank 0 both disagree: named at the first replay step.
    assert events[0]["step"] - 2 <= REPLAY_EVERY


def test_clean_runs_with_both_checks_every_step_raise_no_false_positive(tmp_path):
    result, _ = _run(tmp_path, "clean_both", 3, replay_check_every=1)
    assert result.status == "FINISHED" and _mismatches(result) == []


def test_hsdp_replicas_along_dp_replicate_are_checked_and_rolled_back_exactly(tmp_path):
    """HSDP 2x2: the replicas of a shard are the ranks along ``dp_replicate`` ({0, 2}, {1, 3});
    a flip in rank 3's shard makes {1, 3} disagree (two replicas: suspects), and the run ends
    with the full parameters of a clean run."""
    mesh = rt.ParallelConfig(dp_replicate=2, dp_shard=2)
    outs = {}
    for name, inject in (("clean", None), ("flip", {"rank": 3, "where": "param", "step": 5})):
        out = tmp_path / f"{name}.pt"
        result = run_job(
            integrity_workloads.hsdp_sdc_fn,
            4,
            storage_path=tmp_path / "runs",
            name=f"hsdp_{name}",
            train_loop_config={"inject": inject, "out": str(out)},
            replica_check_every=CHECK_EVERY,
            parallel=mesh,
        )
        assert result.status == "FINISHED"
        outs[name] = (torch.load(out, weights_only=True), _mismatches(result))
    (clean, none), (flipped, found) = outs["clean"], outs["flip"]
    assert none == [] and found, "the flip was caught, the clean run raised nothing"
    assert (sorted(found[0]["ranks"]), found[0]["named"]) == ([1, 3], False)
    assert clean["step"] == flipped["step"]
    for key, value in clean["model"].items():
        assert torch.equal(value, flipped["model"][key]), key


@pytest.mark.parametrize("islands", [False, True])
def test_diloco_global_state_is_checked_across_replicas_and_rolled_back_exactly(tmp_path, islands):
    """Under DiLoCo the replicas' local parameters differ by design: the check compares the
    global parameters and outer optimizer state over every rank (and, with islands, the local
    state inside each island). A clean run raises nothing; a flip in rank 2's global parameters
    between syncs is caught, rank 2 named, and every rank ends as in the clean run."""
    from diloco_workloads import assert_states_equal, run_diloco

    job = {"replica_check_every": 2}
    if islands:  # 2 islands of 2 workers: DDP inside, DiLoCo across
        job["parallel"] = rt.ParallelConfig(dp_replicate=2, dp_shard=2)
    workers = 4 if islands else 3
    config = {"diloco": {"sync_every": 4}}
    clean, clean_states = run_diloco(tmp_path, "clean", workers, epochs=2, job=job, **config)
    assert _mismatches(clean) == []
    inject = {"rank": 2, "where": "global", "step": 5}
    flipped, states = run_diloco(
        tmp_path, "flip", workers, epochs=2, job=job, inject=inject, **config
    )
    first = _mismatches(flipped)[0]
    assert (first["step"], first["action"]) == (6, "rollback"), first
    assert (first["ranks"], first["named"]) == ([2], True), first
    assert_states_equal(clean_states, states, "after the rollback")
