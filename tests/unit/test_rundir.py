"""The run directory's schema, its one writer and its one incremental reader (issue 20, item 4):
records round-trip through the JSON written today, the reader parses only new lines and
tolerates torn lines, garbage and kinds it does not know, and docs/run-directory.md's event
table matches the schema."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path
from typing import Any

import fsspec
import pytest

from ringtrain.controller.states import RunState
from ringtrain.rundir import RunDirectory
from ringtrain.rundir.reader import EventReader, read_events
from ringtrain.rundir.run_records import ConfigRecord, ResultRecord
from ringtrain.rundir.schema import (
    CONFIG_FILE,
    EVENT_TYPES,
    EVENTS_FILE,
    MANIFEST_FILE,
    METRICS_CSV_FILE,
    PAYLOAD_FILE,
    RESULT_FILE,
    TENSORBOARD_DIR,
    TERMINAL_STATUSES,
    TIMING_CSV_FILE,
    CheckpointInvalidEvent,
    EventRecord,
    FailureEvent,
    ReportEvent,
    ResizeEvent,
    RunStartEvent,
    TimingEvent,
    TransitionEvent,
    parse_event,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _json_keys(cls: type[EventRecord]) -> list[str]:
    """The keys a record of ``cls`` documents (``time`` is on every line; a timing window's
    fields are listed in monitoring.md)."""
    keys = [str(f.metadata.get("key", f.name)) for f in dataclasses.fields(cls)]
    return [k for k in keys if k != "time" and not (cls is TimingEvent and k == "window")]


def _sample(cls: type[EventRecord], rng: random.Random) -> EventRecord:
    """A record of ``cls`` with every field set to a random value of its type."""
    hints = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for name, tp in hints.items():
        if tp.startswith("dict"):
            values[name] = {"loss": rng.random(), "step": rng.randrange(100)}
        elif tp.startswith("list[int]"):
            values[name] = [rng.randrange(8) for _ in range(rng.randrange(1, 4))]
        elif tp.startswith("list"):
            values[name] = [f"rank {rng.randrange(8)}: disk full"]
        elif tp.startswith("float") or name == "time":
            values[name] = round(rng.uniform(0, 1e9), 3)
        elif tp.startswith("int"):
            values[name] = rng.randrange(1000)
        elif tp.startswith("bool"):
            values[name] = rng.random() < 0.5
        else:
            values[name] = f"text {rng.randrange(1000)} \u2028 with a line separator"
    return cls(**values)


def test_every_kind_round_trips_through_its_json_line() -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    for cls in EVENT_TYPES.values():
        for _ in range(5):
            record = _sample(cls, rng)
            line = json.dumps(record.to_json())
            obj = json.loads(line)
            assert obj["type"] == cls.KIND and list(obj)[:2] == ["type", "time"], f"seed {seed}"
            assert parse_event(obj) == record, f"seed {seed}: {cls.__name__} {line}"


def test_lines_keep_the_keys_written_before_the_schema() -> None:
    """Byte compatibility of keys (and their order) with the untyped writer of before."""
    report = ReportEvent(time=1.5, rank=1, round=3, metrics={"loss": 0.5}, checkpoint=True)
    assert json.dumps(report.to_json()) == (
        '{"type": "report", "time": 1.5, "rank": 1, "round": 3, "metrics": {"loss": 0.5}, '
        '"checkpoint": true}'
    )
    timing = TimingEvent(time=2.0, rank=0, attempt=1, window={"steps": 10, "step_s": 0.01})
    assert list(timing.to_json()) == ["type", "time", "rank", "attempt", "steps", "step_s"]
    transition = TransitionEvent(time=3.0, from_="RUNNING", to="STOPPED", reason="stop")
    assert transition.to_json() == {
        "type": "transition",
        "time": 3.0,
        "from": "RUNNING",
        "to": "STOPPED",
        "reason": "stop",
    }
    # Keys only some writers add are left out when not given.
    assert "rank" not in CheckpointInvalidEvent(reason="bad").to_json()
    assert CheckpointInvalidEvent(reason="bad", rank=1).to_json()["rank"] == 1
    resize = ResizeEvent(old_world_size=3, new_world_size=2, resume_s=None)
    assert "paused_s" not in resize.to_json() and resize.to_json()["resume_s"] is None
    assert "hostname" not in ResultRecord(status="RUNNING").to_json()


def test_older_lines_with_missing_or_odd_fields_still_load() -> None:
    # An older run: no attempt, no follow_on, a rank written as a string, no time at all.
    start = parse_event({"type": "run_start", "world_size": 2})
    assert start == RunStartEvent(time=None, world_size=2, attempt=None)
    failure = parse_event({"type": "failure", "time": 5, "rank": "1", "message": "boom"})
    assert isinstance(failure, FailureEvent)
    assert (failure.rank, failure.time, failure.follow_on, failure.kind) == (1, 5.0, False, None)
    # A nested timing window (an older writer) reads like a flat one.
    nested = parse_event({"type": "timing", "time": 1, "rank": 0, "window": {"steps": 4}})
    assert isinstance(nested, TimingEvent) and nested.window == {"steps": 4}
    # Wrong types fall back to the default; bools are never numbers.
    odd = parse_event({"type": "resize", "old_world_size": True, "resume_s": "soon"})
    assert odd == ResizeEvent(time=None)
    # A report without its rank or round says nothing: refused, not made up.
    assert parse_event({"type": "report", "time": 1, "round": 0}) is None
    # Kinds this version does not know are skipped.
    assert parse_event({"type": "preemption_v9", "time": 1}) is None


def test_config_and_result_records() -> None:
    config = ConfigRecord.from_json(
        {"name": "r", "created": 7, "scaling_config": {"num_workers": [2, 4]}, "extra": 1}
    )
    assert config is not None and config.worker_range() == (2, 4) and config.created == 7.0
    assert config.num_workers() is None
    fixed = ConfigRecord.from_json({"scaling_config": {"num_workers": 3}})
    assert fixed is not None and fixed.num_workers() == 3 and fixed.worker_range() is None
    result = ResultRecord(status="FINISHED", rounds=3, metrics={"loss": 0.1}, driver_pid=42)
    assert ResultRecord.from_json(json.loads(json.dumps(result.to_json()))) == result
    assert ResultRecord.from_json({"status": 3, "rounds": "x"}) == ResultRecord()
    assert {s.value for s in RunState if s.terminal} == TERMINAL_STATUSES


def test_reader_parses_only_new_lines_and_tolerates_torn_and_garbage_lines(
    tmp_path: Path,
) -> None:
    path = tmp_path / EVENTS_FILE
    fs = fsspec.filesystem("file")
    reader = EventReader(fs, str(path))
    assert reader.read_new() == []  # no file yet
    lines = [json.dumps(RunStartEvent(time=1.0, world_size=2, attempt=0).to_json())]
    lines += [json.dumps(ReportEvent(time=2.0, rank=r, round=0).to_json()) for r in (0, 1)]
    text = "\n".join(lines) + "\n"
    path.write_text(text[:-20])  # the last line torn mid-write
    first = reader.read_new()
    assert [type(r) for r in first] == [RunStartEvent, ReportEvent] and reader.skipped == 0
    offset = reader.tail.offset
    with open(path, "a") as f:
        f.write(text[-20:])
        f.write('{"type": "from_the_future", "time": 3}\nnot json\n[1, 2]\n')
        f.write(json.dumps(ReportEvent(time=4.0, rank=0, round=1).to_json()))  # no newline
    second = reader.read_new()
    assert [(r.rank, r.round) for r in second if isinstance(r, ReportEvent)] == [(1, 0), (0, 1)]
    assert len(second) == 2 and reader.skipped == 2  # the unknown kind is not garbage
    assert reader.tail.offset > offset and reader.read_new() == []
    # One-shot reads (ringtrain show) count a torn last line as skipped.
    with open(path, "a") as f:
        f.write('\n{"type": "report", "ti')
    records, skipped = read_events(fs, str(path))
    assert len(records) == 4 and skipped == 3
    # A replaced file starts over.
    path.write_text(json.dumps(RunStartEvent(time=9.0, world_size=3).to_json()) + "\n")
    assert reader.check() is True
    assert reader.read_new() == [RunStartEvent(time=9.0, world_size=3)] and reader.skipped == 0


@pytest.mark.parametrize("storage", ["local", "memory"])
def test_writer_appends_records_the_reader_gives_back(tmp_path: Path, storage: str) -> None:
    root = str(tmp_path) if storage == "local" else f"memory://h5-rundir-{random.random()}"
    run_dir = RunDirectory(root, "run")
    run_dir.create()
    written: list[EventRecord] = [
        RunStartEvent(world_size=2, attempt=0),
        ReportEvent(rank=0, round=0, metrics={"loss": float("nan")}),
        TimingEvent(rank=1, attempt=0, window={"steps": 10}),
        TransitionEvent(from_="RUNNING", to="FINISHED", reason="every worker finished"),
    ]
    for record in written:
        run_dir.write(record)
    run_dir.write_result(ResultRecord(status="FINISHED", name="run"))
    run_dir.close()
    back = run_dir.events()
    assert [type(r) for r in back] == [type(r) for r in written]
    assert back[2] == written[2] and back[3] == written[3]
    result = json.loads(run_dir.read_bytes(RESULT_FILE) or b"{}")
    assert result["status"] == "FINISHED" and list(result)[:2] == ["status", "name"]


# ------------------------------------------------------------------------------ the docs


def _event_table() -> dict[str, str]:
    """docs/run-directory.md's events table: type -> its fields cell."""
    text = (DOCS / "run-directory.md").read_text()
    section = text.split("## events.jsonl", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (.*) \|$", section, flags=re.MULTILINE)
    return dict(rows)


def test_run_directory_doc_lists_every_kind_and_field_of_the_schema() -> None:
    table = _event_table()
    assert list(table) == list(EVENT_TYPES), "docs/run-directory.md lists other event types"
    for kind, cls in EVENT_TYPES.items():
        missing = [k for k in _json_keys(cls) if f"`{k}`" not in table[kind]]
        assert not missing, f"docs/run-directory.md: `{kind}` does not list {missing}"
    for state in RunState:
        assert f"`{state.value}`" in table["transition"], state
    for status in TERMINAL_STATUSES:
        assert f"`{status}`" in table["run_end"], status
    assert "`STOPPED`" in table["stop_requested"]
    text = (DOCS / "run-directory.md").read_text()
    for name in (CONFIG_FILE, PAYLOAD_FILE, EVENTS_FILE, RESULT_FILE, MANIFEST_FILE):
        assert name in text
    for name in (METRICS_CSV_FILE, TIMING_CSV_FILE, TENSORBOARD_DIR):
        assert name in text


def test_dashboard_doc_names_only_events_that_are_written() -> None:
    from ringtrain.monitor.dashboard.runlog import TIMELINE_TYPES

    text = (DOCS / "dashboard.md").read_text()
    timeline = text.split("`timeline`: ", 1)[1].split("\n- ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", timeline)) - {"failures"}  # a key of the response
    assert named == {cls.KIND for cls in TIMELINE_TYPES}, named
    assert named <= set(EVENT_TYPES), "docs/dashboard.md names an event nothing writes"
