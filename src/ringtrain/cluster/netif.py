"""Which network interface a worker's communication uses: the one that routes to the
rendezvous address.

gloo (and NCCL's bootstrap, and TensorPipe) listen on, and advertise to their peers, the address
of ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME``); without it, gloo takes
the address the machine's host name resolves to. On many machines that is a loopback address
(Debian and Ubuntu write ``127.0.1.1 HOSTNAME`` into ``/etc/hosts``; containers often map the
name to ``127.0.0.1``), which gloo then advertises to the other hosts: every connection fails
with ``Connection refused, remote=[127.0.1.1]``. The interface that routes to ``MASTER_ADDR``
is the one the peers can reach (they reach the rendezvous the same way), so a worker on several
hosts uses that one unless told otherwise (:func:`choose_interface`).

Standard library only; the kernel is asked with a UDP ``connect`` (no packet is sent) and
``SIOCGIFADDR`` / ``/proc/net/if_inet6`` (Linux). Elsewhere the choice is left to gloo.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ringtrain.cluster.worker_env import LOOPBACK_IFNAME_VARS

SIOCGIFADDR = 0x8915  # linux/sockios.h
SELF_RENDEZVOUS_WAIT_S = 5.0
"""How long :func:`check_not_self_rendezvous` waits for a rendezvous served on this host."""
T = TypeVar("T")


class NetworkConfigError(RuntimeError):
    """The cluster's network cannot carry the worker group: a worker whose gloo would advertise
    a loopback address to other hosts, that cannot reach the rendezvous or the driver, or that
    resolves the rendezvous name to its own host (the message names the rank, its host, its
    interface or the name and the address)."""


@dataclass(frozen=True)
class InterfaceChoice:
    """What a worker's communication libraries will listen on and advertise.

    Attributes:
        ifname: the interface, e.g. ``"eth0"`` (``None``: it could not be found; gloo then
            falls back to its host-name rule).
        address: the interface's address that routes to the rendezvous (``None`` if unknown).
        source: ``"user"`` (``GLOO_SOCKET_IFNAME`` was set), ``"route"`` (chosen by the route
            to ``master_addr``) or ``"unknown"``.
        master_addr: the rendezvous address it was chosen for.
    """

    ifname: str | None
    address: str | None
    source: str
    master_addr: str

    @property
    def loopback(self) -> bool:
        """Whether the chosen interface is a loopback interface (only this host reaches it)."""
        if self.address is not None:
            with contextlib.suppress(ValueError):
                return ipaddress.ip_address(self.address).is_loopback
        return bool(self.ifname) and str(self.ifname).startswith("lo")

    def describe(self) -> str:
        """``"eth0 (10.77.0.2)"``, ``"lo (127.0.0.1, GLOO_SOCKET_IFNAME)"``."""
        said = "GLOO_SOCKET_IFNAME" if self.source == "user" else None
        parts = [p for p in (self.address, said) if p]
        inner = f" ({', '.join(parts)})" if parts else ""
        return f"{self.ifname or '?'}{inner}"


def resolve(host: str) -> list[str]:
    """The addresses ``host`` resolves to here (an address resolves to itself); ``[]`` when it
    does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def route_source(address: str) -> str | None:
    """The local address the kernel would send from to reach ``address`` (a UDP ``connect``
    sends nothing), or ``None`` when there is no route."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:
        return None
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, 9))
        except OSError:
            return None
        return str(sock.getsockname()[0])


def interface_addresses() -> dict[str, list[str]]:
    """Interface name -> its addresses (IPv4 by ``SIOCGIFADDR``, IPv6 from
    ``/proc/net/if_inet6``); ``{}`` where that cannot be asked (not Linux)."""
    if not sys.platform.startswith("linux"):
        return {}
    import fcntl

    out: dict[str, list[str]] = {}
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    sock.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue  # no IPv4 address
            out.setdefault(name, []).append(socket.inet_ntoa(packed[20:24]))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            cols = line.split()
            if len(cols) >= 6:
                addr = str(ipaddress.ip_address(bytes.fromhex(cols[0])))
                out.setdefault(cols[5], []).append(addr)
    return out


def interface_of(address: str) -> str | None:
    """The interface that holds ``address``, or ``None``."""
    for name, addresses in interface_addresses().items():
        if address in addresses:
            return name
    return None


def choose_interface(master_addr: str, environ: Mapping[str, str]) -> InterfaceChoice:
    """The interface a worker should communicate on to reach the rendezvous at
    ``master_addr``: ``GLOO_SOCKET_IFNAME`` of ``environ`` when set (the user's choice wins),
    else the interface holding the local address that routes to ``master_addr``."""
    user = environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0].strip()
    if user:
        addresses = interface_addresses().get(user, [])
        return InterfaceChoice(user, addresses[0] if addresses else None, "user", master_addr)
    for address in resolve(master_addr):
        source = route_source(address)
        if source is None:
            continue
        return InterfaceChoice(interface_of(source), source, "route", master_addr)
    return InterfaceChoice(None, None, "unknown", master_addr)


def own_addresses(addresses: list[str]) -> list[str]:
    """Those of ``addresses`` that belong to this host: loopback addresses and the addresses of
    its interfaces."""
    local = {a for addrs in interface_addresses().values() for a in addrs}
    own = []
    for address in addresses:
        try:
            loopback = ipaddress.ip_address(address).is_loopback
        except ValueError:
            continue
        if loopback or address in local:
            own.append(address)
    return own


def check_not_self_rendezvous(
    master_addr: str,
    port: int,
    *,
    rank: int,
    node_rank: int,
    launcher: str,
    wait_s: float | None = None,
) -> None:
    """Refuse a rank on a node other than rank 0's whose ``MASTER_ADDR`` resolves to its own
    host while nothing there serves the rendezvous: it would wait for a store that nobody starts
    on this host instead of meeting node 0. (Nodes that each made themselves node 0, torchrun's
    c10d rendezvous at ``localhost`` with ``--nnodes 1:N``, look like one-node jobs from inside
    and are not caught.) The trap of multi-node torchrun and SLURM set-ups where a host maps the
    rendezvous name to itself (``127.0.0.1 master`` in an image's ``/etc/hosts``, a name that every
    host resolves to itself), which otherwise shows as a hang until the rendezvous timeout.

    A job whose "nodes" share one machine (``torchrun --nnodes 2 --node-rank 1
    --master-addr 127.0.0.1`` to try a multi-node set-up locally) is not refused: its node 0
    serves the rendezvous on this host, which a TCP connection to ``MASTER_ADDR:MASTER_PORT``
    finds (tried for up to ``wait_s`` seconds, as node 0 may start a moment later).

    Args:
        master_addr: the rendezvous name or address (``MASTER_ADDR``).
        port: the rendezvous port (``MASTER_PORT``).
        rank: this process's global rank (for the message).
        node_rank: this process's node; node 0 hosts the rendezvous, so it is not checked.
        launcher: what set the variables (``"torchrun"``, ``"slurm"``), for the message.
        wait_s: how long a local rendezvous may take to appear, seconds (default
            :data:`SELF_RENDEZVOUS_WAIT_S`).

    Raises:
        NetworkConfigError: naming the rank, this host, the name, the addresses it resolves to
            here, and the fix.
    """
    if node_rank == 0:
        return
    own = own_addresses(resolve(master_addr))
    if not own:
        return
    deadline = time.monotonic() + (SELF_RENDEZVOUS_WAIT_S if wait_s is None else wait_s)
    while True:
        if any(probe(None, address, port, 1.0) is None for address in own):
            return  # node 0 is on this host
        if time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    host = socket.gethostname()
    raise NetworkConfigError(
        f"rank {rank} on host {host} (node {node_rank}, started by {launcher}): the rendezvous "
        f"address MASTER_ADDR={master_addr!r} resolves to {', '.join(own)} here, an address of "
        f"this host itself, where nothing serves the rendezvous on port {port}: this node would "
        f"rendezvous with itself instead of with node 0. Make {master_addr!r} resolve to node "
        "0's address on every node (/etc/hosts or DNS), or give MASTER_ADDR (torchrun: "
        "--master-addr or --rdzv-endpoint) node 0's address"
    )


def probe(source: str | None, host: str, port: int, timeout_s: float) -> str | None:
    """Try a TCP connection to ``host:port`` from the local address ``source`` (any when
    ``None``); ``None`` when it connects, else why not (``"timed out after 5 s"``,
    ``"connection refused"``, ...). The connection is closed at once."""
    for address in resolve(host) or [host]:
        try:
            v6 = ipaddress.ip_address(address).version == 6
        except ValueError:
            return f"{host} does not resolve"
        family = socket.AF_INET6 if v6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            try:
                if source is not None:
                    sock.bind((source, 0))
                sock.connect((address, port))
                return None
            except TimeoutError:
                return f"timed out after {timeout_s:g} s"
            except OSError as exc:
                return exc.strerror or str(exc)
    return f"{host} does not resolve"


def interface_environment(choice: InterfaceChoice, environ: Mapping[str, str]) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME``, ``TP_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` set to the chosen
    interface, each only where ``environ`` does not set it already (a user's value wins)."""
    if choice.ifname is None or choice.source != "route":
        return {}
    return {var: choice.ifname for var in LOOPBACK_IFNAME_VARS if not environ.get(var)}


# ------------------------------------------------------------------ a process's own connections

_PROC_FD = "/proc/self/fd"
_PROC_TCP = ("/proc/self/net/tcp", "/proc/self/net/tcp6")
_TCP_LISTEN = "0A"  # the state column of a listening socket (include/net/tcp_states.h)


def socket_fds() -> dict[int, int]:
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


def tcp_ports() -> dict[int, tuple[int, int]]:
    """``{inode: (local port, remote port)}`` of the connected TCP sockets in this network
    namespace (not the listening ones)."""
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


def tcp_opened_by(
    create: Callable[[], T], store_port: int | None = None
) -> tuple[T, dict[int, int]]:
    """Call ``create()`` and note the connected TCP sockets it opened in this process
    (``{fd: inode}``), leaving out connections to or from ``store_port``."""
    before = socket_fds()
    result = create()
    opened = {fd: inode for fd, inode in socket_fds().items() if before.get(fd) != inode}
    tcp = tcp_ports()
    return result, {
        fd: inode for fd, inode in opened.items() if inode in tcp and store_port not in tcp[inode]
    }


def give_up_after(fds: Mapping[int, int], timeout_s: float | None) -> int:
    """Make each connection of ``fds`` (``{fd: inode}``, still the same socket) fail once its
    peer has been silent for ``timeout_s`` seconds: ``TCP_USER_TIMEOUT`` (data unacknowledged
    that long) and TCP keepalive probes (an idle connection whose peer is gone). A peer cut
    off by a partition sends no reset, so without this a collective waits on it until its own
    timeout; a frozen peer's kernel still answers, so only a silent network ends it. Linux
    only; never raises. Returns how many were set."""
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if timeout_s is None or user_timeout is None:
        return 0
    current = socket_fds()
    idle = max(1, int(timeout_s / 4))
    done = 0
    for fd, inode in fds.items():
        if current.get(fd) != inode:
            continue  # closed meanwhile: the number may be someone else's now
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(1000, int(timeout_s * 1000)))
            done += 1
        except OSError:
            pass
        finally:
            sock.detach()  # never close the owner's descriptor
    return done


__all__ = [
    "InterfaceChoice",
    "NetworkConfigError",
    "check_not_self_rendezvous",
    "choose_interface",
    "give_up_after",
    "interface_addresses",
    "interface_environment",
    "interface_of",
    "own_addresses",
    "probe",
    "resolve",
    "route_source",
    "socket_fds",
    "tcp_opened_by",
    "tcp_ports",
]
