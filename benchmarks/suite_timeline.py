"""Where the test suite's wall time goes, per pytest worker, per file and per test, and why the
session's shared warm pool started each zygote:

    python benchmarks/suite_timeline.py --top 30 -- \
        python -m pytest -p no:cacheprovider --ignore=tests/unit

It runs the command with this file loaded as a pytest plugin (``-p suite_timeline``; the
benchmarks folder goes first on ``PYTHONPATH``), which appends one JSON line per test to
``--out``/``timeline_<worker>.jsonl`` (node id, pytest-xdist worker, start and end, the worker's
own CPU seconds and those of the children it waited for; as root, with cgroup v1's ``cpuacct``,
the CPU seconds of every process the pytest worker started, Ray's included, in a cgroup of its
own), and, after each test that made
``tests/conftest.py``'s shared ``rt.warm_pool`` start a zygote, how many and why
(``WarmPool.reasons``). Then it prints:

* per pytest worker: tests, busy seconds (sum of the tests' wall), when its last test ended (a
  worker that ends early means the groups are unbalanced);
* per file: tests and wall seconds, the ``--top`` files;
* the ``--top`` tests by wall seconds, with the running share of the whole;
* with the cgroup: the ``--top`` files and tests by CPU seconds;
* the shared pool's zygote starts, with their reasons.

Complements ``benchmarks/suite_cpu.py`` (CPU seconds by kind of process, under process accounting).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

_OUT_ENV = "RINGTRAIN_SUITE_TIMELINE_DIR"
_last = {"started": 0, "reasons": 0}


# ------------------------------------------------------------------ the pytest plugin


def _record(
    item: Any, t0: float, t1: float, c0: Any, c1: Any, g0: float | None, g1: float | None
) -> None:
    out = os.environ.get(_OUT_ENV)
    if not out:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    rec: dict[str, Any] = {
        "id": item.nodeid,
        "worker": worker,
        "t0": t0,
        "t1": t1,
        "self_cpu_s": (c1.user - c0.user) + (c1.system - c0.system),
        "child_cpu_s": (c1.children_user - c0.children_user)
        + (c1.children_system - c0.children_system),
    }
    if g0 is not None and g1 is not None:
        rec["cgroup_cpu_s"] = round(g1 - g0, 3)
    try:
        from ringtrain.launch import shared_pool

        pool = shared_pool.active()
        if pool is not None:
            if pool.started != _last["started"]:
                rec["zygotes_started"] = pool.started - _last["started"]
                rec["reasons"] = pool.reasons[_last["reasons"] :]
            _last["started"], _last["reasons"] = pool.started, len(pool.reasons)
    except ImportError:
        pass
    with open(os.path.join(out, f"timeline_{worker}.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")


_CPUACCT = "/sys/fs/cgroup/cpuacct"  # cgroup v1's CPU accounting (where it is mounted)
_cgroup: dict[str, str | None] = {"dir": None}


def _cgroup_cpu_s() -> float | None:
    """CPU seconds used so far by this pytest worker and every process it started, its Ray
    nodes and their actors included (all in its own cgroup), or None without one."""
    d = _cgroup["dir"]
    if d is None:
        return None
    with open(os.path.join(d, "cpuacct.usage")) as f:
        return int(f.read()) / 1e9


def pytest_configure(config: Any) -> None:
    """Moves this pytest process into a CPU-accounting cgroup of its own (root, cgroup v1's
    cpuacct), so that each test's record has its CPU seconds, whichever process spent them."""
    if not os.environ.get(_OUT_ENV) or not os.access(_CPUACCT, os.W_OK):
        return
    d = os.path.join(_CPUACCT, f"ringtrain_timeline_{os.getpid()}")
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError:
        return
    _cgroup["dir"] = d


def pytest_unconfigure(config: Any) -> None:
    d, _cgroup["dir"] = _cgroup["dir"], None
    if d is None:
        return
    with contextlib.suppress(OSError):
        with open(os.path.join(_CPUACCT, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(d)  # fails while a process this run started is still in it: left for the OS


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
    """Times each test's whole protocol (setup, call, teardown)."""
    t0, c0, g0 = time.time(), os.times(), _cgroup_cpu_s()
    yield
    _record(item, t0, time.time(), c0, os.times(), g0, _cgroup_cpu_s())


# ------------------------------------------------------------------ the summary


def summarise(records: list[dict[str, Any]], top: int) -> str:
    """The report (see the module docstring) of the timeline ``records``."""
    if not records:
        return "no test records (did the command run pytest?)"
    lines = []
    start = min(r["t0"] for r in records)
    total = sum(r["t1"] - r["t0"] for r in records)
    for worker in sorted({r["worker"] for r in records}):
        mine = [r for r in records if r["worker"] == worker]
        busy = sum(r["t1"] - r["t0"] for r in mine)
        end = max(r["t1"] for r in mine) - start
        lines.append(
            f"worker {worker}: {len(mine)} tests, busy {busy:.0f} s, last test ended at {end:.0f} s"
        )
    by_file: dict[str, float] = collections.defaultdict(float)
    count: collections.Counter[str] = collections.Counter()
    for r in records:
        name = r["id"].split("::")[0]
        by_file[name] += r["t1"] - r["t0"]
        count[name] += 1
    lines.append(f"\nfiles by wall seconds (of {total:.0f} s of tests):")
    for name, secs in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{secs:8.1f} {count[name]:4d}  {name}")
    lines.append("\ntests by wall seconds (running share of the whole):")
    running = 0.0
    for r in sorted(records, key=lambda r: r["t0"] - r["t1"])[:top]:
        secs = r["t1"] - r["t0"]
        running += secs
        lines.append(f"{secs:7.1f} {100 * running / total:4.0f}%  {r['id']}")
    cpu = [r for r in records if "cgroup_cpu_s" in r]
    if cpu:
        total_cpu = sum(r["cgroup_cpu_s"] for r in cpu)
        cpu_by_file: dict[str, float] = collections.defaultdict(float)
        for r in cpu:
            cpu_by_file[r["id"].split("::")[0]] += r["cgroup_cpu_s"]
        lines.append(f"\nfiles by CPU seconds, every process of the test (of {total_cpu:.0f}):")
        for name, secs in sorted(cpu_by_file.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"{secs:8.1f} {count[name]:4d}  {name}")
        lines.append("\ntests by CPU seconds (wall seconds):")
        for r in sorted(cpu, key=lambda r: -r["cgroup_cpu_s"])[:top]:
            lines.append(f"{r['cgroup_cpu_s']:7.1f} ({r['t1'] - r['t0']:6.1f})  {r['id']}")
    starts = [r for r in records if r.get("zygotes_started")]
    lines.append(f"\nshared warm pool: {sum(r['zygotes_started'] for r in starts)} zygote starts")
    for r in starts:
        why = "; ".join(r.get("reasons") or []) or "the worker's first fit"
        lines.append(f"  {r['zygotes_started']} in {r['id']}: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=25, help="files and tests to list")
    parser.add_argument("--out", default=None, help="folder for the JSON lines (default: new)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the pytest command")
    args = parser.parse_args(argv)
    command = [a for a in args.command if a != "--"] if args.command else []
    if not command:
        parser.error("give the pytest command after --")
    out = args.out or os.path.abspath(f"suite-timeline-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "timeline_*.jsonl")):
        os.remove(old)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, **{_OUT_ENV: out})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
    started = time.monotonic()
    code = subprocess.call([*command, "-p", "suite_timeline"], env=env)
    wall = time.monotonic() - started
    records = []
    for path in sorted(glob.glob(os.path.join(out, "timeline_*.jsonl"))):
        with open(path) as f:
            records += [json.loads(line) for line in f if line.strip()]
    print(f"\n{' '.join(command)}: exit {code}, {wall:.0f} s wall; records in {out}")
    print(summarise(records, args.top))
    return code


if __name__ == "__main__":
    sys.exit(main())
