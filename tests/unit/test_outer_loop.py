"""DiLoCo's outer loop as the monitoring sees it (issue 41, observability): the step timer's
window figures from the counters the DiLoCo plug-in reports, their sums over a rank's windows
(the dashboard's and ``ringtrain bench``'s input), and rank 0's count reaching
``Result.outer_steps`` and ``result.json``. The real run: tests/multiprocess/test_diloco.py."""

from __future__ import annotations

import json
import math

import pytest

from fakes import FakeLauncher
from fakes import make_controller as _controller
from ringtrain.monitor import timing
from ringtrain.monitor.outer_loop import OUTER_FIELDS, outer_by_rank, summarize_outer
from ringtrain.rundir.run_records import ResultRecord
from ringtrain.wire.channel import Done, Exited, Hello, Report, Timing


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _steps(timer: timing.StepTimer, clock: Clock, outer: list[tuple[float, int, int, int]]):
    """One 1-second step per item of ``outer``: (seconds, bytes, exchanges, outer steps) that
    the outer loop reports in it (seconds < 0: no report, a step between syncs)."""
    for seconds, nbytes, exchanges, count in outer:
        timer.loader_fetch_start()
        timer.loader_fetch_end(8)
        if seconds >= 0:
            timer.outer_sync_done(seconds, nbytes, exchanges, count)
        clock.t += 1.0
    timer.loader_exhausted()


def test_windows_carry_bytes_per_inner_step_sync_seconds_and_the_count(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing, "_now", clock)
    timer = timing.StepTimer()
    # H = 4: three quiet inner steps (0 bytes, 1 ms each), then a sync (4000 bytes, 0.25 s)
    quiet = (0.001, 0, 0, 0)
    _steps(timer, clock, [quiet, quiet, quiet, (0.25, 4000, 1, 1)])
    window = timer.take_window()
    assert window is not None and window["steps"] == 4
    assert window["outer_bytes"] == 1000.0  # bytes per inner step
    assert window["outer_sync_s"] == pytest.approx(0.253)
    assert window["outer_sync_frac"] == pytest.approx(0.253 / 4.0)
    assert (window["outer_exchanges"], window["outer_steps"]) == (1, 1)
    # the next window: the count is the rank's running total (a resumed rank's included)
    _steps(timer, clock, [(0.0, 0, 0, 7), (0.5, 2000, 1, 8)])
    window = timer.take_window()
    assert window is not None
    assert (window["outer_bytes"], window["outer_steps"], window["outer_exchanges"]) == (
        1000.0,
        8,
        1,
    )
    assert window["outer_sync_frac"] == pytest.approx(0.25)


def test_windows_of_a_run_without_diloco_have_no_outer_fields(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(timing, "_now", clock)
    timer = timing.StepTimer()
    _steps(timer, clock, [(-1.0, 0, 0, 0)] * 3)
    window = timer.take_window()
    assert window is not None and window["steps"] == 3
    assert not set(OUTER_FIELDS) & set(window)


def _window(rank: int, steps: int, outer_bytes: float, sync_s: float, count: int) -> dict:
    return {
        "rank": rank,
        "steps": steps,
        "window_s": steps * 0.1,
        "outer_bytes": outer_bytes,
        "outer_sync_s": sync_s,
        "outer_exchanges": count,
        "outer_steps": count,
    }


def test_sums_over_a_ranks_windows_are_step_weighted():
    windows = [
        _window(0, 10, 400.0, 0.2, 2),  # 4000 bytes
        {"rank": 0, "steps": 5, "window_s": 0.5, "step_s": 0.1},  # before DiLoCo's first step
        _window(0, 30, 100.0, 0.4, 3),  # 3000 bytes
        _window(1, 40, 175.0, 1.0, 5),
        {"rank": 1, "steps": 0, "outer_bytes": 1e9, "outer_sync_s": 9.0},  # no steps: left out
        {"rank": 1, "steps": 3, "outer_bytes": math.nan, "outer_sync_s": 1.0},  # not a number
        {"rank": True, "steps": 3, "outer_bytes": 1.0, "outer_sync_s": 1.0},  # not a rank
    ]
    figures = outer_by_rank(windows)
    assert sorted(figures) == [0, 1]
    zero = figures[0]
    assert zero.steps == 40 and zero.bytes_per_step == pytest.approx(7000 / 40)
    assert zero.sync_s == pytest.approx(0.6) and zero.sync_s_per_step == pytest.approx(0.6 / 40)
    assert zero.sync_frac == pytest.approx(0.6 / 4.0)
    assert (zero.exchanges, zero.outer_steps) == (5, 3)  # the last window's count
    assert figures[1].bytes_per_step == pytest.approx(175.0)
    assert json.loads(json.dumps(zero.to_dict()))["outer_steps"] == 3


def test_windows_without_outer_fields_give_nothing():
    assert summarize_outer([{"rank": 0, "steps": 5, "window_s": 1.0}]) is None
    assert summarize_outer([]) is None
    assert outer_by_rank([{"rank": 0, "steps": 5, "step_s": 0.1}]) == {}


def test_result_json_keeps_the_count_and_older_files_read_none():
    record = ResultRecord(status="FINISHED", outer_steps=5)
    assert ResultRecord.from_json(json.loads(json.dumps(record.to_json()))).outer_steps == 5
    assert "outer_steps" not in ResultRecord(status="FINISHED").to_json()  # not DiLoCo
    old = ResultRecord.from_json({"status": "FINISHED", "preemptions": 0})
    assert old is not None and old.outer_steps is None


def _timing(rank: int, outer_steps: int | None) -> Timing:
    window = {"steps": 4, "step": 4, "step_s": 0.01, "busy_s": 0.01}
    if outer_steps is not None:
        window["outer_steps"] = outer_steps
    return Timing(rank=rank, time=1.0, window=window)


@pytest.mark.parametrize(("windows", "expected"), [((3, 9), 3), ((None, None), None)])
def test_result_outer_steps_is_rank_0s_latest_count(tmp_path, windows, expected):
    zero, one = windows
    launcher = FakeLauncher(
        [
            [
                [Hello(0, 10, "h"), Hello(1, 11, "h")],
                [_timing(0, None if zero is None else zero - 1), _timing(1, one)],
                [_timing(0, zero)],
                [Report(rank=0, round=0, time=1.0, metrics={}), Report(1, 0, 1.0, {})],
                [Done(0, 2.0, 1), Done(1, 2.0, 1), Exited(0, 2.0, 0), Exited(1, 2.0, 0)],
            ]
        ]
    )
    ctl = _controller(tmp_path, launcher)
    result = ctl.run()
    assert result.outer_steps == expected
    written = json.loads((tmp_path / "run" / "result.json").read_text())
    assert written.get("outer_steps") == expected
