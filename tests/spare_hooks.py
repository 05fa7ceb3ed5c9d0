"""Hot-spare faults for ``workloads.elastic_fn`` (tests/multiprocess/test_spares.py).

Each hook acts on attempt 0 only and reads the run's ``events.jsonl`` (``config["run_dir"]``) to
wait for what the driver wrote, so that a kill lands where the test means it to however loaded
the machine:

- ``kill_spare_step``: at that step, rank 0 SIGKILLs the first ready spare and waits until the
  driver has written that spare ``lost``.
- ``spares_ready``: at step ``spares_ready_step`` (default ``kill_step``), the first rank of
  ``kill_ranks`` (default rank 0) waits, before its own kill or notice, until that many spares
  have said ready (the replacement of a lost spare included).
- ``campaign``: ``[[step, rank], ...]``: after that step, the process holding that rank waits
  until a spare is ready (not yet used) and SIGKILLs itself; each kill once (a marker file in
  ``config["log"]``), however often the step is reached.
- ``kill_on_reentry``: that rank SIGKILLs itself when the train function is entered a second
  time in its process (after a hand-over to a spare, before the group's first step).
"""

from __future__ import annotations

import json
import os
import signal
import time

import ringtrain as rt

_entries = 0  # train function entries in this process


def _spare_events(config) -> list[dict]:
    path = os.path.join(config["run_dir"], "events.jsonl")
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line still being written
        if record.get("type") == "spare":
            records.append(record)
    return records


def _wait_for(config, what, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [e for e in _spare_events(config) if what(e)]
        if found:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"no spare event matched in {timeout_s} s: {_spare_events(config)}")


def on_entry(config) -> None:
    """Count this entry; ``kill_on_reentry``: that rank dies on its second one."""
    global _entries
    _entries += 1
    ctx = rt.get_context()
    if ctx.attempt == 0 and _entries >= 2 and ctx.world_rank == config.get("kill_on_reentry"):
        os.kill(os.getpid(), signal.SIGKILL)


def after_step(config, step: int) -> None:
    """``kill_spare_step`` (rank 0) and ``spares_ready`` (before a member's own kill)."""
    ctx = rt.get_context()
    if ctx.attempt != 0:
        return
    if ctx.world_rank == 0 and step == config.get("kill_spare_step"):
        (ready, *_) = _wait_for(config, lambda e: e["action"] == "ready")
        (started,) = _wait_for(
            config, lambda e: e["action"] == "started" and e["spare"] == ready["spare"]
        )
        os.kill(started["pid"], signal.SIGKILL)
        _wait_for(config, lambda e: e["action"] == "lost" and e["spare"] == ready["spare"])
    for i, (at, rank) in enumerate(config.get("campaign", ())):
        marker = os.path.join(config["log"], f"campaign_kill_{i}")
        if step == at and ctx.world_rank == rank and not os.path.exists(marker):
            _wait_for(config, lambda e: _unused_ready(config) > 0)
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    wanted = config.get("spares_ready")
    ranks = config.get("kill_ranks") or [0]
    when = config.get("spares_ready_step", config.get("kill_step"))
    if wanted and ctx.world_rank == ranks[0] and step == when:
        _wait_for(config, lambda e: _ready_count(config) >= wanted)


def _ready_count(config) -> int:
    return sum(e["action"] == "ready" for e in _spare_events(config))


def _unused_ready(config) -> int:
    events = _spare_events(config)
    ready = {e["spare"] for e in events if e["action"] == "ready"}
    return len(ready - {e["spare"] for e in events if e["action"] in ("promoted", "lost")})
