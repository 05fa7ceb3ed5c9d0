"""What the typed run-directory reader costs (issue 20, item 4).

Side by side on one synthetic ``events.jsonl`` (a 2-rank run: one ``report`` and one ``timing``
line per rank and round, the real field set):

- ``untyped``: the readers of before the schema: ``json.loads`` per line and a fold over the
  dicts with a ``type ==`` chain (a copy of the few lines that mattered);
- ``typed``: :func:`ringtrain.rundir.reader.read_events` (records of
  :mod:`ringtrain.rundir.schema`) folded by :class:`ringtrain.monitor.digest.EventDigest`;
- ``poll``: the dashboard's incremental read of the lines appended since the last poll
  (:class:`ringtrain.rundir.reader.EventReader`), which must not grow with the file.

CPU seconds (``time.process_time``), medians over ``--repeats`` runs, so that a loaded machine
changes the numbers less than wall time would.

    python benchmarks/rundir_reader.py --rounds 25000 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import fsspec

from ringtrain.monitor.digest import EventDigest
from ringtrain.rundir.reader import EventReader, read_events
from ringtrain.rundir.schema import ReportEvent, TimingEvent

WINDOW = {
    "steps": 10,
    "step": 10,
    "step_s": 0.01,
    "step_s_mean": 0.01,
    "data_s": 0.001,
    "compute_s": 0.005,
    "comm_exposed_s": 0.001,
    "optimizer_s": 0.001,
    "other_s": 0.001,
    "comm_s": 0.002,
    "comm_bytes": 4096.0,
    "busy_s": 0.009,
    "samples": 320,
    "samples_per_s": 3200.0,
    "window_s": 0.1,
    "rss_bytes": 200_000_000,
    "gpu_allocated_bytes": None,
    "gpu_peak_bytes": None,
    "gpu_util": None,
}


def write_round(f: Any, i: int, world_size: int = 2) -> None:
    for rank in range(world_size):
        report = ReportEvent(time=1.0 + i, rank=rank, round=i, metrics={"loss": 0.1, "step": i})
        f.write(json.dumps(report.to_json()) + "\n")
        timing = TimingEvent(time=1.0 + i, rank=rank, attempt=0, window=WINDOW)
        f.write(json.dumps(timing.to_json()) + "\n")


def untyped(path: str) -> int:
    """The fold of before: dicts and a ``type ==`` chain."""
    rounds: dict[int, Any] = {}
    ranks: dict[int, Any] = {}
    timing: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        data = f.read()
    n = 0
    for raw in data.split(b"\n"):
        if not raw.strip():
            continue
        ev = json.loads(raw)
        n += 1
        kind = ev.get("type")
        if kind == "report":
            rank, rnd = ev.get("rank"), ev.get("round")
            if isinstance(rank, int) and isinstance(rnd, int):
                ranks[rank] = (rnd, ev.get("time"), dict(ev.get("metrics") or {}))
                if rank == 0:
                    rounds[rnd] = ranks[rank]
        elif kind == "timing":
            timing.append({k: v for k, v in ev.items() if k not in ("type", "window")})
    return n


def typed(path: str) -> int:
    events, _ = read_events(fsspec.filesystem("file"), path)
    digest = EventDigest()
    for ev in events:
        digest.add(ev)
    return len(events)


def median_cpu(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=25_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "events.jsonl")
        with open(path, "w") as f:
            for i in range(args.rounds):
                write_round(f, i)
        lines = 4 * args.rounds
        base = median_cpu(lambda: untyped(path), args.repeats)
        new = median_cpu(lambda: typed(path), args.repeats)
        print(f"events.jsonl: {lines} lines, {os.path.getsize(path) / 1e6:.1f} MB")
        print(f"untyped read + fold: {base:.3f} CPU s ({1e6 * base / lines:.1f} us/line)")
        print(f"typed read + fold:   {new:.3f} CPU s ({1e6 * new / lines:.1f} us/line)")
        print(f"ratio typed/untyped: {new / base:.2f}")
        reader = EventReader(fsspec.filesystem("file"), path)
        reader.read_new()
        polls = []
        for i in range(args.repeats):
            with open(path, "a") as f:
                write_round(f, args.rounds + i)
            start = time.process_time()
            got = reader.read_new()
            polls.append(time.process_time() - start)
            assert len(got) == 4, len(got)
        poll = statistics.median(polls)
        print(f"poll after one more round (4 lines) of {lines}: {1e3 * poll:.2f} CPU ms")


if __name__ == "__main__":
    main()
