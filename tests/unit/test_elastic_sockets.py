"""Shutting down a gloo group's connections (ringtrain/elastic/sockets.py) on a real gloo group:
two ranks in two threads of this process, over TCP on localhost."""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ringtrain.cluster.netif import socket_fds as _socket_fds
from ringtrain.cluster.netif import tcp_ports as _tcp_ports
from ringtrain.elastic.sockets import GroupSockets

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")


def _store():
    return dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False
    )


def _two_ranks(port: int) -> list:
    """Two ProcessGroupGloo ranks built in two threads (each with its own store client)."""
    groups: list = [None, None]

    def build(rank: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=build, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g is not None for g in groups)
    return groups


def test_notes_the_groups_connections_but_not_the_store():
    master = _store()
    before = set(_socket_fds().values())
    groups, noted = GroupSockets.opened_by(lambda: _two_ranks(master.port), store_port=master.port)
    tcp = _tcp_ports()
    assert noted.fds, "creating a gloo group opened no TCP connection?"
    assert all(inode in tcp for inode in noted.fds.values())  # connected TCP sockets only
    assert all(master.port not in tcp[inode] for inode in noted.fds.values())
    # The store connections opened meanwhile (each client's and the server's side) were seen
    # and left out.
    opened = set(_socket_fds().values()) - before
    store_side = [i for i in opened if i in tcp and master.port in tcp[i]]
    assert len(store_side) >= 4
    assert not set(store_side) & set(noted.fds.values())
    # Noting touched nothing: the group still works.
    tensors = [torch.ones(3), torch.ones(3)]
    works = [g.allreduce([t]) for g, t in zip(groups, tensors, strict=True)]
    for w in works:
        w.wait()
    assert torch.equal(tensors[0], torch.full((3,), 2.0))


def test_shutdown_wakes_a_peer_blocked_on_this_rank():
    master = _store()
    groups, noted = GroupSockets.opened_by(lambda: _two_ranks(master.port), store_port=master.port)
    # Rank 1 waits for a message rank 0 never sends, as a survivor waits in a ring allreduce
    # for a peer that already left the collective.
    box = torch.zeros(4)
    work = groups[1].recv([box], 0, 0)
    outcome: dict = {}

    def wait() -> None:
        started = time.monotonic()
        try:
            work.wait()
            outcome["error"] = None
        except RuntimeError as exc:
            outcome["error"] = str(exc)
        outcome["waited"] = time.monotonic() - started

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # blocked, as it would be for the whole 60 s timeout
    closed = noted.shutdown()
    waiter.join(timeout=20)
    assert not waiter.is_alive(), "the blocked receive was not woken"
    assert closed > 0
    assert outcome["error"] is not None and "closed" in outcome["error"].lower()
    assert noted.fds == {}  # a second shutdown touches nothing
    assert noted.shutdown() == 0


def test_shutdown_skips_a_descriptor_that_is_now_another_socket():
    a, b = socket.socketpair()
    try:
        fd = a.fileno()
        inode = _socket_fds()[fd]
        stale = GroupSockets({fd: inode + 1})  # the number was reused by another socket
        assert stale.shutdown() == 0
        b.sendall(b"x")
        assert a.recv(1) == b"x"  # still connected
    finally:
        a.close()
        b.close()


def _drop_in_thread(release) -> bool:
    """Run ``release`` (which drops the last references to a group) on a thread; whether it
    returned within 10 s (a gloo group whose collective still runs blocks in its destructor)."""
    done = threading.Event()

    def run() -> None:
        release()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(10)


def test_a_collective_in_flight_settles_once_the_connections_are_ended():
    """What ``ElasticRuntime.break_group`` relies on: after the group's connections are shut
    down, a collective still waiting for a peer ends at once (with an error), and the group can
    then be destroyed without blocking."""
    from ringtrain.cluster.distributed import settle

    master = _store()
    groups, noted = GroupSockets.opened_by(lambda: _two_ranks(master.port), store_port=master.port)
    work = groups[0].allreduce([torch.ones(4)])  # rank 1 never joins it
    noted.shutdown()
    started = time.monotonic()
    assert settle(work, timeout_s=5.0)
    assert time.monotonic() - started < 5.0
    box = {"groups": groups, "work": work}
    del groups, work
    assert _drop_in_thread(box.clear), "the group's destructor blocked"


def test_a_collective_that_does_not_end_keeps_its_group_alive_instead_of_blocking():
    """The hazard ``settle`` guards against: with the connections left up, the collective
    never ends and dropping the group's last reference blocks; ``settle`` gives up after its
    timeout and keeps the group referenced, so dropping ours does not block."""
    from ringtrain.cluster import distributed

    master = _store()
    groups = _two_ranks(master.port)
    work = groups[0].allreduce([torch.ones(4)])
    kept = len(distributed._KEPT)
    assert not distributed.settle(work, groups[0], timeout_s=0.5)
    assert len(distributed._KEPT) == kept + 1
    box = {"groups": groups, "work": work}
    del groups, work
    assert _drop_in_thread(box.clear), "a kept group's destructor ran"
