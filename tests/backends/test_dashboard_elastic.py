"""Elastic resizes in ``ringtrain show`` and the dashboard (issue 8, requirement 4).

Run directories are written here by hand the way the driver writes them (``resize`` and
``resize_fallback`` events, docs/run-directory.md): the data layer over real files, the
``ringtrain show`` command as a real process, the page in a real browser (Debian's Chromium
driven by Playwright), and one real elastic run (a worker killed by SIGKILL) read back.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

import ringtrain as rt
import workloads
from pages import WAIT_MS, Page, needs_browser, screenshot
from ringtrain.monitor import render, runs
from ringtrain.monitor.dashboard.data import Cursors, RunStore
from ringtrain.monitor.runs import WorldSizeChange
from test_dashboard import (
    RINGTRAIN,
    T0,
    append_events,
    round_events,
    serve,
    write_json,
)

EN_DASH = "\u2013"  # the page writes ranges as 2\u20133

KILL_1 = {
    "type": "resize",
    "time": T0 + 12.46,
    "old_world_size": 3,
    "new_world_size": 2,
    "cause": "rank 1 was killed by SIGKILL",
    "generation": 1,
    "snapshot_step": 5,
    "steps_rolled_back": 2,
    "failure_time": T0 + 12.0,
    "resume_s": 0.46,
}
GROW = {  # grow-back: no failure behind it
    "type": "resize",
    "time": T0 + 25.0,
    "old_world_size": 2,
    "new_world_size": 3,
    "cause": "capacity returned",
    "generation": 2,
    "snapshot_step": 9,
    "steps_rolled_back": 0,
    "failure_time": None,
    "resume_s": None,
}
KILL_2 = KILL_1 | {
    "time": T0 + 41.5,
    "cause": "rank 2 was killed by SIGKILL",
    "generation": 3,
    "snapshot_step": 14,
    "steps_rolled_back": 1,
    "failure_time": T0 + 40.0,
    "resume_s": 1.5,
}
FALLBACK = {
    "type": "resize_fallback",
    "time": T0 + 50.0,
    "reason": "1 worker left, fewer than min_workers=2",
}


def failure(rank: int, t: float) -> dict[str, Any]:
    return {
        "type": "failure",
        "time": t,
        "rank": rank,
        "kind": "signal",
        "message": f"rank {rank} was killed by SIGKILL",
        "traceback": None,
        "attempt": 0,
    }


def make_elastic_run(
    storage: Path, name: str = "elastic", *, status: str = "FINISHED", result_world_size: int = 2
) -> Path:
    """An elastic run (2-3 workers): 3 -> 2 (rank 1 killed) -> 3 (capacity returned) -> 2 (rank 2
    killed), then a fallback to a restart from disk with 2 workers."""
    run_dir = storage / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(
        json.dumps(
            {
                "name": name,
                "created": T0,
                "scaling_config": {"num_workers": [2, 3], "backend": "local"},
                "train_loop_config": {"lr": 0.1},
            }
        )
    )
    events: list[dict[str, Any]] = [
        {"type": "run_start", "time": T0, "world_size": 3, "attempt": 0}
    ]
    events += round_events(0, 3, T0 + 5.0) + round_events(1, 3, T0 + 10.0)
    events += [failure(1, T0 + 12.0), KILL_1]
    events += round_events(2, 2, T0 + 15.0) + round_events(3, 2, T0 + 20.0)
    events += [GROW, *round_events(4, 3, T0 + 30.0), *round_events(5, 3, T0 + 35.0)]
    events += [failure(2, T0 + 40.0), KILL_2, *round_events(6, 2, T0 + 45.0)]
    events += [
        failure(1, T0 + 49.0),
        FALLBACK,
        {"type": "run_start", "time": T0 + 51.0, "world_size": 2, "attempt": 1},
    ]
    events += round_events(7, 2, T0 + 55.0, attempt=1)
    if status != "RUNNING":
        events.append({"type": "run_end", "time": T0 + 60.0, "status": status, "duration_s": 60})
    append_events(run_dir, events)
    write_json(
        run_dir / "result.json",
        {
            "status": status,
            "name": name,
            "path": str(run_dir),
            "driver_pid": os.getpid(),
            "start_time": T0,
            "end_time": None if status == "RUNNING" else T0 + 60.0,
            "duration_s": 60.0,
            "world_size": result_world_size,
            "rounds": 8,
            "metrics": {"loss": 0.125},
            "error": None,
            "failures": [],
        },
    )
    return run_dir


# --------------------------------------------------------------------------------------------
# The data layer
# --------------------------------------------------------------------------------------------


def test_elastic_history_from_events_file(tmp_path: Path) -> None:
    run_dir = make_elastic_run(tmp_path)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    resizes, sizes = runs.elastic_history(events)

    assert [r.kind for r in resizes] == ["resize", "resize", "resize", "fallback"]
    first = resizes[0]
    assert (first.old_world_size, first.new_world_size) == (3, 2)
    assert first.cause == "rank 1 was killed by SIGKILL"
    assert (first.generation, first.snapshot_step, first.steps_rolled_back) == (1, 5, 2)
    assert first.failure_time == T0 + 12.0 and first.time == T0 + 12.46
    assert first.resume_s == pytest.approx(0.46)
    grow = resizes[1]
    assert (grow.old_world_size, grow.new_world_size, grow.cause) == (2, 3, "capacity returned")
    assert grow.resume_s is None and grow.failure_time is None
    assert resizes[3].cause == FALLBACK["reason"] and resizes[3].new_world_size is None

    # A shrink counts from the death, a grow-back (no failure) from its event's time.
    assert sizes == [
        WorldSizeChange(T0, 3, "run_start"),
        WorldSizeChange(T0 + 12.0, 2, "resize"),
        WorldSizeChange(T0 + 25.0, 3, "resize"),
        WorldSizeChange(T0 + 40.0, 2, "resize"),
        WorldSizeChange(T0 + 51.0, 2, "run_start"),
    ]
    assert runs.departed_ranks(sizes) == {2: T0 + 40.0}
    assert runs.elastic_history([{"type": "run_start", "time": 1.0, "world_size": 4}]) == (
        [],
        [WorldSizeChange(1.0, 4, "run_start")],
    )


@pytest.mark.parametrize(
    ("sizes", "left"),
    [
        ([4], {}),
        ([4, 2], {2: 1.0, 3: 1.0}),
        ([4, 3, 2], {2: 2.0, 3: 1.0}),
        ([4, 2, 4], {}),  # grew back: everyone is in the group again
        ([4, 2, 3], {3: 1.0}),
        ([3, 2, 3, 1], {1: 3.0, 2: 3.0}),  # rank 2 left at 1, came back at 2, left again at 3
    ],
)
def test_departed_ranks(sizes: list[int], left: dict[int, float]) -> None:
    changes = [
        WorldSizeChange(float(i), n, "resize" if i else "run_start") for i, n in enumerate(sizes)
    ]
    assert runs.departed_ranks(changes) == left


def test_worker_range() -> None:
    assert runs.worker_range({"scaling_config": {"num_workers": [2, 4]}}) == (2, 4)
    assert runs.worker_range({"scaling_config": {"num_workers": 3}}) is None
    assert runs.worker_range({"scaling_config": {"num_workers": ["a", 4]}}) is None
    assert runs.worker_range({}) is None
    assert runs.worker_range(None) is None


def test_running_elastic_run_reports_the_current_world_size(tmp_path: Path) -> None:
    # result.json of a running run still says the world size it was written with.
    make_elastic_run(tmp_path, status="RUNNING", result_world_size=3)
    (summary,) = runs.list_runs(str(tmp_path))
    assert summary.status == "RUNNING" and summary.world_size == 2
    assert runs.load_run(str(tmp_path / "elastic")).summary.world_size == 2


def test_dashboard_api_elastic_fields(tmp_path: Path) -> None:
    make_elastic_run(tmp_path, status="RUNNING", result_world_size=3)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"scaling_config": {"num_workers": 2}}))
    append_events(plain, [{"type": "run_start", "time": T0, "world_size": 2, "attempt": 0}])
    store = RunStore(str(tmp_path))

    d = store.run("elastic", Cursors())
    assert d is not None
    assert d["summary"]["world_size"] == 2
    assert d["elastic"] == {"min_workers": 2, "max_workers": 3}
    assert [(c["time"], c["world_size"]) for c in d["world_sizes"]] == [
        (T0, 3),
        (T0 + 12.0, 2),
        (T0 + 25.0, 3),
        (T0 + 40.0, 2),
        (T0 + 51.0, 2),
    ]
    assert [(r["kind"], r["old_world_size"], r["new_world_size"]) for r in d["resizes"]] == [
        ("resize", 3, 2),
        ("resize", 2, 3),
        ("resize", 3, 2),
        ("fallback", None, None),
    ]
    assert d["resizes"][0]["resume_s"] == pytest.approx(0.46)
    assert d["left_ranks"] == [{"rank": 2, "time": T0 + 40.0}]
    kinds = [e["type"] for e in d["timeline"]["items"]]
    assert kinds.count("resize") == 3 and kinds.count("resize_fallback") == 1
    assert {r["name"]: r["world_size"] for r in store.list()["runs"]}["elastic"] == 2

    p = store.run("plain", Cursors())
    assert p is not None
    assert (p["elastic"], p["resizes"], p["left_ranks"]) == (None, [], [])
    assert p["world_sizes"] == [{"time": T0, "world_size": 2, "event": "run_start"}]


def test_a_resize_clears_straggler_flags(tmp_path: Path) -> None:
    run_dir = make_elastic_run(tmp_path, status="RUNNING")
    store = RunStore(str(tmp_path))
    flag = {"type": "straggler", "time": T0 + 56.0, "rank": 1, "attempt": 1, "reason": "data"}
    append_events(run_dir, [flag])
    d = store.run("elastic", Cursors())
    assert d is not None and [s["rank"] for s in d["stragglers"]] == [1]
    append_events(run_dir, [KILL_1 | {"time": T0 + 57.0, "old_world_size": 2}])
    d = store.run("elastic", Cursors(generation=d["generation"]))
    assert d is not None and d["stragglers"] == []  # ranks were renumbered


# --------------------------------------------------------------------------------------------
# ringtrain show
# --------------------------------------------------------------------------------------------


def test_show_lists_resizes(tmp_path: Path) -> None:
    run_dir = make_elastic_run(tmp_path)
    out = subprocess.run(
        [RINGTRAIN, "show", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "160", "NO_COLOR": "1"},
        check=True,
    ).stdout
    lines = [line.rstrip() for line in out.splitlines()]
    (workers,) = [line for line in lines if line.startswith("Workers")]
    assert workers.split(None, 1)[1] == "2 (elastic 2-3; 3 -> 2 -> 3 -> 2)"
    assert "Resizes (4)" in out
    table = lines[next(i for i, line in enumerate(lines) if "Resizes (4)" in line) :]
    rows = [line for line in table if "workers" in line or "restart from disk" in line]
    assert len(rows) == 4, out
    assert "3 -> 2 workers" in rows[0] and "rank 1 was killed by SIGKILL" in rows[0]
    assert "0.46 s" in rows[0] and "2 steps (to step 5)" in rows[0]
    assert "2 -> 3 workers" in rows[1] and "capacity returned" in rows[1]
    assert "0 steps (to step 9)" in rows[1]
    assert "1.50 s" in rows[2] and "1 step (to step 14)" in rows[2]
    assert "restart from disk" in rows[3] and "fewer than min_workers=2" in rows[3]

    # A run that is not elastic has no Resizes section.
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"scaling_config": {"num_workers": 2}}))
    append_events(plain, [{"type": "run_start", "time": T0, "world_size": 2, "attempt": 0}])
    console_out = _render(runs.load_run(str(plain)))
    assert "Resizes" not in console_out and "No resizes" not in console_out
    assert re.search(r"^Workers +2 *$", console_out, re.MULTILINE), console_out


def _render(details: runs.RunDetails) -> str:
    import io

    from rich.console import Console

    buf = io.StringIO()
    render.render_run(details, Console(file=buf, width=120, color_system=None))
    return buf.getvalue()


# --------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------


def cells(page: Page, selector: str) -> list[list[str]]:
    return page.eval_on_selector_all(
        selector, "rows => rows.map(r => [...r.cells].map(c => c.textContent))"
    )


@needs_browser
def test_page_shows_world_size_and_resizes(tmp_path: Path, page: Page) -> None:
    make_elastic_run(tmp_path)
    with serve(tmp_path) as server:
        page.goto(server.url + "#run=elastic")
        page.wait_for_function("() => window.rtDash.resizes === 4", timeout=WAIT_MS)
        assert (
            page.text_content('#run-facts [data-fact="workers"] dd') == f"2 (elastic 2{EN_DASH}3)"
        )
        assert page.is_visible("#elastic-panel")
        assert page.text_content("#resize-count") == "3 resizes, 1 fallback"
        assert f"elastic, 2{EN_DASH}3 workers; now 2" in page.text_content("#elastic-range")

        rows = cells(page, "#resizes-table tbody tr")
        kinds = page.eval_on_selector_all(
            "#resizes-table tbody tr", "rows => rows.map(r => r.dataset.kind)"
        )
        assert kinds == ["resize", "resize", "resize", "fallback"]
        assert [r[1:] for r in rows] == [
            ["12.5s", "3 → 2", "rank 1 was killed by SIGKILL", "0.46 s", "2", "5"],
            ["25.0s", "2 → 3", "capacity returned", "-", "0", "9"],
            ["41.5s", "3 → 2", "rank 2 was killed by SIGKILL", "1.50 s", "1", "14"],
            ["50.0s", "restart from disk checkpoint", FALLBACK["reason"], "-", "-", "-"],
        ]

        # The step chart: one step per change, held until the run's end.
        chart = page.locator("#chart-world")
        assert chart.get_attribute("data-world-sizes") == "3,2,3,2,2"
        assert chart.get_attribute("data-points") == "5"  # the restart at 2 is no step; + end
        world = page.evaluate(
            "() => { const u = document.querySelector('#chart-world .uplot'); "
            "return u ? u.querySelectorAll('.u-legend .u-series').length : 0; }"
        )
        assert world == 4  # time, workers, min, max

        # Rank 2 left the group: shown as such, not as a straggler or failure.
        assert page.evaluate("window.rtDash.leftRanks") == [2]
        row = page.locator('#workers-table tr[data-rank="2"]')
        assert "left" in (row.get_attribute("class") or "")
        assert row.locator(".badge.left").text_content() == "left the group"
        assert "+40.0s" in (row.locator(".badge.left").get_attribute("title") or "")
        for rank in (0, 1):
            assert "left" not in (
                page.get_attribute(f'#workers-table tr[data-rank="{rank}"]', "class") or ""
            )
        legend = page.eval_on_selector_all(
            "#chart-step .u-legend .u-series th", "ths => ths.map(t => t.textContent.trim())"
        )
        assert "rank 2 (left)" in legend

        timeline = cells(page, '#timeline-table tr[data-type="resize"]')
        assert len(timeline) == 3
        assert "2 → 3 workers: capacity returned" in timeline[1][3]
        assert page.locator('#timeline-table tr[data-type="resize_fallback"]').count() == 1
        screenshot(page, "elastic")


@needs_browser
def test_page_hides_the_world_size_panel_for_a_fixed_size_run(tmp_path: Path, page: Page) -> None:
    run_dir = tmp_path / "plain"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"scaling_config": {"num_workers": 2}}))
    append_events(
        run_dir,
        [
            {"type": "run_start", "time": T0, "world_size": 2, "attempt": 0},
            *round_events(0, 2, T0 + 5.0),
        ],
    )
    with serve(tmp_path) as server:
        page.goto(server.url + "#run=plain")
        page.wait_for_function("() => window.rtDash.metricRounds === 1", timeout=WAIT_MS)
        assert page.text_content('#run-facts [data-fact="workers"] dd') == "2"
        assert not page.is_visible("#elastic-panel")
        assert page.evaluate("window.rtDash.leftRanks") == []


# --------------------------------------------------------------------------------------------
# A real elastic run
# --------------------------------------------------------------------------------------------


def test_real_elastic_run_is_read_back(tmp_path: Path) -> None:
    log = tmp_path / "log"
    log.mkdir()
    cfg = {"epochs": 1, "log": str(log), "out": str(tmp_path / "final.pt")}
    trainer = rt.Trainer(
        workloads.elastic_fn,
        rt.ScalingConfig(num_workers=(2, 3)),
        rt.RunConfig(
            name="real",
            storage_path=str(tmp_path / "runs"),
            failure_config=rt.FailureConfig(max_failures=2),
            progress="off",
        ),
        train_loop_config=cfg | {"kill_ranks": [1], "kill_step": 3},
    )
    result = trainer.fit()
    assert result.error is None

    details = runs.load_run(result.path)
    assert details.summary.world_size == 2
    (resize,) = details.resizes
    assert (resize.kind, resize.old_world_size, resize.new_world_size) == ("resize", 3, 2)
    assert resize.cause == "rank 1 was killed by SIGKILL" and resize.snapshot_step == 3
    assert resize.resume_s is not None and resize.resume_s >= 0
    assert [c.world_size for c in details.world_sizes] == [3, 2]
    out = _render(details)
    assert "Resizes (1)" in out and "3 -> 2 workers" in out

    d = RunStore(str(tmp_path / "runs")).run("real", Cursors())
    assert d is not None
    assert d["elastic"] == {"min_workers": 2, "max_workers": 3}
    assert d["summary"]["world_size"] == 2
    assert [r["rank"] for r in d["left_ranks"]] == [2]
    assert [(r["old_world_size"], r["new_world_size"]) for r in d["resizes"]] == [(3, 2)]


def make_spares_run(storage: Path, name: str = "spares") -> Path:
    """A run of 3 workers and one hot spare: rank 1 killed, the spare (id 3) took its rank."""
    run_dir = storage / name
    run_dir.mkdir(parents=True)
    scaling = {"num_workers": 3, "spares": 1, "backend": "local"}
    (run_dir / "config.json").write_text(
        json.dumps({"name": name, "created": T0, "scaling_config": scaling})
    )
    events: list[dict[str, Any]] = [
        {"type": "run_start", "time": T0, "world_size": 3, "attempt": 0}
    ]
    events += [*round_events(0, 3, T0 + 5.0), failure(1, T0 + 8.0)]
    events += [
        {"type": "spare", "time": T0 + 8.1, "action": "promoted", "spare": 3, "rank": 1},
        KILL_1 | {"time": T0 + 8.6, "new_world_size": 3, "spare_ranks": [1], "resume_s": 0.6},
    ]
    events += round_events(1, 3, T0 + 12.0)
    events.append({"type": "run_end", "time": T0 + 15.0, "status": "FINISHED", "duration_s": 15})
    append_events(run_dir, events)
    return run_dir


@needs_browser
def test_page_names_the_rank_a_hot_spare_took(tmp_path: Path, page: Page) -> None:
    make_spares_run(tmp_path)
    with serve(tmp_path) as server:
        page.goto(server.url + "#run=spares")
        page.wait_for_function("() => window.rtDash.resizes === 1", timeout=WAIT_MS)
        (row,) = cells(page, "#resizes-table tbody tr")
        assert row[2] == "3 → 3 (spare took rank 1)", row
        timeline = page.text_content("#timeline-table")
        assert "3 → 3 workers (spare took rank 1): rank 1 was killed by SIGKILL" in timeline
        assert "hot spare 3 took rank 1" in timeline
