"""Step timing and straggler detection in real worker processes talking over gloo."""

from __future__ import annotations

import json
import os

import pytest

import ringtrain as rt
import workloads
from ringtrain.monitor.timing import PARTS
from ringtrain.trainer import run_workers
from support import run_job


def _events(result, type_):
    with open(os.path.join(result.path, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e["type"] == type_]


class Recorder:
    def __init__(self):
        self.timing, self.stragglers, self.rounds = [], [], []

    def on_timing(self, rank, window):
        self.timing.append((rank, window))

    def on_straggler(self, event):
        self.stragglers.append(event)

    def on_round(self, round_, metrics):
        self.rounds.append((round_, metrics))


def _fit(tmp_path, config, monitor=None, callbacks=(), name="run", n=2):
    return run_job(
        workloads.timed_fn,
        n,
        storage_path=tmp_path,
        name=name,
        progress="plain",
        callbacks=list(callbacks),
        monitor_config=monitor or rt.MonitorConfig(timing_interval_s=0.3),
        train_loop_config=config,
    )


@pytest.mark.parametrize("comm_timing", ["wait", "hook"])
def test_timing_windows_measure_each_part_of_every_rank(tmp_path, comm_timing):
    # 48 samples, 2 ranks, batches of 4: 6 steps per epoch per rank, 2 epochs.
    data_delay, forward_delay = 0.004, 0.02
    recorder = Recorder()
    result = _fit(
        tmp_path,
        {"epochs": 2, "data_delay_s": data_delay, "forward_delay_s": forward_delay},
        # Identical ranks, but their busy time is mostly 5 short sleeps per step, which a loaded
        # machine stretches by different amounts on each rank: measured under load, windows of
        # one rank were 1.22x the other's twice in a row, a flag at the default 20 % margin. A
        # 2x margin still catches a false flag of identical ranks; the 20 % rule itself is
        # tested on exact windows in test_timing.py, and on a real slow rank below.
        monitor=rt.MonitorConfig(
            timing_interval_s=0.3, comm_timing=comm_timing, straggler_threshold=1.0
        ),
        callbacks=[recorder],
    )
    windows = _events(result, "timing")
    assert {w["rank"] for w in windows} == {0, 1}
    n_params = sum(p.numel() for p in workloads.make_model().parameters())
    for rank in (0, 1):
        mine = [w for w in windows if w["rank"] == rank]
        assert sum(w["steps"] for w in mine) == 12  # every step, none twice, no phantom steps
        assert mine[-1]["step"] == 12
        assert sum(w["samples"] for w in mine) == 48
        for w in mine:
            measured = sum(w[p] for p in PARTS if p != "other_s")
            assert measured <= w["step_s_mean"] * (1 + 1e-9), w  # disjoint parts
            assert sum(w[p] for p in PARTS) == pytest.approx(w["step_s_mean"])
            assert w["data_s"] >= 4 * data_delay  # a batch of 4 samples, each delayed
            assert w["compute_s"] >= forward_delay
            assert w["comm_bytes"] == 4 * n_params  # DDP's allreduce of every float32 gradient
            # Exposed: from the last gradient to the end of communication, which also holds
            # DDP's copy of the last bucket before its launch: not bounded by comm_s.
            assert w["comm_s"] > 0 and w["comm_exposed_s"] > 0
            if comm_timing == "wait":  # no hook: only the wait is seen
                assert w["comm_s"] == pytest.approx(w["comm_exposed_s"])
            assert w["busy_s"] == pytest.approx(w["step_s_mean"] - w["comm_exposed_s"])
            assert w["samples_per_s"] > 0 and w["rss_bytes"] > 10 * 2**20
    # The same windows reached the callbacks, and every round the on_round hook.
    assert sorted(r for r, _ in recorder.timing) == sorted(w["rank"] for w in windows)
    assert [r for r, _ in recorder.rounds] == [0, 1]
    assert recorder.stragglers == []  # identical ranks: nobody is a straggler


def test_a_rank_that_sleeps_each_step_is_flagged_as_a_straggler(tmp_path, capsys):
    recorder = Recorder()
    result = _fit(
        tmp_path,
        {"epochs": 6, "slow_rank": 1, "slow_s": 0.03},
        monitor=rt.MonitorConfig(timing_interval_s=0.2, straggler_patience=2),
        callbacks=[recorder],
    )
    flagged = _events(result, "straggler")
    assert [e["rank"] for e in flagged] == [1]
    assert flagged[0]["reason"] == "other"  # it sleeps in its own code, not in data or model
    assert flagged[0]["ratio"] > 1.2
    assert [(e.rank, e.flagged, e.reason) for e in recorder.stragglers] == [(1, True, "other")]
    # The fast rank waits for it inside the allreduce: exposed communication, not busy time.
    windows = _events(result, "timing")
    fast = [w for w in windows if w["rank"] == 0]
    waited = sum(w["comm_exposed_s"] * w["steps"] for w in fast)
    worked = sum(w["busy_s"] * w["steps"] for w in fast)
    assert waited > worked, (waited, worked)
    assert "rank 1 is a straggler" in capsys.readouterr().out


def test_timing_off_sends_no_windows_and_flags_nobody(tmp_path):
    result = _fit(
        tmp_path,
        {"epochs": 1, "slow_rank": 1, "slow_s": 0.03},
        monitor=rt.MonitorConfig(timing=False),
    )
    assert result.error is None
    assert _events(result, "timing") == [] and _events(result, "straggler") == []


def test_max_steps_stops_every_worker_cleanly(tmp_path):
    result = run_workers(
        name="limited",
        entrypoint="timed_fn",
        scaling_config=rt.ScalingConfig(num_workers=2),
        run_config=rt.RunConfig(storage_path=str(tmp_path), name="limited", progress="off"),
        payload=__import__("cloudpickle").dumps((workloads.timed_fn, {"epochs": 5})),
        max_steps=8,  # 6 steps per epoch: stops inside the second epoch
    )
    assert result.error is None
    with open(os.path.join(result.path, "result.json")) as f:
        assert json.load(f)["status"] == "FINISHED"
    windows = _events(result, "timing")
    for rank in (0, 1):
        assert max(w["step"] for w in windows if w["rank"] == rank) == 8
    assert len(result.metrics_history) == 1  # only the first epoch's report was reached
