"""A worker's last messages reach the driver even when it exits with a driver message unread.

The intermittent workers-SIGTERM preemption failure (issue 19): a worker sent ``CheckpointDone``,
its stop round's ``Report``, ``PreemptSaved`` and ``Done``, and exited 0, but the driver never
read them. Two things together lost them: with Nagle's algorithm on, a small message sent while
an earlier one is unacknowledged waits in the sender's queue; and closing a TCP socket while the
peer's data (here the driver's ``PreemptRequest``) is still unread sends a reset, which discards
that queue. These tests recreate that exit over loopback TCP with the real channel classes (no
processes) and fail without ``handshake.no_delay`` and ``handshake.close_gracefully``.
"""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing.connection import Connection

from ringtrain.wire import handshake
from ringtrain.wire.channel import DriverListener, WorkerChannel, new_authkey

BEFORE, AFTER = 20, 6  # messages read while they come, then the burst sent just before exit


class _Driver:
    """``on_connection`` that reads each connection as ``ChannelGroup._read`` does: every
    message until end of file or a reset, then closes its end."""

    def __init__(self) -> None:
        self.conns: list[Connection] = []
        self.got: list[object] = []
        self.ended = threading.Event()
        self.connected = threading.Event()

    def __call__(self, conn: Connection) -> None:
        self.conns.append(conn)
        self.connected.set()
        threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: Connection) -> None:
        try:
            while True:
                self.got.append(conn.recv())
        except (EOFError, OSError) as exc:
            self.got.append(type(exc).__name__)
        finally:
            conn.close()
            self.ended.set()


def _exit_with_an_unread_request(send, driver_conn: Connection) -> None:
    """The worker's side of the failing exit: messages spaced like reports, the driver's
    request (never read), then a burst of small messages."""
    for i in range(BEFORE):
        send(("report", i))
        time.sleep(0.002)
    driver_conn.send(("PreemptRequest", "never read by the worker"))
    time.sleep(0.01)  # the request is in the worker's receive buffer
    for i in range(BEFORE, BEFORE + AFTER):
        send(("report", i))


def _messages(got: list[object]) -> list[object]:
    return [g for g in got if isinstance(g, tuple)]


def test_a_worker_channel_delivers_everything_it_sent_before_closing():
    driver = _Driver()
    key = new_authkey()
    listener = DriverListener(key, driver)
    try:
        channel = WorkerChannel.connect(listener.address, key, timeout_s=30)
        assert driver.connected.wait(30)
        sock = socket.socket(fileno=channel.conn.fileno())
        try:  # Nagle is off on the worker's end (and on the driver's)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            sock.detach()
        _exit_with_an_unread_request(channel.send, driver.conns[0])
        channel.close()
        assert driver.ended.wait(30)
    finally:
        listener.close()
    expected = [("report", i) for i in range(BEFORE + AFTER)]
    assert _messages(driver.got) == expected, driver.got[-3:]
    assert driver.got[-1] == "EOFError"  # a FIN after the data, not a reset


def test_close_gracefully_loses_nothing_even_with_nagle_on():
    """``close_gracefully`` alone, on a raw TCP pair with Nagle left on (a plain ``close()``
    here lost the burst in every one of 100 runs on this machine: reset by the kernel)."""
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    client = socket.create_connection(listening.getsockname())
    server, _ = listening.accept()
    listening.close()
    driver = _Driver()
    worker = Connection(client.detach())
    driver(Connection(server.detach()))
    _exit_with_an_unread_request(worker.send, driver.conns[0])
    handshake.close_gracefully(worker, timeout_s=30)
    assert driver.ended.wait(30)
    assert len(_messages(driver.got)) == BEFORE + AFTER, driver.got[-3:]
    assert driver.got[-1] == "EOFError"


def test_close_gracefully_gives_up_on_a_peer_that_never_closes_and_never_raises():
    a, b = socket.socketpair()
    conn = Connection(a.detach())
    started = time.monotonic()
    handshake.close_gracefully(conn, timeout_s=0.2)
    assert conn.closed and time.monotonic() - started >= 0.2
    handshake.close_gracefully(conn)  # already closed: nothing happens
    b.close()


def test_abort_wakes_a_reader_whose_peer_is_silent():
    # A worker cut off by a partition sends nothing, not even the end of file: the driver's
    # reader of its connection stays in recv(), and closing the descriptor does not wake it
    # (the group's teardown waited 10 s per such reader). abort() ends the socket first.
    server = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    conn = Connection(accepted.detach())
    ended = threading.Event()

    def read() -> None:
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
        ended.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.2)  # in recv(), as the reader of a silent worker is
    handshake.abort(conn)
    try:
        assert ended.wait(10), "the reader is still blocked after abort()"
        assert conn.closed
    finally:
        peer.close()
        server.close()
