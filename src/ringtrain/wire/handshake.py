"""The channel's authentication: a mutual HMAC-SHA256 challenge-response over a raw socket, and
a listener whose handshakes no stranger can stall.

Protocol (every message has a fixed length, so nothing is parsed, let alone unpickled, before
both sides have proved that they hold the run's secret ``key``)::

    driver -> worker   MAGIC (14 bytes) + s_nonce (32 random bytes)
    worker -> driver   c_nonce (32 random bytes) + HMAC-SHA256(key, "worker" + s_nonce + c_nonce)
    driver -> worker   HMAC-SHA256(key, "driver" + s_nonce + c_nonce)   or REJECT (32 bytes)

Digests are compared with :func:`hmac.compare_digest`. Only then is the socket wrapped in a
:class:`multiprocessing.connection.Connection` (whose ``recv`` unpickles). This replaces
``multiprocessing.connection``'s own challenge, which on Python 3.11 is HMAC-MD5 and runs
inside ``Listener.accept()`` with no timeout, so one idle client stalled every later one.

:class:`HandshakeListener` runs every pending handshake in one ``selectors`` loop, non-blocking:
no client can block it, each handshake has a deadline (:data:`HANDSHAKE_TIMEOUT_S`) after which
it is dropped, and the number of pending handshakes is capped (the oldest is dropped first).
This module imports neither torch nor the rest of ringtrain.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

logger = logging.getLogger("ringtrain")

MAGIC = b"ringtrain-ch1\n"
"""Opens the driver's challenge (protocol version 1)."""
NONCE_BYTES = 32
DIGEST_BYTES = 32  # SHA-256
REJECT = b"ringtrain: wrong key, rejected.\n"
"""What the driver sends instead of its proof when the worker's digest is wrong (32 bytes)."""
assert len(REJECT) == DIGEST_BYTES
HANDSHAKE_TIMEOUT_S = 5.0
"""Seconds a client has, from its ``connect``, to answer the challenge; then it is dropped. A
worker whose handshake was dropped (a starved machine) connects again."""
MAX_PENDING_HANDSHAKES = 4096
"""Connections waiting for their answer at most; beyond it the oldest pending one is dropped."""


def listen_backlog(world_size: int) -> int:
    """The listen backlog for a group of ``world_size`` workers: ``max(128, 2 * world_size)``."""
    return max(128, 2 * int(world_size))


def listen_socket(host: str, backlog: int = 128) -> socket.socket:
    """A TCP socket bound to ``host`` (an IPv4 or IPv6 address, never the wildcard unless
    asked), port chosen by the OS, listening with ``backlog``. Not inheritable.

    Raises:
        OSError: if ``host`` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def no_delay(sock: socket.socket) -> None:
    """Turn Nagle's algorithm off on a TCP ``sock`` (``TCP_NODELAY``; no-op on other sockets).

    The channel's messages are small and each one matters at once. With Nagle on, a message sent
    while an earlier one is not yet acknowledged waits in the sender's queue (up to the peer's
    delayed-ACK timer, ~40 ms on Linux); and a socket closed while data from its peer is still
    unread is *reset*, which discards that queue: a worker's last messages (``CheckpointDone``,
    ``PreemptSaved``, ``Done``) were lost that way when the driver's ``PreemptRequest`` was still
    unread at its exit (the intermittent workers-SIGTERM preemption failure, issue 19).
    """
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def close_gracefully(conn: Connection, timeout_s: float = 5.0) -> None:
    """Close a channel connection without losing what was sent on it.

    ``shutdown(SHUT_WR)`` first, which pushes every queued byte out followed by a FIN; then read
    and discard what the peer still sends until it closes its end (the driver's reader does at
    end of file) or ``timeout_s`` seconds pass; then close. A plain ``close()`` with unread data
    from the peer sends a TCP reset instead, and a reset discards the bytes still queued for
    sending (see :func:`no_delay`). Never raises :class:`OSError`.
    """
    try:
        fd = conn.fileno()
    except OSError:
        return  # already closed
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        with contextlib.suppress(OSError):
            conn.close()
        return
    try:
        sock.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                break  # the peer closed its end: nothing of ours is in flight any more
    except OSError:
        pass  # not connected any more, reset by the peer, or the timeout: close anyway
    finally:
        sock.close()
        with contextlib.suppress(OSError):
            conn.close()


def abort(conn: Connection) -> None:
    """Close a channel connection at once, and wake the thread blocked reading it: its socket
    is ended both ways first (closing a descriptor does not wake a blocked ``recv``, and a peer
    cut off by a network partition never sends the end of file that would). What was in
    flight is lost. Never raises :class:`OSError`."""
    with contextlib.suppress(OSError, ValueError):
        sock = socket.socket(fileno=conn.fileno())
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.detach()  # the connection still owns the descriptor
    with contextlib.suppress(OSError):
        conn.close()


def _digest(key: bytes, side: bytes, s_nonce: bytes, c_nonce: bytes) -> bytes:
    return hmac.new(key, side + s_nonce + c_nonce, hashlib.sha256).digest()


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError(
                f"the driver closed the channel during the handshake ({len(buf)} of {n} bytes)"
            )
        buf += chunk
    return buf


def client_handshake(sock: socket.socket, key: bytes) -> None:
    """Authenticate a connected blocking ``sock`` to the driver with ``key`` (both ways).

    Raises:
        AuthenticationError: the driver rejected ``key``, or it did not prove it holds it.
        ConnectionError: the driver closed the connection (e.g. it dropped a handshake that
            timed out): connect again.
        OSError: on socket errors and timeouts (``sock``'s timeout applies to each step).
    """
    challenge = _recv_exactly(sock, len(MAGIC) + NONCE_BYTES)
    if not challenge.startswith(MAGIC):
        raise AuthenticationError(
            "the channel's peer is not a ringtrain driver (or runs an incompatible version)"
        )
    s_nonce = challenge[len(MAGIC) :]
    c_nonce = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(c_nonce + _digest(key, b"worker", s_nonce, c_nonce))
    answer = _recv_exactly(sock, DIGEST_BYTES)
    if hmac.compare_digest(answer, REJECT):
        raise AuthenticationError("the driver rejected this worker's key (RINGTRAIN_AUTHKEY)")
    if not hmac.compare_digest(answer, _digest(key, b"driver", s_nonce, c_nonce)):
        raise AuthenticationError("the channel's peer does not hold the run's key")


def connect(host: str, port: int, key: bytes, timeout_s: float) -> Connection:
    """Connect to a :class:`HandshakeListener` and authenticate; retries refused, reset and
    dropped connections (the driver may not listen yet, or dropped a slow handshake) until
    ``timeout_s`` seconds have passed.

    Raises:
        AuthenticationError: at once, if the driver rejected ``key`` (no retry).
        OSError: the last connection error, after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.05
    while True:
        try:
            sock = socket.create_connection(
                (host, port), timeout=min(HANDSHAKE_TIMEOUT_S, max(0.1, timeout_s))
            )
            try:
                client_handshake(sock, key)
                sock.settimeout(None)  # blocking, as Connection expects
                no_delay(sock)
            except BaseException:
                sock.close()
                raise
            return Connection(sock.detach())
        except AuthenticationError:
            raise
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(pause)
            pause = min(1.0, pause * 2)


@dataclass(eq=False)
class _Pending:
    sock: socket.socket
    s_nonce: bytes
    deadline: float
    buf: bytes = b""


class HandshakeListener:
    """Listens on ``sock`` and hands each connection that answers the challenge with ``key`` to
    ``on_connection`` as a :class:`~multiprocessing.connection.Connection`.

    One daemon thread runs the accepts and every pending handshake without blocking on any
    client. A client that sends a wrong answer is sent :data:`REJECT` and closed; one that has
    not answered within ``handshake_timeout_s`` is closed; beyond ``max_pending`` waiting
    clients the oldest is closed. ``on_connection`` is called on that thread: keep it short
    (start a reader thread).

    Args:
        sock: a bound, listening socket (see :func:`listen_socket`); the listener owns it.
        key: the run's secret.
        on_connection: receives each authenticated connection.
        handshake_timeout_s: seconds from accept to a complete answer.
        max_pending: handshakes in progress at most.
    """

    def __init__(
        self,
        sock: socket.socket,
        key: bytes,
        on_connection: Callable[[Connection], object],
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        max_pending: int = MAX_PENDING_HANDSHAKES,
    ) -> None:
        if handshake_timeout_s <= 0:
            raise ValueError(f"handshake_timeout_s must be > 0, got {handshake_timeout_s}")
        self._sock = sock
        self._key = key
        self._on_connection = on_connection
        self._timeout_s = handshake_timeout_s
        self._max_pending = max(1, max_pending)
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order = oldest first
        self._closed = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        sock.setblocking(False)
        self._wake_r.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self.rejected = 0  # wrong answers (for tests and diagnostics)
        self.timed_out = 0  # dropped: no complete answer in time, or evicted as the oldest
        self._warned_at = -1e9
        self.address: tuple[str, int] = sock.getsockname()[:2]
        self._thread = threading.Thread(target=self._loop, name="ringtrain-accept", daemon=True)
        self._thread.start()

    def pending(self) -> int:
        """Handshakes in progress now."""
        return len(self._pending)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        try:
            while not self._closed.is_set():
                wait = 0.5
                if self._pending:
                    oldest = next(iter(self._pending.values()))
                    wait = min(wait, max(0.0, oldest.deadline - time.monotonic()))
                for key, _ in self._selector.select(wait):
                    if key.fileobj is self._sock:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(64)
                    else:
                        pending = self._pending.get(key.fileobj)  # type: ignore[call-overload]
                        if pending is not None:
                            self._advance(pending)
                self._expire()
        except Exception:  # never expected; the workers then time out connecting
            logger.exception("ringtrain: the channel's accept loop failed")
        finally:
            for pending in list(self._pending.values()):
                self._drop(pending)
            self._selector.close()
            for s in (self._sock, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        for _ in range(64):  # then serve the pending ones before accepting more
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: make room, try a moment later
                now = time.monotonic()
                if now - self._warned_at > 10.0:
                    self._warned_at = now
                    logger.warning("ringtrain: channel accept failed: %s", exc)
                if self._pending:
                    self.timed_out += 1
                    self._drop(next(iter(self._pending.values())))
                else:
                    time.sleep(0.05)  # the listening socket stays readable: do not spin
                return
            conn.setblocking(False)
            s_nonce = secrets.token_bytes(NONCE_BYTES)
            try:
                sent = conn.send(MAGIC + s_nonce)
            except OSError:
                sent = -1
            if sent != len(MAGIC) + NONCE_BYTES:  # a fresh socket takes 46 bytes at once
                conn.close()
                continue
            while len(self._pending) >= self._max_pending:
                self.timed_out += 1
                self._drop(next(iter(self._pending.values())))
            pending = _Pending(conn, s_nonce, time.monotonic() + self._timeout_s)
            self._pending[conn] = pending
            self._selector.register(conn, selectors.EVENT_READ)

    def _advance(self, p: _Pending) -> None:
        want = NONCE_BYTES + DIGEST_BYTES - len(p.buf)
        try:
            chunk = p.sock.recv(want)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(p)
            return
        if not chunk:
            self._drop(p)
            return
        p.buf += chunk
        if len(p.buf) < NONCE_BYTES + DIGEST_BYTES:
            return
        c_nonce, answer = p.buf[:NONCE_BYTES], p.buf[NONCE_BYTES:]
        if not hmac.compare_digest(answer, _digest(self._key, b"worker", p.s_nonce, c_nonce)):
            self.rejected += 1
            with contextlib.suppress(OSError):
                p.sock.send(REJECT)
            self._drop(p)
            return
        self._forget(p)
        try:
            p.sock.setblocking(True)
            p.sock.settimeout(self._timeout_s)
            p.sock.sendall(_digest(self._key, b"driver", p.s_nonce, c_nonce))
            p.sock.settimeout(None)
        except OSError:
            p.sock.close()
            return
        no_delay(p.sock)
        conn = Connection(p.sock.detach())
        try:
            self._on_connection(conn)
        except Exception:
            logger.exception("ringtrain: handling a channel connection failed")
            with contextlib.suppress(OSError):
                conn.close()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending.values()))
            if oldest.deadline > now:
                return
            self.timed_out += 1
            self._drop(oldest)

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(p.sock)

    def _drop(self, p: _Pending) -> None:
        self._forget(p)
        with contextlib.suppress(OSError):
            p.sock.close()

    # ------------------------------------------------------------------ contract
    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, drop the pending handshakes and close the socket (the connections
        already handed out stay open). Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
