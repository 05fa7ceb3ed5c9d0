"""Preemption with zero lost steps, on real worker processes over gloo (issue 19).

Each test runs ``workloads.exact_fn`` (dropout, NumPy and Python noise, momentum SGD, StepLR, a
checkpoint every 4 steps) with a notice raised from inside the run at a random step (the seed is
in every failure message; rerun one with ``RINGTRAIN_TEST_SEED``): the run ends ``PREEMPTED``
with the state of the step reached saved, no failure counted, and running it again finishes with
exactly the parameters of an uninterrupted run. One launch checks several facts.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

import preempt_workloads
from ringtrain.preemption import FileNotice
from support import assert_bit_identical, read_events, run_job

SHARES_RUNS = True  # its tests share cached runs: one pytest worker runs them all (conftest)

pytestmark = pytest.mark.timeout(240)

SEED = int(os.environ.get("RINGTRAIN_TEST_SEED", random.randrange(2**16)))
RNG = random.Random(SEED)
EPOCHS = 2
_baselines: dict[int, dict] = {}


def _config(tmp_path, name, **notice) -> dict:
    return {
        "epochs": EPOCHS,
        "out": str(tmp_path / f"{name}.pt"),
        "kill": None,
        "kill_rank": 0,
        "marker": str(tmp_path / f"{name}.marker"),
        "driver_pid": os.getpid(),  # fit() runs in this process (the workers' parent is the pool's)
        **notice,
    }


def _baseline(tmp_path_factory, workers: int) -> dict:
    if workers not in _baselines:
        tmp = tmp_path_factory.mktemp(f"baseline{workers}")
        config = _config(tmp, "baseline")
        result = run_job(
            preempt_workloads.preempt_fn,
            workers,
            storage_path=tmp / "runs",
            name="baseline",
            train_loop_config=config,
        )
        assert result.status == "FINISHED"
        _baselines[workers] = torch.load(config["out"], weights_only=True)
    return _baselines[workers]


def _run(tmp_path, name, workers, config, **job):
    return run_job(
        preempt_workloads.preempt_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=name,
        train_loop_config=config,
        **job,
    )


def _trail(run_path) -> str:
    """The run's events without timing windows, one per line: what a failure message shows."""
    skip = {"timing", "heartbeat"}
    lines = []
    for e in read_events(run_path):
        if e["type"] in skip:
            continue
        fields = {k: v for k, v in e.items() if k not in ("type", "time", "traceback")}
        lines.append(f"  {e['type']}: {fields}")
    return "events:\n" + "\n".join(lines)


def _check_saved_at_the_step_reached(run_path, result, why):
    """The run ended PREEMPTED with its checkpoint at the stop step: the preemption round,
    published and verified like any other, newer than every periodic one."""
    why = f"{why}\n{_trail(run_path)}"
    assert (result.status, result.preemptions, result.failures) == ("PREEMPTED", 1, []), why
    with open(os.path.join(run_path, "result.json")) as f:
        saved = json.load(f)
    assert (saved["status"], saved["preemptions"]) == ("PREEMPTED", 1), why
    (event,) = read_events(run_path, "preemption_saved")
    step = event["step"]
    assert result.checkpoint.path.endswith(f"checkpoint_{event['round']:06d}"), why
    assert result.metrics["preempted_step"] == step, why
    state = torch.load(
        os.path.join(result.checkpoint.path, "train_state.pt"),
        weights_only=True,
        map_location="cpu",
    )
    assert state["step"] == step, why
    return event


@pytest.mark.parametrize(
    ("workers", "how"),
    [
        (2, "driver-SIGTERM"),
        (3, "driver-SIGUSR1"),
        (2, "workers-SIGTERM"),
    ],
)
def test_a_notice_loses_no_step(tmp_path, tmp_path_factory, workers, how):
    """SIGTERM or SIGUSR1 to the driver at a random step, or SIGTERM to every worker's process
    group (sent by a ``kill`` process: a node going away): PREEMPTED at the step reached, no
    failure counted, and the resumed run is bit-identical to an uninterrupted one. The W=3
    case raises its notice while a checkpoint is being written in the background."""
    step = RNG.randrange(2, 12)
    notice = {"how": how}
    if workers == 3:
        notice["notice_round"] = RNG.randrange(0, 3)  # during that round's background write
    else:
        notice["notice_step"] = step
    if how == "workers-SIGTERM":
        (tmp_path / "pids").mkdir()
        notice["pid_dir"] = str(tmp_path / "pids")
    why = f"(RINGTRAIN_TEST_SEED={SEED}, {how} at {notice}, W={workers})"
    config = _config(tmp_path, "run", **notice)
    first = _run(tmp_path, "run", workers, config)
    event = _check_saved_at_the_step_reached(tmp_path / "runs" / "run", first, why)
    (notice_event,) = read_events(tmp_path / "runs" / "run", "preemption")
    source = "worker-signal" if how == "workers-SIGTERM" else "signal"
    assert notice_event["source"] == source, why
    if "notice_step" in notice:
        assert event["step"] > step, why
    second = _run(tmp_path, "run", workers, config)
    final = torch.load(config["out"], weights_only=True)
    assert (second.status, second.failures, second.preemptions) == ("FINISHED", [], 0), why
    assert_bit_identical(final, _baseline(tmp_path_factory, workers))


def test_a_file_notice_with_too_short_a_grace_keeps_the_previous_checkpoint(
    tmp_path, tmp_path_factory
):
    """A user source (a file that appears) with a grace the save cannot meet (every step after
    the notice takes 1 s on rank 0): the group is killed at the deadline, an event says what
    was not written, the previous checkpoint stays the one to resume from (nothing half
    published), and the resumed run is still bit-identical."""
    step = RNG.randrange(5, 12)
    notice_file = tmp_path / "preempt-now"
    config = _config(
        tmp_path, "short", how="file", notice_step=step, notice_file=str(notice_file), slow_s=1.0
    )
    why = f"(RINGTRAIN_TEST_SEED={SEED}, file notice at step {step})"
    source = FileNotice(notice_file, interval_s=0.05)
    job = {"preemption_grace_s": 0.5, "notice_sources": [source]}
    first = _run(tmp_path, "short", 2, config, **job)
    run_path = tmp_path / "runs" / "short"
    assert (first.status, first.preemptions, first.failures) == ("PREEMPTED", 1, []), why
    (notice_event,) = read_events(run_path, "preemption")
    assert (notice_event["source"], notice_event["reason"]) == ("file", "the file says so"), why
    (incomplete,) = read_events(run_path, "preemption_incomplete")
    assert "the preemption deadline passed" in incomplete["reason"], why
    assert incomplete["checkpoint"] == first.checkpoint.uri, why
    assert read_events(run_path, "preemption_saved") == [], why
    assert (
        "preempted_step"
        not in json.loads(
            (run_path / os.path.basename(first.checkpoint.path) / "manifest.json").read_text()
        )["metrics"]
    ), why
    notice_file.unlink()  # the cloud stops saying so once the instance is replaced
    second = _run(tmp_path, "short", 2, config, **job)
    resumed = [e["checkpoint"] for e in read_events(run_path, "resume")]
    assert resumed == [first.checkpoint.uri], why
    assert second.status == "FINISHED", why
    final = torch.load(config["out"], weights_only=True)
    assert_bit_identical(final, _baseline(tmp_path_factory, 2))


@pytest.mark.parametrize("how", ["once", "jump"])
def test_a_rank_that_sets_the_step_alone_fails_with_a_clear_error_not_a_hang(tmp_path, how):
    """Setting ``TrainState.step`` joins the preemption agreement, a collective of every rank.
    At W=3, rank 1 sets it while ranks 0 and 2 do not (``once``): the run fails with rank 1's
    StepAgreementError naming the step, within the agreement's timeout (half of
    worker_timeout_s: before the driver's hang detection blames a rank stuck behind it, and far
    within the collective timeout of 2 * 20 + 10 s), instead of the deadlock it was (the flag
    allreduce paired with DDP's gradient allreduce). Rank 1 adds 2 per batch where the others
    add 1 (``jump``): every rank fails with it at the next boundary (the steps are compared)."""
    import ringtrain as rt

    first_set = tmp_path / "first_set"
    with pytest.raises(rt.TrainingFailedError) as failed:
        run_job(
            preempt_workloads.uneven_step_fn,
            3,
            storage_path=tmp_path / "runs",
            name=f"uneven-{how}",
            train_loop_config={"how": how, "setter": 1, "first_set": str(first_set)},
            worker_timeout_s=20.0,
        )
    root = failed.value.failures[-1]
    assert root.exc_type == "StepAgreementError", root.message
    assert "TrainState.step" in root.message and "every rank must set it" in root.message
    if how == "once":
        assert root.rank == 1 and "set TrainState.step to 1" in root.message
        assert "did not within 10 s" in root.message
        waited = root.time - float(first_set.read_text())
        assert waited < 2 * 20.0 + 10, f"failed {waited:.1f} s after the step was set"
    else:  # at the first boundary that reads an agreement: steps 1 and 2 met
        assert "differs across ranks (from 1 to 2 at the same boundary)" in root.message
