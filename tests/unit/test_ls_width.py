"""``ringtrain ls`` at 80 columns cuts a run's name only when the table has no room for it
(issue 40: "w_2026…-28_16-54-15" beside a last column of "x=1")."""

from __future__ import annotations

import io

from rich.console import Console

from ringtrain.monitor.records import RunSummary
from ringtrain.monitor.render import render_runs

NAME = "train_fn_2026-11-28_16-54-15"  # a default name: the function and its start time


def _ls(metrics: dict, width: int = 80, spares: int = 0) -> list[str]:
    run = RunSummary(
        name=NAME,
        path=f"runs/{NAME}",
        status="FINISHED",
        start_time=0.0,
        duration_s=3.5,
        world_size=2,
        metrics=metrics,
        num_checkpoints=0,
        rounds=1,
        error=None,
        spares=spares,
    )
    out = io.StringIO()
    render_runs([run], Console(file=out, width=width, color_system=None))
    return out.getvalue().splitlines()


def test_a_name_is_whole_when_the_metrics_leave_room():
    (row,) = [line for line in _ls({"x": 1}) if "FINISHED" in line]
    assert row.startswith(NAME + " ") and row.rstrip().endswith("x=1"), row


def test_long_metrics_still_get_their_room_and_the_name_is_cut_in_the_middle():
    metrics = {f"metric_{i}": 0.123456 for i in range(8)}
    lines = _ls(metrics)
    (row,) = [line for line in lines if "FINISHED" in line]
    assert "…" in row.split()[0] and row.split()[0].endswith("16-54-15"), row
    assert "metric_0=0.1235" in row and max(len(line) for line in lines) <= 80, lines


def test_hot_spares_show_beside_the_world_size():
    for width in (80, 120):
        (row,) = [line for line in _ls({"x": 1}, width, spares=1) if "FINISHED" in line]
        assert " 2+1 " in row, row
        (plain,) = [line for line in _ls({"x": 1}, width) if "FINISHED" in line]
        assert " 2 " in plain and "+" not in plain, plain
