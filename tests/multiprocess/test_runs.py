"""Tests for ringtrain.monitor.runs: reading run directories written per docs/run-directory.md."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import fsspec
import pytest
from fsspec.core import url_to_fs
from rich.console import Console

from ringtrain.monitor.format import format_bytes, format_duration, format_value
from ringtrain.monitor.render import render_run, render_runs
from ringtrain.monitor.runs import RunSummary, list_runs, load_run

T0 = 1763720000.0


# --------------------------------------------------------------------------------------------
# Fake run directories
# --------------------------------------------------------------------------------------------


def _join(base: str, *names: str) -> str:
    if "://" in base:
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(base, *names)


def _write(path: str, data: str | bytes) -> None:
    fs, p = url_to_fs(path)
    fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(p, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


def _write_json(path: str, obj: Any) -> None:
    _write(path, json.dumps(obj))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def make_run(
    storage: str,
    name: str,
    *,
    status: str | None = "FINISHED",
    start: float = T0,
    duration: float = 90.0,
    world_size: int = 2,
    rounds: int = 3,
    driver_pid: int | None = None,
    final_metrics: bool = True,
    checkpoints: tuple[int, ...] = (),
    failures: tuple[dict[str, Any], ...] = (),
    truncated_tail: bool = False,
    error: str | None = None,
    extra_events: tuple[dict[str, Any], ...] = (),
) -> str:
    """Writes a run directory: config.json, events.jsonl, checkpoints and result.json."""
    run_dir = _join(storage, name)
    _write_json(
        _join(run_dir, "config.json"),
        {
            "name": name,
            "storage_path": storage,
            "entrypoint": "train_fn",
            "ringtrain_version": "0.1.0",
            "created": start,
            "scaling_config": {"num_workers": world_size, "use_gpu": False, "backend": "local"},
            "train_loop_config": {"lr": 0.001, "epochs": rounds},
        },
    )
    events: list[dict[str, Any]] = [
        {"type": "run_start", "time": start, "world_size": world_size, "attempt": 0}
    ]
    per_round: dict[int, dict[str, Any]] = {}
    for rnd in range(rounds):
        metrics = {"epoch": rnd, "loss": 1.0 / (rnd + 2), "val_acc": 0.9 + rnd * 0.0356}
        per_round[rnd] = metrics
        for rank in range(world_size):
            events.append(
                {
                    "type": "report",
                    "time": start + 10.0 * (rnd + 1),
                    "rank": rank,
                    "round": rnd,
                    "metrics": {**metrics, "rank_loss": rank + rnd / 10},
                    "checkpoint": rnd in checkpoints,
                }
            )
        if rnd in checkpoints:
            ckpt = f"checkpoint_{rnd:06d}"
            events.append(
                {
                    "type": "checkpoint",
                    "time": start + 10.0 * (rnd + 1) + 1,
                    "round": rnd,
                    "path": ckpt,
                    "metrics": metrics,
                }
            )
            _write(_join(run_dir, ckpt, "model.pt"), b"x" * 1000)
            _write_json(
                _join(run_dir, ckpt, "manifest.json"),
                {
                    "format": 1,
                    "round": rnd,
                    "created": start + 10.0 * (rnd + 1) + 1,
                    "metrics": {"epoch": rnd, "val_acc": metrics["val_acc"]},
                    "files": {
                        "model.pt": {"size": 1000, "sha256": "ab", "rank": 0},
                        "opt.pt": {"size": 500, "sha256": "cd", "rank": 1},
                    },
                },
            )
    for failure in failures:
        events.append({"type": "failure", "time": start + 5.0, "traceback": None, **failure})
    events.extend(extra_events)
    if status in ("FINISHED", "ERRORED", "ABORTED"):
        events.append(
            {"type": "run_end", "time": start + duration, "status": status, "duration_s": duration}
        )
    text = "".join(json.dumps(e) + "\n" for e in events)
    if truncated_tail:
        text += '{"type": "report", "time": 17637200'  # the driver is mid-write
    _write(_join(run_dir, "events.jsonl"), text)

    if status is not None:
        last = per_round.get(rounds - 1, {})
        running = status == "RUNNING"
        _write_json(
            _join(run_dir, "result.json"),
            {
                "status": status,
                "name": name,
                "path": run_dir,
                "driver_pid": driver_pid if driver_pid is not None else os.getpid(),
                "start_time": start,
                "end_time": None if running else start + duration,
                "duration_s": None if running else duration,
                "world_size": world_size,
                "rounds": 0 if running else rounds,
                "metrics": last if final_metrics and not running else {},
                "metrics_per_rank": {},
                "checkpoint": _join(run_dir, f"checkpoint_{checkpoints[-1]:06d}")
                if checkpoints
                else None,
                "best_checkpoints": [],
                "error": error,
                "failures": [],
            },
        )
    return run_dir


@pytest.fixture(params=["local", "memory"])
def storage(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[str]:
    """A storage path: a local directory, or a fresh memory:// URL."""
    if request.param == "local":
        path = str(tmp_path / "runs")
        os.makedirs(path)
        yield path
        return
    url = f"memory://ringtrain-test-{uuid.uuid4().hex}"
    fs, p = url_to_fs(url)
    fs.makedirs(p, exist_ok=True)
    yield url
    if fs.exists(p):
        fs.rm(p, recursive=True)


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=120, color_system=None), buf


# --------------------------------------------------------------------------------------------
# list_runs
# --------------------------------------------------------------------------------------------


def test_list_runs_reads_summaries_sorted_by_start(storage: str) -> None:
    make_run(storage, "late", start=T0 + 500, checkpoints=(0, 2))
    make_run(storage, "early", start=T0, status="ERRORED", rounds=1, error="ValueError: boom")
    _write(_join(storage, "not_a_run", "notes.txt"), "hello")  # a directory that is no run
    _write(_join(storage, "stray.txt"), "hello")  # a file at the top level

    runs = list_runs(storage)

    assert [r.name for r in runs] == ["early", "late"]
    early, late = runs
    assert isinstance(late, RunSummary)
    assert late.status == "FINISHED"
    assert late.path == _join(storage, "late")
    assert late.start_time == T0 + 500
    assert late.duration_s == 90.0
    assert late.world_size == 2
    assert late.rounds == 3
    assert late.num_checkpoints == 2
    assert late.metrics["epoch"] == 2
    assert late.metrics["val_acc"] == pytest.approx(0.9712)
    assert early.status == "ERRORED"
    assert early.error == "ValueError: boom"
    assert early.num_checkpoints == 0


def test_list_runs_counts_only_checkpoints_with_valid_manifest(storage: str) -> None:
    run_dir = make_run(storage, "ckpts", checkpoints=(0, 1))
    # Being written: files but no manifest yet. And one with a torn manifest.
    _write(_join(run_dir, "checkpoint_000002", "model.pt"), b"y" * 10)
    _write(_join(run_dir, "checkpoint_000003", "manifest.json"), '{"format": 1, "rou')

    (run,) = list_runs(storage)
    assert run.num_checkpoints == 2

    details = load_run(run_dir)
    assert [c.name for c in details.checkpoints] == ["checkpoint_000000", "checkpoint_000001"]


def test_missing_result_is_unknown_and_torn_result_too(storage: str) -> None:
    make_run(storage, "noresult", status=None)
    run_dir = make_run(storage, "torn", start=T0 + 1)
    _write(_join(run_dir, "result.json"), '{"status": "FINI')

    runs = {r.name: r for r in list_runs(storage)}

    assert runs["noresult"].status == "UNKNOWN"
    assert runs["noresult"].world_size == 2  # from config.json
    assert runs["noresult"].start_time == T0  # config.json's "created"
    assert runs["noresult"].metrics["epoch"] == 2  # from events.jsonl
    assert runs["torn"].status == "UNKNOWN"


def test_running_run_with_live_driver_stays_running(storage: str) -> None:
    start = time.time() - 65.0
    make_run(storage, "live", status="RUNNING", start=start, driver_pid=os.getpid(), rounds=2)

    (run,) = list_runs(storage)

    assert run.status == "RUNNING"
    assert run.duration_s is not None and 64.0 <= run.duration_s <= 120.0
    # result.json has no metrics yet while running: they come from events.jsonl.
    assert run.metrics["epoch"] == 1
    assert run.rounds == 2


def test_running_run_with_dead_driver(storage: str) -> None:
    make_run(storage, "dead", status="RUNNING", driver_pid=_dead_pid(), rounds=2)

    (run,) = list_runs(storage)

    if storage.startswith("memory://"):
        # Not a local filesystem: the pid cannot be checked, so the recorded status stands.
        assert run.status == "RUNNING"
    else:
        assert run.status == "ABORTED"
        # Duration: up to the last event the run wrote (round 1 reported at start + 20 s).
        assert run.duration_s == pytest.approx(20.0)


def test_running_result_but_run_end_logged(storage: str) -> None:
    # The driver logged run_end but died before rewriting result.json.
    make_run(
        storage,
        "ended",
        status="RUNNING",
        driver_pid=_dead_pid(),
        extra_events=(
            {"type": "run_end", "time": T0 + 42, "status": "FINISHED", "duration_s": 42.0},
        ),
    )

    (run,) = list_runs(storage)

    assert run.status == "FINISHED"
    assert run.duration_s == 42.0


def test_missing_storage_path_raises(storage: str) -> None:
    missing = _join(storage, "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        list_runs(missing)


def test_storage_path_that_is_a_file_raises(storage: str) -> None:
    path = _join(storage, "file.txt")
    _write(path, "x")
    with pytest.raises(FileNotFoundError, match="not a directory"):
        list_runs(path)


def test_empty_storage_has_no_runs(storage: str) -> None:
    assert list_runs(storage) == []
    console, buf = _console()
    render_runs([], console)
    assert "No runs found" in buf.getvalue()


# --------------------------------------------------------------------------------------------
# load_run
# --------------------------------------------------------------------------------------------


def test_load_run_metrics_checkpoints_failures(storage: str) -> None:
    run_dir = make_run(
        storage,
        "mnist",
        status="ERRORED",
        rounds=4,
        checkpoints=(1, 3),
        failures=({"rank": 1, "kind": "exception", "message": "RuntimeError: CUDA oom"},),
        truncated_tail=True,
    )

    d = load_run(run_dir)

    assert d.summary.name == "mnist"
    assert d.summary.status == "ERRORED"
    assert d.config is not None and d.config["train_loop_config"]["lr"] == 0.001
    assert d.result is not None and d.result["status"] == "ERRORED"
    # Rank 0's metrics per round; the truncated last line is skipped, not fatal.
    assert [r.round for r in d.rounds] == [0, 1, 2, 3]
    assert d.rounds[2].metrics["loss"] == pytest.approx(0.25)
    assert d.rounds[2].metrics["rank_loss"] == pytest.approx(0.2)
    assert d.rounds[2].time == T0 + 30.0
    assert d.skipped_event_lines == 1
    # Each rank's last report.
    assert sorted(d.rank_metrics) == [0, 1]
    assert d.rank_metrics[1].round == 3
    assert d.rank_metrics[1].metrics["rank_loss"] == pytest.approx(1.3)
    # Checkpoints from their manifests.
    assert [c.round for c in d.checkpoints] == [1, 3]
    ckpt = d.checkpoints[1]
    assert ckpt.name == "checkpoint_000003"
    assert ckpt.path == _join(run_dir, "checkpoint_000003")
    assert ckpt.size_bytes == 1500
    assert ckpt.metrics["epoch"] == 3
    assert ckpt.created == T0 + 41.0
    assert set(ckpt.files) == {"model.pt", "opt.pt"}
    # Failures.
    assert len(d.failures) == 1
    f = d.failures[0]
    assert (f.rank, f.kind, f.message) == (1, "exception", "RuntimeError: CUDA oom")
    assert f.time == T0 + 5.0


def test_load_run_tolerates_garbage_lines_anywhere(storage: str) -> None:
    run_dir = _join(storage, "garbage")
    _write_json(_join(run_dir, "config.json"), {"name": "garbage", "created": T0})
    lines = [
        json.dumps({"type": "run_start", "time": T0, "world_size": 1, "attempt": 0}),
        "not json at all",
        json.dumps([1, 2, 3]),
        json.dumps(
            {
                "type": "report",
                "time": T0 + 1,
                "rank": 0,
                "round": 0,
                "metrics": {"loss": 0.5},
                "checkpoint": False,
            }
        ),
        "\u2028",  # only whitespace for str.splitlines, and not a line of ours
        json.dumps(
            {
                "type": "report",
                "time": T0 + 2,
                "rank": 0,
                "round": 1,
                "metrics": {"note": "a\u2028b"},
                "checkpoint": False,
            }
        ),
        '{"type": "report", "ti',
    ]
    _write(_join(run_dir, "events.jsonl"), "\n".join(lines))

    d = load_run(run_dir)

    assert [r.round for r in d.rounds] == [0, 1]
    assert d.rounds[1].metrics == {"note": "a\u2028b"}
    assert d.skipped_event_lines == 4
    assert d.summary.status == "UNKNOWN"
    assert d.summary.world_size == 1


def test_load_run_restarted_round_latest_wins(storage: str) -> None:
    run_dir = _join(storage, "restart")
    _write_json(_join(run_dir, "result.json"), {"status": "FINISHED", "start_time": T0})
    events = [
        {"type": "run_start", "time": T0, "world_size": 1, "attempt": 0},
        {"type": "report", "time": T0 + 1, "rank": 0, "round": 0, "metrics": {"loss": 9.0}},
        {"type": "run_start", "time": T0 + 2, "world_size": 1, "attempt": 1},
        {"type": "report", "time": T0 + 3, "rank": 0, "round": 0, "metrics": {"loss": 1.0}},
    ]
    _write(_join(run_dir, "events.jsonl"), "".join(json.dumps(e) + "\n" for e in events))

    d = load_run(run_dir)

    assert len(d.rounds) == 1
    assert d.rounds[0].metrics == {"loss": 1.0}


def test_load_run_missing_or_not_a_run(storage: str) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run(_join(storage, "missing"))
    _write(_join(storage, "other", "x.txt"), "x")
    with pytest.raises(FileNotFoundError, match="not a ringtrain run"):
        load_run(_join(storage, "other"))


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def test_render_runs_shows_names_statuses_metrics(storage: str) -> None:
    make_run(storage, "mnist_ok", start=T0, checkpoints=(2,))
    make_run(storage, "mnist_bad", start=T0 + 10, status="ERRORED", rounds=2)
    make_run(storage, "mnist_dead", start=T0 + 20, status="RUNNING", driver_pid=_dead_pid())
    console, buf = _console()

    render_runs(list_runs(storage), console)

    out = buf.getvalue()
    lines = out.splitlines()
    ok_line = next(line for line in lines if "mnist_ok" in line)
    assert "FINISHED" in ok_line
    assert "1m 30s" in ok_line
    assert "val_acc=0.9712" in ok_line
    assert "epoch=2" in ok_line
    bad_line = next(line for line in lines if "mnist_bad" in line)
    assert "ERRORED" in bad_line
    assert "val_acc=0.9356" in bad_line
    dead_line = next(line for line in lines if "mnist_dead" in line)
    expected = "RUNNING" if storage.startswith("memory://") else "ABORTED"
    assert expected in dead_line
    # Newest last.
    assert out.index("mnist_ok") < out.index("mnist_bad") < out.index("mnist_dead")


def test_render_run_report(storage: str) -> None:
    run_dir = make_run(
        storage,
        "mnist",
        status="ERRORED",
        rounds=3,
        checkpoints=(0, 2),
        failures=({"rank": 1, "kind": "signal", "message": "worker killed by SIGKILL"},),
        error="worker 1 failed",
    )
    _write(_join(run_dir, "checkpoint_000001", "model.pt"), b"z")  # no manifest: not listed
    console, buf = _console()

    render_run(load_run(run_dir), console)

    out = buf.getvalue()
    assert "mnist" in out
    assert "ERRORED" in out
    assert "worker 1 failed" in out
    assert "lr=0.001" in out  # train_loop_config
    # Metrics table: columns and 4-significant-digit values for each round.
    for header in ("Round", "epoch", "loss", "val_acc", "rank_loss"):
        assert header in out
    assert "0.3333" in out  # loss of round 1
    assert "0.9712" in out  # val_acc of round 2
    # Per-rank table (two ranks reported).
    assert "Last report per rank" in out
    assert "1.2" in out  # rank 1's rank_loss in round 2
    # Checkpoints: the two with a manifest, sizes, latest marked; not the one without.
    assert "checkpoint_000000" in out
    assert "checkpoint_000002" in out
    assert "checkpoint_000001" not in out
    assert "1.5 KiB" in out
    assert "latest" in out
    # Failures.
    assert "Failures (1)" in out
    assert "signal" in out
    assert "worker killed by SIGKILL" in out
    assert "hidden" not in out


def test_render_run_limits_rounds_and_columns(storage: str) -> None:
    run_dir = _join(storage, "wide")
    _write_json(_join(run_dir, "result.json"), {"status": "FINISHED", "start_time": T0})
    events = [
        {
            "type": "report",
            "time": T0 + r,
            "rank": 0,
            "round": r,
            "metrics": {f"m{i:02d}": r * 1000 + i for i in range(15)},
        }
        for r in range(40)
    ]
    _write(_join(run_dir, "events.jsonl"), "".join(json.dumps(e) + "\n" for e in events))
    console, buf = _console()

    render_run(load_run(run_dir), console, max_rounds=5, max_columns=3)

    out = buf.getvalue()
    assert "35 earlier rounds hidden" in out
    assert "12 metric columns hidden: m03, m04" in out
    assert "39002" in out  # last round, column m02
    assert "35000" in out  # first shown round
    assert "34000" not in out  # hidden round
    assert "39003" not in out  # hidden column


def test_render_escapes_markup_in_user_text(storage: str) -> None:
    make_run(storage, "run", status="ERRORED", error="bad [bold]thing[/bold]")
    console, buf = _console()
    render_run(load_run(_join(storage, "run")), console)
    assert "bad [bold]thing[/bold]" in buf.getvalue()


# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [
        (None, "-"),
        (0.0, "0.0s"),
        (4.25, "4.2s"),
        (42.94, "42.9s"),
        (59.97, "1m 00s"),
        (92.0, "1m 32s"),
        (3600 * 2 + 5 * 60 + 7, "2h 05m"),
        (86400 * 3 + 3600 * 4, "3d 04h"),
        (float("nan"), "-"),
    ],
)
def test_format_duration(seconds: float | None, expected: str) -> None:
    assert format_duration(seconds) == expected


def test_format_value_and_bytes() -> None:
    assert format_value(0.123456) == "0.1235"
    assert format_value(12345.678) == "1.235e+04"
    assert format_value(3) == "3"
    assert format_value(True) == "True"
    assert format_value(float("nan")) == "nan"
    assert format_value("x" * 100, max_len=10) == "x" * 9 + "…"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 1024**3) == "3.0 GiB"
    assert format_bytes(None) == "-"


def test_memory_url_paths_stay_urls() -> None:
    url = f"memory://ringtrain-test-{uuid.uuid4().hex}"
    try:
        make_run(url, "m")
        (run,) = list_runs(url)
        assert run.path == url + "/m"
        assert load_run(run.path).summary.name == "m"
    finally:
        fs = fsspec.filesystem("memory")
        fs.rm(url_to_fs(url)[1], recursive=True)


# --------------------------------------------------------------------------------------------
# `ringtrain ls` / `show` at 80 and 200 columns (issue 21), sweeps
# --------------------------------------------------------------------------------------------

LONG_NAME = "train_fn_2026-11-24_03-14-53"


def make_sweep(storage: str, name: str, statuses: tuple[str, ...]) -> str:
    """A sweep directory as ``ringtrain tune`` writes it (tuner.json, trial_NNNN run dirs; no
    study.db: the counts then come from the trials' result.json)."""
    sweep = _join(storage, name)
    _write_json(
        _join(sweep, "tuner.json"),
        {
            "name": name,
            "kind": "sweep",
            "created": T0 + 1000.0,
            "metric": "val_acc",
            "mode": "max",
            "tune_config": {"num_samples": len(statuses)},
            "scaling_config": {"num_workers": 2},
        },
    )
    for i, status in enumerate(statuses):
        make_run(
            sweep,
            f"trial_{i:04d}",
            status=status,
            start=T0 + 1000.0 + i,
            error="RuntimeError: diverged" if status == "ERRORED" else None,
        )
    return sweep


def _cli(*args: str, columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "dumb", "NO_COLOR": "1"}
    env.pop("FORCE_COLOR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "ringtrain.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.timeout(300)
def test_ls_and_show_fit_80_and_200_columns(tmp_path: Any) -> None:
    """A default run name used to wrap onto 4 lines at 80 columns, "Last metrics" shrank to
    ``epoch…``, failed runs showed no reason, sweeps were not listed at all."""
    storage = str(tmp_path / "runs")
    make_run(storage, LONG_NAME, start=T0)
    make_run(
        storage,
        "train_fn_2026-11-24_03-20-07",
        status="ERRORED",
        start=T0 + 100,
        error="ValueError: bad batch at step 12\nTraceback (most recent call last): ...",
        failures=(
            {"rank": 1, "kind": "exception", "message": "ValueError: bad batch at step 12"},
            {
                "rank": 0,
                "kind": "exception",
                "message": "lost its connection to rank 1",
                "follow_on": True,
            },
        ),
    )
    make_sweep(storage, "sweep_2026-11-24_03-30-00", ("FINISHED", "STOPPED", "ERRORED"))
    for width in (80, 200):
        out = _cli("ls", storage, columns=width)
        lines = out.splitlines()
        assert max(len(line) for line in lines) <= width, out
        rows = [line for line in lines if "FINISHED" in line or "ERRORED" in line]
        assert len(rows) == 3, out  # 2 runs and 1 sweep, one line each: no name wraps
        assert not any(line.startswith(" ") and line.strip() for line in lines[2:]), out
        finished, errored, sweep = rows
        assert finished.startswith("train") and finished.split()[0].endswith("03-14-53"), out
        if width == 200:
            assert finished.startswith(LONG_NAME), out
            assert "epoch=2 val_acc=0.9712" in finished, out
        else:
            assert "…" in finished.split()[0], out  # cut in the middle
            assert "epoch=2" in finished, out
        assert "ValueError: bad" in errored, out  # the reason column
        if width == 200:
            assert "sweep 3/3 trials: 1 completed, 1 pruned, 1 failed" in sweep, out
        else:
            assert " 3/3 " in sweep and "sweep: 1 ok, 1 pruned, 1 failed" in sweep, out

        show = _cli("show", _join(storage, "train_fn_2026-11-24_03-20-07"), columns=width)
        assert max(len(line) for line in show.splitlines()) <= width, show
        assert "Failures (1) + 1 follow-on" in show, show  # root causes counted apart
        assert "rank 0: lost its connection to rank 1 (follow-on)" in " ".join(show.split())


def test_sweeps_are_listed_with_trial_counts(tmp_path: Any) -> None:
    from ringtrain.monitor.dashboard.data import RunStore
    from ringtrain.monitor.sweeps import list_sweeps

    storage = str(tmp_path / "runs")
    make_run(storage, "plain_run")
    make_sweep(storage, "sw", ("FINISHED", "FINISHED", "STOPPED", "ERRORED"))
    (sweep,) = list_sweeps(storage)
    assert (sweep.completed, sweep.pruned, sweep.failed, sweep.total) == (2, 1, 1, 4)
    assert sweep.status == "FINISHED" and sweep.best is not None and sweep.best_trial == 0
    assert [r.name for r in list_runs(storage)] == ["plain_run"]  # a sweep is not a run
    listing = RunStore(storage).list()
    assert [r["name"] for r in listing["runs"]] == ["plain_run"]
    assert listing["sweeps"] == [
        {
            "name": "sw",
            "path": _join(storage, "sw"),
            "status": "FINISHED",
            "counts": "4/4 trials: 2 completed, 1 pruned, 1 failed",
        }
    ]
