"""Where a command's CPU time goes, by kind of process: run it under Linux process accounting and
sort every process that ran into zygotes, forked workers, cold workers, Ray's processes, drivers
started by the tests, pytest, reapers, browsers.

    sudo python benchmarks/suite_cpu.py -- python -m pytest -p no:cacheprovider --ignore=tests/unit
    sudo python benchmarks/suite_cpu.py --top 30 -- python examples/mnist.py

Needs root and the ``acct`` package (``apt-get install acct``: ``accton``, ``dump-acct``). Process
accounting writes one record per process when it exits (its own user and system CPU time, pid,
parent pid; not its children's), so every process is counted once, however short-lived. What a
record lacks, the command line, comes from a sampler that reads ``/proc/PID/cmdline`` and the
``PYTEST_CURRENT_TEST`` variable of every new process every 0.2 s (a process that lives less than
that is counted under ``short:`` with its 16-character name). A process forked without ``exec``
(a worker forked by the zygote) shows its parent's command line: the zygote's children are told
apart by their parent.

Reported: the command's wall time, the machine's busy share (``/proc/stat``), total CPU seconds by
kind of process (count, seconds, share), and the ``--top`` command lines of processes that the
pytest workers started (drivers of the CLI and example tests) by CPU seconds.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

TICK_S = 0.01  # dump-acct prints times in clock ticks of 1/100 s (AHZ)


def _sample(out: list[dict[str, Any]], stop: threading.Event) -> None:
    """Every 0.2 s: each process not seen before, with its parent, cmdline and test."""
    seen: set[str] = set()
    while not stop.is_set():
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or entry in seen:
                continue
            seen.add(entry)
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{entry}/environ", "rb") as f:
                    env = f.read().split(b"\0")
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            marker = b"PYTEST_CURRENT_TEST="
            test = next((kv[len(marker) :].decode() for kv in env if kv.startswith(marker)), "")
            out.append({"pid": int(entry), "ppid": ppid, "cmd": cmd[:300], "test": test})
        stop.wait(0.2)


def _accounting(path: str) -> dict[int, tuple[str, float]]:
    """``{pid: (name, CPU seconds)}`` from the accounting file."""
    rows = subprocess.run(["dump-acct", path], capture_output=True, text=True, check=True)
    found = {}
    for row in rows.stdout.splitlines():
        f = [x.strip() for x in row.split("|")]
        try:
            found[int(f[9])] = (f[0], (float(f[2]) + float(f[3])) * TICK_S)
        except (IndexError, ValueError):
            continue
    return found


def _kind(pid: int, procs: dict[int, dict[str, Any]], name: str) -> str:
    p = procs.get(pid)
    if p is None:
        return f"short:{name}"
    cmd, parent = p["cmd"], procs.get(p["ppid"], {}).get("cmd", "")
    if "ringtrain.launch.zygote" in cmd:
        return "worker (forked by a zygote)" if "ringtrain.launch.zygote" in parent else "zygote"
    if "ringtrain.launch.worker" in cmd:
        return "worker (cold: python -m ringtrain.launch.worker)"
    if "ringtrain/launch/reaper.py" in cmd:
        return "reaper"
    if "execnet" in cmd or "exec(eval(" in cmd or " -m pytest" in cmd:
        return "pytest"
    if "chrom" in cmd:
        return "chromium"
    if "ray" in cmd.lower() or "gcs_server" in cmd:
        return "ray (its own processes and actors)"
    if "python" in cmd:
        return "other python (drivers started by tests, examples, kernels)"
    return "other"


def _cpu_stat() -> list[int]:
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=15, help="driver command lines to list")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to measure after --")
    fd, acct_path = tempfile.mkstemp(prefix="rt-acct-")
    os.close(fd)
    sampled: list[dict[str, Any]] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(sampled, stop), daemon=True)
    subprocess.run(["accton", acct_path], check=True, stdout=subprocess.DEVNULL)
    try:
        sampler.start()
        stat0, t0 = _cpu_stat(), time.monotonic()
        code = subprocess.call(command)
        wall, stat1 = time.monotonic() - t0, _cpu_stat()
    finally:
        subprocess.run(["accton", "off"], check=False, stdout=subprocess.DEVNULL)
        stop.set()
        sampler.join()
    procs = {p["pid"]: p for p in sampled}
    records = _accounting(acct_path)
    os.unlink(acct_path)
    ticks = [b - a for a, b in zip(stat0, stat1, strict=True)]
    busy = 1 - (ticks[3] + ticks[4]) / max(1, sum(ticks))  # idle + iowait
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for pid, (name, cpu) in records.items():
        by_kind[_kind(pid, procs, name)].append(cpu)
    total = sum(sum(v) for v in by_kind.values())
    print(
        f"exit status {code}; wall {wall:.0f} s; machine busy {busy:.0%} ({os.cpu_count()} cores)"
    )
    print(f"CPU seconds of every process that ran: {total:.0f}")
    print(f"{'kind of process':58}{'count':>7}{'CPU s':>9}{'share':>7}")
    for kind, cpus in sorted(by_kind.items(), key=lambda kv: -sum(kv[1])):
        if sum(cpus) >= 0.5:
            print(f"{kind:58}{len(cpus):7d}{sum(cpus):9.1f}{sum(cpus) / total:7.1%}")
    pytest_pids = {pid for pid, p in procs.items() if _kind(pid, procs, "") == "pytest"}
    drivers: dict[str, list[float]] = collections.defaultdict(list)
    for pid, p in procs.items():
        if p["ppid"] in pytest_pids and _kind(pid, procs, "").startswith("other python"):
            words = p["cmd"].split()[1:4]
            drivers[" ".join(w.rsplit("/", 1)[-1] for w in words)].append(
                records.get(pid, ("", 0.0))[1]
            )
    if drivers:
        print(f"\nprocesses started by pytest workers, by command (top {args.top}):")
        for cmd, cpus in sorted(drivers.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
            print(f"{sum(cpus):8.1f} s {len(cpus):4d}x  {cmd}")
    print(json.dumps({k: round(sum(v), 1) for k, v in by_kind.items()}), file=sys.stderr)
    sys.exit(code)


if __name__ == "__main__":
    main()
