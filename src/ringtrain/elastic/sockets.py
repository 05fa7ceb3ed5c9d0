"""Closing a broken gloo group's connections, so that no survivor stays blocked on a live peer.

When a rank dies, gloo fails the pending operations on the pairs connected to it, but not an
operation waiting for a *live* peer that has itself left the collective. In a ring allreduce of
three ranks where rank 0 dies, rank 2 fails at once (it talks to rank 0), while rank 1 can be
waiting for data from rank 2 (``UnboundBuffer::waitRecv``) that rank 2 will never send. Rank 1
wakes only when rank 2's connection to it closes, and ``destroy_process_group`` closes nothing
while something still references the group (a DDP model held by the user's code, a reducer,
a communication hook): so rank 1 waited for the collective timeout. ``ProcessGroupGloo.abort()``
and ``shutdown()`` do not close the pairs either (torch 2.13), and ``suspend()`` terminates the
process.

So each elastic worker notes the TCP sockets that creating its gloo group opened (the full mesh
gloo connects at construction: one socket per peer and context; not its listener), and when the
group fails it ``shutdown(2)``\\s them before tearing the group down. Every peer still waiting on
this rank then gets ``Connection closed by peer`` at once and does the same, so the failure
reaches every survivor within milliseconds. The file descriptors stay open (gloo closes them when
the group is freed); ``shutdown`` only ends the connections, so no descriptor number is ever
reused under gloo. Linux only (``/proc``); elsewhere nothing is noted and the survivors wait for
the collective timeout as before.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Errors of a collective whose peer process went away (the same families the controller treats as
# secondary failures).
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"failed to recv|remote process exited|DistNetworkError|DistBackendError",
    re.IGNORECASE,
)


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says a collective's peer is gone."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if PEER_LOST.search(f"{type(current).__name__} {current}"):
            return True
        current = current.__cause__ or current.__context__
    return False


_PROC_FD = "/proc/self/fd"
_PROC_TCP = ("/proc/self/net/tcp", "/proc/self/net/tcp6")


def _socket_fds() -> dict[int, int]:
    """``{fd: inode}`` of this process's open sockets; empty where ``/proc`` is missing."""
    found: dict[int, int] = {}
    try:
        names = os.listdir(_PROC_FD)
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"{_PROC_FD}/{name}")
        except OSError:
            continue  # closed meanwhile (or the listing's own descriptor)
        if target.startswith("socket:["):
            found[int(name)] = int(target[8:-1])
    return found


_TCP_LISTEN = "0A"  # the state column of a listening socket (include/net/tcp_states.h)


def _tcp_ports() -> dict[int, tuple[int, int]]:
    """``{inode: (local port, remote port)}`` of the connected TCP sockets in this network
    namespace (not the listening ones: shutting down gloo's listener makes its accept loop
    terminate the process)."""
    ports: dict[int, tuple[int, int]] = {}
    for path in _PROC_TCP:
        try:
            with open(path) as table:
                lines = table.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] != _TCP_LISTEN:
                local, remote = (int(f.rsplit(":", 1)[1], 16) for f in fields[1:3])
                ports[int(fields[9])] = (local, remote)
    return ports


class GroupSockets:
    """The TCP sockets a process-group constructor opened in this process.

    Args:
        fds: ``{fd: inode}`` of those sockets.
    """

    def __init__(self, fds: dict[int, int] | None = None) -> None:
        self.fds = dict(fds or {})

    @classmethod
    def opened_by(
        cls, create: Callable[[], T], store_port: int | None = None
    ) -> tuple[T, GroupSockets]:
        """Call ``create()`` (which builds a gloo group) and note the TCP sockets it opened,
        leaving out connections to or from the rendezvous store at ``store_port`` (those must
        outlive the group: the next generation rendezvouses through the same store). A TCP
        connection another thread of this process opens meanwhile is noted too (in a Ray actor,
        say, a gRPC channel to the raylet, which gRPC re-opens if it is later shut down); the
        window is the group's rendezvous, milliseconds.

        Returns:
            ``(create's result, GroupSockets)``.
        """
        before = _socket_fds()
        result = create()
        opened = {fd: inode for fd, inode in _socket_fds().items() if before.get(fd) != inode}
        tcp = _tcp_ports()
        keep = {
            fd: inode
            for fd, inode in opened.items()
            if inode in tcp and store_port not in tcp[inode]
        }
        return result, cls(keep)

    def shutdown(self) -> int:
        """End every noted connection that is still the same socket (``shutdown(SHUT_RDWR)``; the
        descriptors stay open). Never raises.

        Returns:
            how many sockets were shut down.
        """
        current = _socket_fds()
        count = 0
        for fd, inode in self.fds.items():
            if current.get(fd) != inode:
                continue  # gloo closed it already: the number may now be someone else's
            try:
                sock = socket.socket(fileno=fd)
            except OSError:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)
                count += 1
            except OSError:
                pass  # not connected (the listener) or already reset
            finally:
                sock.detach()  # never close gloo's descriptor
        self.fds.clear()
        return count
