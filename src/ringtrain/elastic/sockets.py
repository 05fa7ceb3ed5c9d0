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

import re
import socket
from collections.abc import Callable
from typing import TypeVar

from ringtrain.cluster.netif import give_up_after, socket_fds, tcp_opened_by

T = TypeVar("T")

# Errors of a collective whose peer process went away (the same families the controller treats as
# secondary failures).
PEER_LOST = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"failed to recv|Connection timed out|remote process exited|DistNetworkError|DistBackendError",
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
        result, keep = tcp_opened_by(create, store_port)
        return result, cls(keep)

    def give_up_after(self, timeout_s: float | None) -> int:
        """Make every noted connection fail once its peer has been silent for ``timeout_s``
        (:func:`ringtrain.cluster.netif.give_up_after`): a survivor of a partition then sees
        its lost peer's connections fail, and the group re-forms without it."""
        return give_up_after(self.fds, timeout_s)

    def shutdown(self) -> int:
        """End every noted connection that is still the same socket (``shutdown(SHUT_RDWR)``; the
        descriptors stay open). Never raises.

        Returns:
            how many sockets were shut down.
        """
        current = socket_fds()
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
