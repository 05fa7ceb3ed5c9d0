"""Whether the hosts of a Ray worker group answer at the network level, seen from the driver.

A worker whose heartbeats stop may be frozen (its host still answers) or cut off (a network
partition, a lost host: nothing answers). Ray itself notices a silent node only after its
health checks give up (about a minute with Ray's defaults), so the group asks the hosts itself:
:class:`HostWatch` tries a TCP connection to each node's raylet port (which every node of a Ray
cluster must reach anyway) every ``interval_s``, and reports a host that stops answering, and one
that answers again, as :class:`~ringtrain.wire.channel.HostSilent` events of the ranks it runs.
The controller then calls a rank that is unheard for ``worker_timeout_s`` *unreachable* rather
than frozen, asks it for no stacks, and the group's teardown does not wait on it.
:func:`probe_many` is the same probe, once, for a placement that leaves out the nodes that do
not answer. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import select
import socket
import threading
import time
from collections.abc import Callable, Iterable

from ringtrain.wire.channel import Event, HostSilent

logger = logging.getLogger("ringtrain")

INTERVAL_S = 0.5
"""How often the driver probes each node of a group."""
PROBE_TIMEOUT_S = 1.0
"""How long one probe waits for an answer: a host silent for longer does not answer."""

OK, REFUSED, SILENT = "ok", "refused", "silent"


def probe_many(
    addresses: Iterable[tuple[str, int]], timeout_s: float = PROBE_TIMEOUT_S
) -> dict[tuple[str, int], str]:
    """Try a TCP connection to each ``(host, port)`` at once; each is ``"ok"`` (connected),
    ``"refused"`` (the host answered, nothing listens: its Ray node is down) or ``"silent"``
    (no answer within ``timeout_s``: unreachable)."""
    pending: dict[socket.socket, tuple[str, int]] = {}
    result: dict[tuple[str, int], str] = {}
    for address in dict.fromkeys(addresses):
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex(address)
        if code in (0, errno.EINPROGRESS, errno.EALREADY, errno.EWOULDBLOCK):
            pending[sock] = address
        else:
            result[address] = REFUSED if code == errno.ECONNREFUSED else SILENT
            sock.close()
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, writable, _ = select.select([], list(pending), [], left)
        for sock in writable:
            address = pending.pop(sock)
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            result[address] = OK if code == 0 else REFUSED if code == errno.ECONNREFUSED else SILENT
            sock.close()
    for sock, address in pending.items():
        result[address] = SILENT
        sock.close()
    return result


class HostWatch:
    """Probes the nodes of a group every ``interval_s`` on a thread of its own.

    Args:
        nodes: called each round: node id -> ``(host, raylet port, ranks running there)``.
        put: where the :class:`~ringtrain.wire.channel.HostSilent` events go (the group's
            event queue).
        interval_s: seconds between rounds.
        timeout_s: how long a probe waits.
    """

    def __init__(
        self,
        nodes: Callable[[], dict[str, tuple[str, int, list[int]]]],
        put: Callable[[Event], None],
        interval_s: float = INTERVAL_S,
        timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self._nodes = nodes
        self._put = put
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._silent: dict[str, float] = {}  # node id -> Unix time of its first silent probe
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="ringtrain-host-watch", daemon=True)
        self._thread.start()

    def stop(self, wait: bool = True) -> None:
        """End the watch; with ``wait``, wait (at most one probe's time, plus a second) for its
        thread, else let it end by itself (a daemon thread: it ends after its current round)."""
        self._stop.set()
        if wait and self._thread is not None:
            self._thread.join(timeout=self.timeout_s + 1)

    def silent_nodes(self) -> set[str]:
        """The node ids that did not answer the latest probe."""
        with self._lock:
            return set(self._silent)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a probe round must never end the watch
                self.round()
            self._stop.wait(self.interval_s)

    def round(self) -> None:
        """Probe every node once and report the changes."""
        nodes = self._nodes()
        started = time.time()
        status = probe_many([(h, p) for h, p, _ in nodes.values()], self.timeout_s)
        now = time.time()
        for node, (host, port, ranks) in nodes.items():
            silent = status.get((host, port)) == SILENT
            with self._lock:
                was = self._silent.get(node)
                if silent and was is None:
                    self._silent[node] = started
                elif not silent and was is not None:
                    del self._silent[node]
            if silent and was is None:
                logger.warning("host %s (Ray node %s) does not answer", host, node[:8])
                for rank in ranks:
                    self._put(HostSilent(rank=rank, time=now, host=host, since=started))
            elif not silent and was is not None:
                logger.warning("host %s answers again after %.1f s", host, now - was)
                for rank in ranks:
                    self._put(HostSilent(rank=rank, time=now, host=host, since=was, answered=True))


__all__ = ["INTERVAL_S", "OK", "PROBE_TIMEOUT_S", "REFUSED", "SILENT", "HostWatch", "probe_many"]
