"""The test bed itself (ringtrain.testing.netbed): hosts that reach each other and nothing
else, a link that is cut and healed, a bandwidth limit, a lost host, and a teardown that leaves
nothing behind, also when the process that made the bed is killed."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringtrain.testing import netbed
from ringtrain.testing.netbed import NetBed
from support import pid_alive, wait_until

TOOLS = str(Path(__file__).with_name("net_tools.py"))


def _sink(bed: NetBed, host) -> tuple[subprocess.Popen, int]:
    proc = bed.popen(
        host, [sys.executable, TOOLS, "sink", host.address], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _send(bed: NetBed, host, to, port: int, nbytes: int = 1, timeout_s: float = 2.0) -> str:
    cmd = [sys.executable, TOOLS, "send", to.address, str(port), str(nbytes), str(timeout_s)]
    return bed.run(host, cmd, timeout=120).stdout.strip()


def _mine(bed: NetBed) -> list[str]:
    return [x for x in netbed.leftovers() if bed.id in x]


def test_hosts_reach_each_other_and_nothing_else(bed):
    h1, h2 = bed.hosts
    assert bed.run(h2, ["hostname"]).stdout.strip() == "h2"
    assert bed.run(h2, ["getent", "hosts", "h1"]).stdout.split()[0] == h1.address
    # The Debian trap, on purpose: a host's own name resolves to loopback.
    assert bed.run(h2, ["getent", "hosts", "h2"]).stdout.split()[0] == "127.0.1.1"
    sink, port = _sink(bed, h1)
    try:
        assert not _send(bed, h2, h1, port).startswith("error")
        # The machine's own namespace has no address on the bed's network: no route there.
        with pytest.raises(OSError):
            import socket

            socket.create_connection((h1.address, port), timeout=2).close()
    finally:
        sink.kill()
        sink.wait()


def test_a_cut_link_passes_nothing_until_it_heals_and_its_processes_keep_running(bed):
    h1, h2 = bed.hosts
    sink, port = _sink(bed, h1)
    try:
        bed.cut(h1)
        assert "timed out" in _send(bed, h2, h1, port, timeout_s=1.0)
        assert sink.poll() is None  # cut off, not killed
        bed.heal(h1)
        assert wait_until(lambda: not _send(bed, h2, h1, port).startswith("error"), 30)
    finally:
        sink.kill()
        sink.wait()


def test_a_limited_link_carries_no_more_than_its_rate(bed):
    """8 Mbit/s: 1 MB takes at least a second (a slow machine only makes it slower)."""
    h1, h2 = bed.hosts
    sink, port = _sink(bed, h1)
    try:
        bed.limit(h2, 8)
        took = float(_send(bed, h2, h1, port, nbytes=1_000_000, timeout_s=60))
        assert took >= 0.9, f"1 MB over an 8 Mbit/s link took {took} s"
        bed.limit(h2, None)
        out = bed.run(h2, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" not in out
    finally:
        sink.kill()
        sink.wait()


def test_a_lost_host_has_no_process_left(bed):
    h1, _ = bed.hosts
    sleeper = bed.popen(h1, ["sleep", "600"])
    assert wait_until(lambda: len(bed.pids(h1)) >= 1, 10)
    bed.kill_host(h1)
    assert sleeper.wait(timeout=10) == -signal.SIGKILL
    assert bed.pids(h1) == []


def test_teardown_leaves_nothing():
    made = NetBed(hosts=3, rate_mbit=100).up()
    sleeper = made.popen(made.hosts[2], ["sleep", "600"])
    assert _mine(made)
    made.down()
    assert _mine(made) == []
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


_OWNER = """
import sys, time
sys.path[:0] = {path!r}
from ringtrain.testing.netbed import NetBed
bed = NetBed(hosts=2).up()
sleeper = bed.popen(bed.hosts[1], ["sleep", "600"])
print(bed.id, sleeper.pid, flush=True)
time.sleep(600)
"""


def test_a_bed_whose_owner_was_killed_is_swept():
    owner = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_OWNER.format(path=sys.path))],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    bed_id, sleeper = owner.stdout.readline().split()
    assert wait_until(lambda: pid_alive(int(sleeper)), 10)
    left = [x for x in netbed.leftovers() if bed_id in x]
    assert any(x.startswith("netns") for x in left), left
    owner.send_signal(signal.SIGKILL)  # no atexit, no finally
    owner.wait()
    assert [x for x in netbed.leftovers() if bed_id in x]
    assert bed_id in netbed.sweep()
    assert [x for x in netbed.leftovers() if bed_id in x] == []
    assert wait_until(lambda: not pid_alive(int(sleeper)), 10), "a process of the bed survived"
