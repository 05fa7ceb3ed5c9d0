"""The web dashboard: its JSON API over run directories written here by hand, the page in a real
browser (Debian's Chromium driven by Playwright) while a run directory grows, the CLI, and a real
2-worker run watched from start to end."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import ringtrain as rt
from pages import WAIT_MS, Page, needs_browser, screenshot
from ringtrain.monitor.dashboard import DashboardServer, create_app, is_loopback
from ringtrain.monitor.dashboard.data import Cursors, EventTail, RunStore
from support import wait_until

with warnings.catch_warnings():
    # Starlette >= 1.x nudges towards httpx2; the TestClient works the same with httpx.
    warnings.filterwarnings("ignore", message=".*httpx.*", category=UserWarning)
    from starlette.testclient import TestClient

RINGTRAIN = shutil.which("ringtrain") or os.path.join(os.path.dirname(sys.executable), "ringtrain")
T0 = 1763720000.0


# --------------------------------------------------------------------------------------------
# Run directories, written the way the driver writes them
# --------------------------------------------------------------------------------------------


def window(rank: int, i: int, slow: float = 1.0) -> dict[str, Any]:
    """A timing window (docs/run-directory.md): seconds per step, bytes, samples."""
    data, compute, comm, opt, other = 0.002, 0.010 * slow, 0.003, 0.001, 0.0005
    mean = data + compute + comm + opt + other
    return {
        "steps": 10,
        "step": 10 * (i + 1),
        "step_s": mean,
        "step_s_mean": mean,
        "data_s": data,
        "compute_s": compute,
        "comm_exposed_s": comm,
        "optimizer_s": opt,
        "other_s": other,
        "comm_s": 0.005,
        "comm_bytes": 4096.0,
        "busy_s": mean - comm,
        "samples": 320,
        "samples_per_s": 320 / (10 * mean),
        "window_s": 10 * mean,
        "rss_bytes": 200_000_000 + rank * 1_000_000 + i,
        "gpu_allocated_bytes": None,
        "gpu_peak_bytes": None,
        "gpu_util": None,
    }


def round_events(rnd: int, world_size: int, t: float, attempt: int = 0) -> list[dict[str, Any]]:
    """One report round of every rank, then one timing window per rank."""
    events: list[dict[str, Any]] = []
    for rank in range(world_size):
        metrics = {"loss": 1.0 / (rnd + 1), "acc": 0.5 + 0.01 * rnd, "rank": rank}
        events.append({"type": "report", "time": t, "rank": rank, "round": rnd, "metrics": metrics})
    for rank in range(world_size):
        events.append(
            {"type": "timing", "time": t + 0.01 * rank, "rank": rank, "attempt": attempt}
            | window(rank, rnd)
        )
    return events


def append_events(run_dir: Path, events: list[dict[str, Any]]) -> None:
    with open(run_dir / "events.jsonl", "a") as f:
        for event in events:
            f.write(json.dumps(event) + "\n")
            f.flush()


def write_json(path: Path, obj: Any) -> None:
    """Atomically, as the driver writes result.json (temp file + rename)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def write_result(run_dir: Path, status: str, *, start: float, rounds: int, **extra: Any) -> None:
    running = status == "RUNNING"
    write_json(
        run_dir / "result.json",
        {
            "status": status,
            "name": run_dir.name,
            "path": str(run_dir),
            "driver_pid": os.getpid(),
            "start_time": start,
            "end_time": None if running else start + 60.0,
            "duration_s": None if running else 60.0,
            "world_size": 2,
            "rounds": rounds,
            "metrics": {} if running else {"loss": 1.0 / rounds, "acc": 0.5 + 0.01 * rounds},
            "error": None,
            "failures": [],
            **extra,
        },
    )


def make_run(
    storage: Path,
    name: str,
    *,
    status: str = "FINISHED",
    rounds: int = 4,
    world_size: int = 2,
    start: float = T0,
    hparams: dict[str, Any] | None = None,
    checkpoints: tuple[int, ...] = (),
    extra_events: tuple[dict[str, Any], ...] = (),
) -> Path:
    run_dir = storage / name
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(
        json.dumps(
            {
                "name": name,
                "created": start,
                "scaling_config": {"num_workers": world_size},
                "train_loop_config": hparams,
            }
        )
    )
    events: list[dict[str, Any]] = [
        {"type": "run_start", "time": start, "world_size": world_size, "attempt": 0}
    ]
    for rnd in range(rounds):
        events += round_events(rnd, world_size, start + 5.0 * (rnd + 1))
        if rnd in checkpoints:
            ckpt = f"checkpoint_{rnd:06d}"
            (run_dir / ckpt).mkdir()
            (run_dir / ckpt / "manifest.json").write_text(
                json.dumps(
                    {
                        "format": 1,
                        "round": rnd,
                        "created": start + 5.0 * (rnd + 1) + 1,
                        "metrics": {"loss": 1.0 / (rnd + 1)},
                        "files": {"model.pt": {"size": 2048, "sha256": "ab", "rank": 0}},
                    }
                )
            )
            events.append(
                {
                    "type": "checkpoint",
                    "time": start + 5.0 * (rnd + 1) + 1,
                    "round": rnd,
                    "path": ckpt,
                    "metrics": {"loss": 1.0 / (rnd + 1)},
                }
            )
    events += list(extra_events)
    if status != "RUNNING":
        events.append({"type": "run_end", "time": start + 60.0, "status": status, "duration_s": 60})
    append_events(run_dir, events)
    last_ckpt = f"checkpoint_{checkpoints[-1]:06d}" if checkpoints else None
    write_result(
        run_dir,
        status,
        start=start,
        rounds=rounds,
        checkpoint=str(run_dir / last_ckpt) if last_ckpt else None,
    )
    return run_dir


STRAGGLER = {
    "type": "straggler",
    "time": T0 + 12.0,
    "rank": 1,
    "attempt": 0,
    "busy_s": 0.03,
    "median_s": 0.015,
    "ratio": 2.0,
    "reason": "compute",
    "message": "rank 1 is 2.0x slower than the median in compute",
}
FAILURE = {
    "type": "failure",
    "time": T0 + 13.0,
    "rank": 1,
    "kind": "exception",
    "message": "RuntimeError: boom",
    "traceback": "Traceback (most recent call last):\nRuntimeError: boom",
    "attempt": 0,
}


def client(path: Path | str, **kwargs: Any) -> TestClient:
    return TestClient(create_app(str(path), **kwargs), base_url="http://127.0.0.1:8470")


def get_json(c: TestClient, url: str) -> dict[str, Any]:
    response = c.get(url)
    assert response.status_code == 200, response.text

    def strict(constant: str) -> Any:
        raise AssertionError(f"{url} returned {constant}, which browsers cannot parse")

    data = json.loads(response.text, parse_constant=strict)
    assert isinstance(data, dict)
    return data


# --------------------------------------------------------------------------------------------
# JSON API
# --------------------------------------------------------------------------------------------


def test_runs_list_is_a_trials_table(tmp_path: Path) -> None:
    storage = tmp_path / "sweep"
    for i, lr in enumerate((0.1, 0.01, 0.001)):
        make_run(
            storage,
            f"trial_{i}",
            start=T0 + i,
            rounds=3 + i,
            hparams={"lr": lr, "model": {"width": 32 * (i + 1)}, "layers": [1, 2]},
            checkpoints=(1,),
        )
    make_run(storage, "live", status="RUNNING", start=T0 + 10, extra_events=(STRAGGLER,))
    (storage / "notes").mkdir()  # a directory that is no run

    data = get_json(client(storage), "/api/runs")

    assert data["exists"] is True and data["single"] is None
    assert [r["name"] for r in data["runs"]] == ["trial_0", "trial_1", "trial_2", "live"]
    assert data["hparams"] == ["lr", "model.width", "layers"]
    assert data["metrics"][:2] == ["loss", "acc"]
    trial = data["runs"][2]
    assert trial["status"] == "FINISHED"
    assert trial["config"] == {"lr": 0.001, "model.width": 96, "layers": "[1, 2]"}
    assert trial["rounds"] == 5 and trial["world_size"] == 2 and trial["num_checkpoints"] == 1
    assert trial["metrics"]["loss"] == pytest.approx(0.2)
    live = data["runs"][3]
    assert live["status"] == "RUNNING"  # this process is its "driver"
    assert live["metrics"]["loss"] == pytest.approx(0.25)  # from events.jsonl while running
    assert live["stragglers"] == [1]
    assert trial["stragglers"] == []


def test_run_details_metrics_timing_stragglers_timeline(tmp_path: Path) -> None:
    extra = (
        STRAGGLER,
        FAILURE,
        {"type": "decision", "time": T0 + 13.5, "decision": "restart", "reason": "1 of 3"},
        {"type": "run_start", "time": T0 + 14.0, "world_size": 2, "attempt": 1},
        {"type": "resume", "time": T0 + 14.0, "attempt": 1, "checkpoint": "checkpoint_000001"},
        # attempt 1 re-reports round 2, with a nested window this time
        {"type": "report", "time": T0 + 15, "rank": 0, "round": 2, "metrics": {"loss": 0.3}},
        {"type": "timing", "time": T0 + 15, "rank": 0, "attempt": 1, "window": window(0, 9)},
        STRAGGLER | {"time": T0 + 16, "rank": 0, "attempt": 1},
        {"type": "straggler_cleared", "time": T0 + 17, "rank": 0, "attempt": 1},
    )
    run_dir = make_run(tmp_path, "r", rounds=3, checkpoints=(0, 1), extra_events=extra)

    d = get_json(client(tmp_path), "/api/runs/r")

    assert d["name"] == "r" and d["summary"]["status"] == "FINISHED" and d["attempt"] == 1
    assert d["more"] is False
    metrics = d["metrics"]
    assert metrics["start"] == 0 and metrics["total"] == 4
    assert [(m["round"], m["attempt"]) for m in metrics["items"]] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (2, 1),
    ]
    assert metrics["items"][3]["metrics"] == {"loss": 0.3}
    timing = d["timing"]["items"]
    assert len(timing) == 3 * 2 + 1
    first = timing[0]
    assert (first["rank"], first["attempt"], first["time"]) == (0, 0, T0 + 5.0)
    assert first["compute_s"] == pytest.approx(0.010)
    assert first["step_s"] == pytest.approx(0.0165)
    assert first["rss_bytes"] == 200_000_000 and first["gpu_allocated_bytes"] is None
    assert timing[-1]["attempt"] == 1 and timing[-1]["step"] == 100  # the nested window
    # Rank 1 was flagged in attempt 0; the restart cleared it; rank 0 was flagged and cleared.
    assert d["stragglers"] == []
    kinds = [e["type"] for e in d["timeline"]["items"]]
    assert kinds == [
        "run_start",
        "checkpoint",
        "checkpoint",
        "straggler",
        "failure",
        "decision",
        "run_start",
        "resume",
        "straggler",
        "straggler_cleared",
        "run_end",
    ]
    assert all("traceback" not in e for e in d["timeline"]["items"])
    assert [c["name"] for c in d["checkpoints"]] == ["checkpoint_000000", "checkpoint_000001"]
    assert [c["latest"] for c in d["checkpoints"]] == [False, True]
    assert d["checkpoints"][1]["size_bytes"] == 2048
    (failure,) = d["failures"]
    assert failure["rank"] == 1 and failure["traceback"].endswith("RuntimeError: boom")
    assert d["rank_metrics"]["1"]["round"] == 2

    # The straggler flag as the page sees it mid-run: rank 1 flagged until the restart.
    (run_dir / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in [{"type": "run_start", "time": T0}, STRAGGLER])
    )
    d = get_json(client(tmp_path), "/api/runs/r")
    assert [s["rank"] for s in d["stragglers"]] == [1]
    assert d["stragglers"][0]["reason"] == "compute" and d["stragglers"][0]["ratio"] == 2.0


def diloco_window(rank: int, i: int) -> dict[str, Any]:
    """A DiLoCo run's timing window (docs/run-directory.md): H = 5, one sync per 10 steps of
    40 KB, ``i + 1`` outer steps so far, 4 ms of outer sync per inner step."""
    w = window(rank, i)
    return w | {
        "outer_steps": 2 * (i + 1),
        "outer_bytes": 8000.0,
        "outer_sync_s": 0.04,
        "outer_sync_frac": 0.04 / w["window_s"],
        "outer_exchanges": 2,
    }


def diloco_run(storage: Path, name: str = "diloco", windows: int = 3) -> Path:
    """A finished 2-worker DiLoCo run: its report rounds (plain windows, as before the first
    inner step), then ``windows`` DiLoCo windows per rank; ``result.json`` has the count."""
    extra = tuple(
        {"type": "timing", "time": T0 + 30 + i, "rank": rank, "attempt": 0} | diloco_window(rank, i)
        for i in range(windows)
        for rank in range(2)
    )
    run_dir = make_run(storage, name, rounds=2, extra_events=extra)
    result = json.loads((run_dir / "result.json").read_text())
    write_json(run_dir / "result.json", result | {"outer_steps": 2 * windows})
    return run_dir


def test_a_diloco_run_serves_its_outer_loop_per_rank(tmp_path: Path) -> None:
    diloco_run(tmp_path)
    make_run(tmp_path, "plain", rounds=2)
    c = client(tmp_path)

    d = get_json(c, "/api/runs/diloco")

    diloco = d["diloco"]
    assert diloco["outer_steps"] == 6
    assert sorted(diloco["ranks"]) == ["0", "1"]
    zero = diloco["ranks"]["0"]
    assert zero["steps"] == 30 and zero["outer_steps"] == 6 and zero["exchanges"] == 6
    assert zero["bytes_per_step"] == pytest.approx(8000.0)  # the plain windows left out
    assert zero["sync_s"] == pytest.approx(0.12)
    assert zero["sync_s_per_step"] == pytest.approx(0.004)
    assert zero["sync_frac"] == pytest.approx(0.004 / 0.0165)
    assert d["timing"]["items"][-1]["outer_bytes"] == 8000.0  # the windows carry the fields
    assert get_json(c, "/api/runs/plain")["diloco"] is None


def test_events_are_read_incrementally(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "grow", status="RUNNING", rounds=2)
    c = client(tmp_path)
    d = get_json(c, "/api/runs/grow")
    gen, have = d["generation"], {k: d[k]["total"] for k in ("metrics", "timing", "timeline")}
    assert have == {"metrics": 2, "timing": 4, "timeline": 1}

    # Blank out the first line in place (same size): a reader that re-read the whole file
    # would lose the run_start; one that reads from its offset never sees the change.
    with open(run_dir / "events.jsonl", "r+b") as f:
        first = f.readline()
        f.seek(0)
        f.write(b" " * (len(first) - 1))
    append_events(run_dir, round_events(2, 2, T0 + 15))
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('{"type": "report", "time": 1, "rank": 0, "ro')  # the driver mid-write

    query = "&".join(f"{k}={v}" for k, v in have.items())
    d = get_json(c, f"/api/runs/grow?gen={gen}&{query}")
    assert d["generation"] == gen and d["reset"] is False
    assert d["metrics"]["start"] == 2 and [m["round"] for m in d["metrics"]["items"]] == [2]
    assert d["timing"]["start"] == 4 and len(d["timing"]["items"]) == 2
    assert d["timeline"]["items"] == [] and d["timeline"]["total"] == 1  # run_start kept
    assert d["skipped_event_lines"] == 0  # the torn last line waits; it is not garbage

    with open(run_dir / "events.jsonl", "a") as f:
        f.write('und": 3, "metrics": {"loss": 0.1}}\n')
    d = get_json(c, f"/api/runs/grow?gen={gen}&metrics=3&timing=6&timeline=1")
    assert [m["round"] for m in d["metrics"]["items"]] == [3]

    # A replaced events file (another inode, shorter) starts a new generation from byte 0.
    new = run_dir / "events.new"
    new.write_text(json.dumps({"type": "run_start", "time": T0, "world_size": 2}) + "\n")
    os.replace(new, run_dir / "events.jsonl")
    d = get_json(c, f"/api/runs/grow?gen={gen}&metrics=4&timing=6&timeline=1")
    assert d["generation"] != gen and d["reset"] is True
    assert d["metrics"]["total"] == 0 and d["timeline"]["total"] == 1
    assert d["metrics"]["start"] == 0 and d["timeline"]["start"] == 0


def test_event_tail_reads_only_new_bytes(tmp_path: Path) -> None:
    import fsspec

    path = tmp_path / "events.jsonl"
    path.write_text('{"type": "a", "time": 1}\n{"type": "b", "ti')
    fs = fsspec.filesystem("file")
    tail = EventTail(fs, str(path))
    assert tail.check() is False
    assert [e["type"] for e in tail.read_new()] == ["a"]
    with open(path, "a") as f:
        f.write('me": 2}\nnot json\n{"type": "c", "time": 3}')  # the last line is complete
    assert tail.check() is False
    assert [e["type"] for e in tail.read_new()] == ["b", "c"]
    assert tail.offset == path.stat().st_size and tail.skipped == 1
    assert list(tail.read_new()) == []
    path.write_text('{"type": "d"}\n')  # truncated and rewritten
    assert tail.check() is True
    assert [e["type"] for e in tail.read_new()] == ["d"]


def test_limit_sends_long_runs_in_pieces(tmp_path: Path) -> None:
    make_run(tmp_path, "long", rounds=30)
    store = RunStore(str(tmp_path))
    first = store.run("long", Cursors(), limit=25)
    assert first is not None and first["more"] is True
    assert len(first["timing"]["items"]) == 25 and first["timing"]["total"] == 60
    gen = first["generation"]
    second = store.run("long", Cursors(gen, metrics=25, timing=25, timeline=2), limit=25)
    assert second is not None and second["more"] is True
    assert second["metrics"]["start"] == 25 and len(second["metrics"]["items"]) == 5
    third = store.run("long", Cursors(gen, metrics=30, timing=50, timeline=2), limit=25)
    assert third is not None and third["more"] is False and len(third["timing"]["items"]) == 10


def test_nan_metrics_unknown_runs_and_read_only(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "nan", rounds=1)
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('{"type": "report", "time": 1, "rank": 0, "round": 1, "metrics": {"loss": NaN}}\n')
    c = client(tmp_path)
    d = get_json(c, "/api/runs/nan")
    assert d["metrics"]["items"][-1]["metrics"] == {"loss": "NaN"}
    get_json(c, "/api/runs")
    assert c.get("/api/runs/missing").status_code == 404
    assert c.get("/api/runs/..").status_code == 404
    assert c.get("/api/runs/%2e%2e%2fnan").status_code == 404
    assert c.post("/api/runs").status_code == 405
    assert c.delete("/api/runs/nan").status_code == 405
    page = c.get("/")
    assert page.status_code == 200 and "uPlot.iife.min.js" in page.text
    assert page.headers["x-content-type-options"] == "nosniff"
    assert c.get("/static/uPlot.iife.min.js").status_code == 200
    assert c.get("/static/app.js").status_code == 200


def test_single_run_dir_and_memory_storage(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "only", rounds=2)
    d = get_json(client(run_dir), "/api/runs")
    assert d["single"] == "only" and [r["name"] for r in d["runs"]] == ["only"]
    assert get_json(client(run_dir), "/api/runs/only")["metrics"]["total"] == 2
    assert client(run_dir).get("/api/runs/other").status_code == 404

    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://dashboard-test-{os.getpid()}"
    try:
        for path in run_dir.iterdir():
            if path.is_file():
                fs.pipe(f"{url}/only/{path.name}", path.read_bytes())
        d = get_json(client(url), "/api/runs")
        assert [r["status"] for r in d["runs"]] == ["FINISHED"]
        assert get_json(client(url), "/api/runs/only")["timing"]["total"] == 4
    finally:
        fs.rm(url, recursive=True)

    missing = get_json(client(tmp_path / "nowhere"), "/api/runs")
    assert missing["exists"] is False and missing["runs"] == []


def test_token_required_on_every_request(tmp_path: Path) -> None:
    make_run(tmp_path, "r")
    c = client(tmp_path, token="s3cret")
    for url in ("/", "/api/runs", "/api/runs/r", "/static/app.js"):
        response = c.get(url)
        assert response.status_code == 401, url
        assert "token" in response.text
    assert c.get("/api/runs?token=wrong").status_code == 401
    assert c.get("/api/runs", headers={"X-Ringtrain-Token": "nope"}).status_code == 401
    assert c.get("/api/runs", headers={"X-Ringtrain-Token": "s3cret"}).status_code == 200
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200

    page = c.get("/?token=s3cret")  # what the printed URL opens; the cookie carries it on
    assert page.status_code == 200
    assert "HttpOnly" in page.headers["set-cookie"]
    assert c.get("/api/runs/r").status_code == 200
    assert c.get("/static/uPlot.min.css").status_code == 200

    # Any token survives the URL and the cookie (quoted in both).
    odd = "p@ss word;=%"
    c = client(tmp_path, token=odd)
    assert c.get("/", params={"token": odd}).status_code == 200
    assert c.get("/api/runs").status_code == 200
    server = DashboardServer(str(tmp_path), token=odd)
    assert server.url.endswith("/?token=p%40ss%20word%3B%3D%25")


def test_loopback_without_token_answers_loopback_names_only(tmp_path: Path) -> None:
    make_run(tmp_path, "r")
    c = client(tmp_path)
    assert c.get("/api/runs").status_code == 200
    assert c.get("/api/runs", headers={"host": "localhost:8470"}).status_code == 200
    assert c.get("/api/runs", headers={"host": "[::1]:8470"}).status_code == 200
    # A page on another site that rebinds its name to 127.0.0.1 cannot read the runs.
    assert c.get("/api/runs", headers={"host": "evil.example:8470"}).status_code == 403


def test_non_loopback_host_needs_a_token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert is_loopback("[::1]") and is_loopback("127.0.1.1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5")
    assert not is_loopback("example.com") and not is_loopback("::")
    monkeypatch.delenv("RINGTRAIN_DASHBOARD_TOKEN", raising=False)
    with pytest.raises(ValueError, match="needs a token: pass --token"):
        DashboardServer(str(tmp_path), host="0.0.0.0")
    assert DashboardServer(str(tmp_path), host="0.0.0.0", token="t").token == "t"
    monkeypatch.setenv("RINGTRAIN_DASHBOARD_TOKEN", "from-env")
    server = DashboardServer(str(tmp_path), host="0.0.0.0", port=8470)
    assert server.token == "from-env" and server.url.endswith(":8470/?token=from-env")


# --------------------------------------------------------------------------------------------
# The server and the CLI
# --------------------------------------------------------------------------------------------


@contextmanager
def serve(path: Path | str, **kwargs: Any) -> Iterator[DashboardServer]:
    server = DashboardServer(str(path), port=0, **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_server_thread_serves_and_stops(tmp_path: Path) -> None:
    make_run(tmp_path, "r")
    with serve(tmp_path) as server:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/", server.url)
        response = httpx.get(server.url + "api/runs", timeout=10)
        assert response.status_code == 200 and response.json()["runs"][0]["name"] == "r"
        assert server.last_request > 0
    with pytest.raises(httpx.TransportError):
        httpx.get(server.url + "api/runs", timeout=5)


class _Lines:
    """Collects a process's output lines in a thread (so its pipe never fills up)."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)

    def find(self, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
        found: list[re.Match[str]] = []

        def look() -> bool:
            found[:] = [m for m in (re.search(pattern, ln) for ln in list(self.lines)) if m]
            return bool(found)

        assert wait_until(look, timeout_s=timeout_s), f"no {pattern!r} in {self.lines}"
        return found[0]


def _env_without_token() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RINGTRAIN_DASHBOARD_TOKEN", None)
    return env


def test_cli_dashboard(tmp_path: Path) -> None:
    make_run(tmp_path, "r")
    refused = subprocess.run(
        [RINGTRAIN, "dashboard", str(tmp_path), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        env=_env_without_token(),
        timeout=60,
    )
    assert refused.returncode == 2
    assert "needs a token" in refused.stderr and "RINGTRAIN_DASHBOARD_TOKEN" in refused.stderr

    proc = subprocess.Popen(
        [RINGTRAIN, "dashboard", str(tmp_path), "--port", "0", "--token", "tok"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env_without_token(),
    )
    try:
        url = _Lines(proc.stdout).find(r"(http://127\.0\.0\.1:\d+/)\?token=tok").group(1)
        assert httpx.get(url + "api/runs", timeout=10).status_code == 401
        data = httpx.get(url + "api/runs?token=tok", timeout=10).json()
        assert [r["name"] for r in data["runs"]] == ["r"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


WAITING_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import ringtrain as rt

    go = sys.argv[1]
    for i in range(3000):
        rt.report({"i": i})
        if i >= 1 and os.path.exists(go):
            break
        time.sleep(0.05)
    """
)


def test_run_with_dashboard(tmp_path: Path) -> None:
    script = tmp_path / "wait.py"
    script.write_text(WAITING_SCRIPT)
    go = tmp_path / "go"
    storage = tmp_path / "runs"
    proc = subprocess.Popen(
        [
            *(RINGTRAIN, "run", "-n", "1", "--dashboard", "--dashboard-port", "0"),
            *("--storage-path", str(storage), "--name", "dash", "--progress", "plain"),
            *(str(script), str(go)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=_env_without_token(),
    )
    try:
        out = _Lines(proc.stdout)
        url = out.find(r"dashboard at (http://127\.0\.0\.1:\d+/)#run=dash").group(1)
        statuses: list[str] = []

        def running() -> bool:
            runs = httpx.get(url + "api/runs", timeout=10).json()["runs"]
            statuses[:] = [r["status"] for r in runs if r["name"] == "dash"]
            return statuses == ["RUNNING"]

        assert wait_until(running, timeout_s=60, interval_s=0.2), statuses
        details = httpx.get(url + "api/runs/dash", timeout=10).json()
        assert details["summary"]["world_size"] == 1
        go.touch()
        assert proc.wait(timeout=60) == 0, "".join(out.lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------------------------
# The page, in a real browser
# --------------------------------------------------------------------------------------------


def row_order(page: Page) -> list[str]:
    return page.eval_on_selector_all("#runs-table tbody tr", "rows => rows.map(r => r.dataset.run)")


@needs_browser
def test_page_lists_runs_and_sorts_trials(tmp_path: Path, page: Page) -> None:
    for i, lr in enumerate((0.01, 0.1, 0.001)):
        make_run(tmp_path, f"trial_{i}", start=T0 + i, rounds=2 + i, hparams={"lr": lr})
    with serve(tmp_path) as server:
        page.goto(server.url)
        page.wait_for_function("() => window.rtDash.runs === 3", timeout=WAIT_MS)
        assert row_order(page) == ["trial_0", "trial_1", "trial_2"]
        headers = page.eval_on_selector_all(
            "#runs-table thead th", "ths => ths.map(t => t.textContent)"
        )
        assert "lr" in headers and "loss" in headers
        assert page.text_content('#runs-table tr[data-run="trial_1"] td.status') == "FINISHED"

        page.click('#runs-table th[data-col="h:lr"]')
        assert row_order(page) == ["trial_2", "trial_0", "trial_1"]  # lr ascending
        page.click('#runs-table th[data-col="h:lr"]')
        assert row_order(page) == ["trial_1", "trial_0", "trial_2"]
        page.click('#runs-table th[data-col="m:loss"]')  # final loss: 1/rounds
        assert row_order(page) == ["trial_2", "trial_1", "trial_0"]
        # The order survives the next poll.
        polls = page.evaluate("window.rtDash.polls")
        page.wait_for_function(f"() => window.rtDash.polls > {polls + 1}", timeout=WAIT_MS)
        assert row_order(page) == ["trial_2", "trial_1", "trial_0"]
        screenshot(page, "trials")

        page.click('#runs-table a:text("trial_2")')
        page.wait_for_function("() => window.rtDash.metricRounds === 4", timeout=WAIT_MS)
        assert page.text_content("#run-name") == "trial_2"
        assert page.text_content("#run-status") == "FINISHED"
        assert page.get_attribute('[data-metric="loss"] .chart', "data-points") == "4"


@needs_browser
def test_page_shows_a_diloco_runs_outer_loop_and_no_panel_for_others(
    tmp_path: Path, page: Page
) -> None:
    diloco_run(tmp_path)
    make_run(tmp_path, "plain", rounds=2)
    with serve(tmp_path) as server:
        page.goto(server.url + "#run=diloco")
        page.wait_for_function("() => window.rtDash.outerSteps === 6", timeout=WAIT_MS)
        assert page.is_visible("#diloco-panel")
        assert page.text_content("#diloco-outer-steps") == "6 outer steps"
        cells = page.eval_on_selector_all(
            '#diloco-table tr[data-rank="1"] td', "tds => tds.map(t => t.textContent)"
        )
        assert cells == ["1", "6", "7.8 KiB", "0.1s", "4.00 ms", "24.2%", "6"]
        assert page.text_content('[data-fact="outer steps"] dd') == "6"
        screenshot(page, "diloco")

        page.goto(server.url + "#run=plain")
        page.wait_for_function("() => window.rtDash.run === 'plain'", timeout=WAIT_MS)
        page.wait_for_function("() => window.rtDash.outerSteps === null", timeout=WAIT_MS)
        assert not page.is_visible("#diloco-panel")
        assert page.query_selector('[data-fact="outer steps"]') is None


class LiveWriter(threading.Thread):
    """Appends a report round and timing windows every ``interval_s``, like a running driver."""

    def __init__(self, run_dir: Path, first_round: int, interval_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.round = first_round
        self.interval_s = interval_s
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval_s) and self.round < 400:
            append_events(self.run_dir, round_events(self.round, 2, time.time()))
            self.round += 1


def row_class(page: Page, rank: int) -> str:
    return page.get_attribute(f'#workers-table tr[data-rank="{rank}"]', "class") or ""


def counter(page: Page, name: str) -> int:
    return int(page.evaluate(f"window.rtDash.{name}"))


@needs_browser
def test_page_follows_a_live_run_and_highlights_the_straggler(tmp_path: Path, page: Page) -> None:
    start = time.time() - 30
    run_dir = make_run(tmp_path, "live", status="RUNNING", rounds=3, start=start)
    writer = LiveWriter(run_dir, first_round=3)
    with serve(tmp_path) as server:
        page.goto(server.url + "#run=live")
        page.wait_for_function("() => window.rtDash.metricRounds >= 3", timeout=WAIT_MS)
        assert page.text_content("#run-status") == "RUNNING"
        points = int(page.get_attribute("#chart-step", "data-points") or 0)
        assert points >= 3
        try:
            writer.start()
            page.wait_for_function(
                "() => window.rtDash.metricRounds >= 8 && window.rtDash.timingWindows >= 16",
                timeout=WAIT_MS,
            )
            page.wait_for_function(
                f"() => +document.querySelector('#chart-step').dataset.points > {points}",
                timeout=WAIT_MS,
            )
            loss_points = int(page.get_attribute('[data-metric="loss"] .chart', "data-points") or 0)
            assert loss_points >= 8
        finally:
            writer.stop.set()
            writer.join()
        assert not page.is_visible("#straggler-banner")
        assert "straggler" not in (
            page.get_attribute('#workers-table tr[data-rank="1"]', "class") or ""
        )

        append_events(run_dir, [STRAGGLER | {"time": time.time()}])
        page.wait_for_selector('#workers-table tr[data-rank="1"].straggler', timeout=WAIT_MS)
        assert "straggler" not in (
            page.get_attribute('#workers-table tr[data-rank="0"]', "class") or ""
        )
        background = page.eval_on_selector(
            '#workers-table tr[data-rank="1"] td', "td => getComputedStyle(td).backgroundColor"
        )
        assert background == "rgb(253, 236, 236)"  # the red tint
        banner = page.text_content("#straggler-list")
        assert banner is not None and "rank 1" in banner and "compute" in banner
        legend = page.text_content("#chart-step")
        assert legend is not None and "rank 1 (straggler)" in legend
        assert page.evaluate("window.rtDash.stragglers") == [1]
        screenshot(page, "live_straggler")

        append_events(run_dir, [{"type": "straggler_cleared", "time": time.time(), "rank": 1}])
        page.wait_for_selector('#workers-table tr[data-rank="1"]:not(.straggler)', timeout=WAIT_MS)
        assert not page.is_visible("#straggler-banner")

        rounds = writer.round
        append_events(
            run_dir,
            [{"type": "run_end", "time": time.time(), "status": "FINISHED", "duration_s": 40.0}],
        )
        write_result(run_dir, "FINISHED", start=start, rounds=rounds)
        page.wait_for_function(
            "() => document.querySelector('#run-status').textContent === 'FINISHED'",
            timeout=WAIT_MS,
        )
        assert counter(page, "metricRounds") == rounds
        assert page.is_visible('#timeline-table tr[data-type="run_end"]')
        screenshot(page, "live_finished")


# --------------------------------------------------------------------------------------------
# A real run
# --------------------------------------------------------------------------------------------


def live_train_fn(config: dict[str, Any]) -> None:
    """Trains a tiny model, one report per epoch, until the test creates the ``go`` file (both
    ranks agree through an allreduce, so they stop after the same epoch)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    model = rt.prepare_model(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=4))
    deadline = time.monotonic() + config["max_s"]
    epoch = 0
    while True:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        rt.report({"loss": loss.item(), "epoch": epoch})
        epoch += 1
        stop = os.path.exists(config["go"]) or time.monotonic() > deadline
        flag = torch.tensor([1.0 if stop else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0 and epoch >= config["min_rounds"]:
            return
        time.sleep(0.1)


@needs_browser
def test_real_run_seen_running_then_finished(tmp_path: Path, page: Page) -> None:
    storage = tmp_path / "runs"
    storage.mkdir()
    go = tmp_path / "go"
    trainer = rt.Trainer(
        live_train_fn,
        rt.ScalingConfig(num_workers=2),
        rt.RunConfig(
            name="real",
            storage_path=str(storage),
            progress="off",
            monitor_config=rt.MonitorConfig(timing_interval_s=0.5),
        ),
        train_loop_config={"go": str(go), "min_rounds": 3, "max_s": 240},
    )
    outcome: dict[str, Any] = {}

    def fit() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=fit, daemon=True)
    with serve(storage) as server:
        page.goto(server.url)
        thread.start()
        try:
            page.wait_for_selector(
                '#runs-table tr[data-run="real"][data-status="RUNNING"]', timeout=90_000
            )
            page.click('#runs-table a:text("real")')
            page.wait_for_function("() => window.rtDash.metricRounds >= 2", timeout=90_000)
            assert page.text_content("#run-status") == "RUNNING"
            assert page.text_content('[data-metric="loss"] .chart-title') == "loss"
        finally:
            go.touch()
            thread.join(timeout=120)
        assert not thread.is_alive(), "the run did not end"
        assert "error" not in outcome, outcome.get("error")
        result = outcome["result"]
        page.wait_for_function(
            "() => document.querySelector('#run-status').textContent === 'FINISHED'",
            timeout=WAIT_MS,
        )
        rounds = len(result.metrics_history)
        assert rounds >= 3
        page.wait_for_function(f"() => window.rtDash.metricRounds === {rounds}", timeout=WAIT_MS)
        assert page.get_attribute('[data-metric="loss"] .chart', "data-points") == str(rounds)
        # Timing windows from both workers (at least the final one each).
        page.wait_for_function("() => window.rtDash.timingWindows >= 2", timeout=WAIT_MS)
        steps = page.eval_on_selector_all(
            "#workers-table tbody tr", "rows => rows.map(r => r.children[1].textContent)"
        )
        assert len(steps) == 2 and all(s != "-" and int(s) > 0 for s in steps), steps
        screenshot(page, "real_run")
