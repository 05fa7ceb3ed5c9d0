"""Hosts made of Linux network namespaces: a multi-host test bed on one machine.

A :class:`NetBed` is N hosts, each a network namespace with its own loopback, its own host name
(a UTS namespace per process started on it) and one interface ``eth0`` with its own address
(``10.77.0.1``, ``10.77.0.2``, ...), joined by a private Linux bridge that has no address in the
machine's own namespace: the hosts reach each other and nothing else, and nothing outside them
reaches the hosts. On it one can:

* run a command on a host (:meth:`NetBed.run`, :meth:`NetBed.popen`, :meth:`NetBed.command`);
* limit a host's link to a bandwidth, both ways (:meth:`NetBed.limit`: a ``tbf`` qdisc);
* cut a host's link and heal it (:meth:`NetBed.cut`, :meth:`NetBed.heal`): its processes keep
  running, cut off, as behind a failed switch port;
* lose a host: every process on it killed at once (:meth:`NetBed.kill_host`);
* tear everything down (:meth:`NetBed.down`): no namespace, veth, bridge, process or file of the
  bed is left. A bed's description is written to :data:`STATE_DIR` before anything is created,
  with the pid of the process that owns it, so :func:`sweep` removes the beds of processes that
  were killed (``NetBed.up`` sweeps first); :func:`find_bed` lets another process (``ringtrain
  chaos``) find the bed that holds an address and cut its link.

Each host's ``/etc/hosts`` (``ip netns exec`` mounts ``/etc/netns/NS/hosts`` over it) names every
host; a host's own name resolves to ``127.0.1.1`` by default, as on a stock Debian or Ubuntu
machine: the trap that makes gloo advertise loopback to the other hosts.

Needs root and iproute2 (``ip``, ``tc``) and ``unshare``; :func:`unavailable` says why a bed
cannot be made here. Linux only; imports nothing of ringtrain.

Example::

    with NetBed(hosts=3, rate_mbit=100) as bed:
        print(bed.run(bed.hosts[1], ["hostname", "-I"]).stdout)
        bed.cut(bed.hosts[2])
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX = "rtb"
"""Every namespace, interface and state file of a bed starts with this (and the bed's id)."""
STATE_DIR = "/run/ringtrain-netbed"
"""Where each bed's description (``<id>.json``) is kept while it exists."""
ETC_NETNS = "/etc/netns"
DEFAULT_SUBNET = "10.77.0.0/24"


class NetBedError(RuntimeError):
    """A bed could not be made, or a command of iproute2 failed (the message names it)."""


@dataclass(frozen=True)
class Host:
    """One host of a bed.

    Attributes:
        index: 1, 2, ... (host ``hN``).
        name: its host name, ``h1``, ``h2``, ...
        netns: the network namespace's name.
        address: its address on the bed's network.
        link: the machine-side end of its veth pair, on the bridge (cut here).
        ifname: its interface inside the namespace.
    """

    index: int
    name: str
    netns: str
    address: str
    link: str
    ifname: str = "eth0"


def unavailable() -> str | None:
    """Why a bed cannot be made on this machine (``None``: it can): not Linux, not root, no
    ``ip``/``tc``/``unshare``, or network namespaces refused (a container without the right)."""
    if not os.path.isdir("/proc/self/ns"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root (run as root, e.g. in CI)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool!r} (iproute2 / util-linux) is not installed"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetBed:
    """N hosts as network namespaces on a private bridge (see the module's docstring).

    Args:
        hosts: number of hosts (1 to 250).
        subnet: the bed's network; host ``hN`` gets its N-th address. Each bed has its own
            bridge, so two beds may use the same subnet without seeing each other.
        rate_mbit: every host's link rate in Mbit/s, both ways (``None``: unlimited).
        self_resolves: what a host's own name resolves to on it: ``"loopback"``
            (``127.0.1.1``, the Debian default) or ``"address"`` (its bed address).
        extra_hosts: more ``/etc/hosts`` lines per host name, ``{"h2": {"master": "10.77.0.2"}}``.

    Use it as a context manager, or call :meth:`up` and :meth:`down` (``down`` is also run at
    the interpreter's exit and by the next bed's :func:`sweep` if its owner was killed).
    """

    def __init__(
        self,
        hosts: int = 3,
        *,
        subnet: str = DEFAULT_SUBNET,
        rate_mbit: float | None = None,
        self_resolves: str = "loopback",
        extra_hosts: Mapping[str, Mapping[str, str]] | None = None,
        bed_id: str | None = None,
    ) -> None:
        if not 1 <= hosts <= 250:
            raise ValueError(f"NetBed(hosts=...) must be 1 to 250, got {hosts}")
        if self_resolves not in ("loopback", "address"):
            raise ValueError(
                f"NetBed(self_resolves=...) must be 'loopback' or 'address', got {self_resolves!r}"
            )
        net = ipaddress.ip_network(subnet)
        if net.num_addresses < hosts + 2:
            raise ValueError(f"subnet {subnet} is too small for {hosts} hosts")
        self.id = bed_id or secrets.token_hex(2)
        self.subnet = str(net)
        self.bridge = f"{PREFIX}{self.id}br"
        self.hosts = [
            Host(
                index=i,
                name=f"h{i}",
                netns=f"{PREFIX}{self.id}h{i}",
                address=str(net[i]),
                link=f"{PREFIX}{self.id}h{i}",
            )
            for i in range(1, hosts + 1)
        ]
        self.prefixlen = net.prefixlen
        self.rate_mbit = rate_mbit
        self.self_resolves = self_resolves
        self.extra_hosts = {k: dict(v) for k, v in (extra_hosts or {}).items()}
        self._limits: dict[str, float | None] = {}
        self._cut: set[str] = set()
        self._up = False

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> NetBed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> NetBed:
        """Make the bridge, the namespaces, their links and ``/etc/hosts`` files; sweep the
        beds of dead owners first.

        Raises:
            NetBedError: a step failed (what was made is torn down again).
        """
        why = unavailable()
        if why is not None:
            raise NetBedError(f"cannot make a network test bed here: {why}")
        sweep()
        os.makedirs(STATE_DIR, exist_ok=True)
        self._write_state()  # first: a bed killed half-way is still found by sweep()
        import atexit

        atexit.register(self.down)
        self._up = True
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                self._make_host(host)
            if self.rate_mbit is not None:
                for host in self.hosts:
                    self.limit(host, self.rate_mbit)
        except BaseException:
            self.down()
            raise
        return self

    def _make_host(self, host: Host) -> None:
        peer = f"{host.link}p"
        _ip("netns", "add", host.netns)
        _ip("link", "add", host.link, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", host.netns)
        _ip("link", "set", host.link, "master", self.bridge)
        _ip("link", "set", host.link, "up")
        ns = ["-n", host.netns]
        _ip(*ns, "link", "set", peer, "name", host.ifname)
        _ip(*ns, "addr", "add", f"{host.address}/{self.prefixlen}", "dev", host.ifname)
        _ip(*ns, "link", "set", host.ifname, "up")
        _ip(*ns, "link", "set", "lo", "up")
        etc = os.path.join(ETC_NETNS, host.netns)
        os.makedirs(etc, exist_ok=True)
        with open(os.path.join(etc, "hosts"), "w") as f:
            f.write(self.hosts_file(host))

    def hosts_file(self, host: Host) -> str:
        """The ``/etc/hosts`` that ``host`` sees."""
        own = "127.0.1.1" if self.self_resolves == "loopback" else host.address
        lines = ["127.0.0.1 localhost", f"{own} {host.name}"]
        lines += [f"{h.address} {h.name}" for h in self.hosts if h is not host]
        lines += [f"{addr} {name}" for name, addr in self.extra_hosts.get(host.name, {}).items()]
        return "\n".join(lines) + "\n"

    def set_hosts(self, host: Host, names: Mapping[str, str]) -> None:
        """Map more names on ``host`` from now on, e.g. ``{"master": "127.0.0.1"}``."""
        self.extra_hosts.setdefault(host.name, {}).update(names)
        with open(os.path.join(ETC_NETNS, host.netns, "hosts"), "w") as f:
            f.write(self.hosts_file(host))

    def down(self) -> None:
        """Kill every process on the bed's hosts and remove its namespaces, links, bridge and
        files. Idempotent; never raises for what is already gone."""
        if not self._up:
            return
        self._up = False
        _teardown(self.describe())

    # ------------------------------------------------------------------ on a host
    def host(self, key: int | str) -> Host:
        """Host ``hN`` by index (1-based), name (``"h2"``) or address."""
        for host in self.hosts:
            if key in (host.index, host.name, host.address, host.netns):
                return host
        raise KeyError(f"no host {key!r} on bed {self.id}")

    def command(self, host: Host, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as run on ``host``: in its network namespace, with its host name."""
        return [
            "ip",
            "netns",
            "exec",
            host.netns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {host.name} && exec "$@"',
            "sh",
            *cmd,
        ]

    def run(
        self, host: Host, cmd: Sequence[str], *, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on ``host`` and wait (text output captured unless ``kwargs`` say
        otherwise)."""
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run(self.command(host, cmd), check=check, **kwargs)

    def popen(self, host: Host, cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``cmd`` on ``host``."""
        return subprocess.Popen(self.command(host, cmd), **kwargs)

    def pids(self, host: Host) -> list[int]:
        """The processes running on ``host`` (in its network namespace)."""
        return _netns_pids(host.netns)

    # ------------------------------------------------------------------ faults
    def cut(self, host: Host) -> None:
        """Cut ``host``'s link (its end on the bridge goes down): nothing passes either way,
        no connection is reset, and its processes keep running."""
        _ip("link", "set", host.link, "down")
        self._cut.add(host.name)

    def heal(self, host: Host) -> None:
        """Bring ``host``'s link back up."""
        _ip("link", "set", host.link, "up")
        self._cut.discard(host.name)

    def is_cut(self, host: Host) -> bool:
        return host.name in self._cut

    def limit(self, host: Host, rate_mbit: float | None) -> None:
        """Limit ``host``'s link to ``rate_mbit`` Mbit/s each way (a token bucket, ``tbf``, on
        both ends of its veth pair); ``None`` removes the limit."""
        for ns, dev in ((None, host.link), (host.netns, host.ifname)):
            where = ["-n", ns] if ns else []
            subprocess.run(["tc", *where, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate_mbit is not None:
                _tc(*where, "qdisc", "add", "dev", dev, "root", *tbf_args(rate_mbit))
        self._limits[host.name] = rate_mbit

    def kill_host(self, host: Host, sig: int = signal.SIGKILL) -> list[int]:
        """Send ``sig`` to every process on ``host`` at once (a lost host); returns their
        pids."""
        pids = self.pids(host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    # ------------------------------------------------------------------ description
    def describe(self) -> dict[str, Any]:
        """What :func:`sweep`, :func:`find_bed` and the teardown need, as JSON-able data."""
        return {
            "id": self.id,
            "owner": os.getpid(),
            "owner_start": _start_time(os.getpid()),
            "bridge": self.bridge,
            "subnet": self.subnet,
            "hosts": [dataclasses.asdict(h) for h in self.hosts],
        }

    def _write_state(self) -> None:
        path = os.path.join(STATE_DIR, f"{self.id}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.describe(), f)
        os.replace(path + ".tmp", path)


def tbf_args(rate_mbit: float) -> list[str]:
    """A ``tbf`` qdisc's arguments for ``rate_mbit``: a bucket of 10 ms of traffic (at least
    64 KiB, so that one full-size segment of a veth passes) and at most 100 ms of queue."""
    if rate_mbit <= 0:
        raise ValueError(f"a link rate must be > 0 Mbit/s, got {rate_mbit}")
    burst = max(65536, int(rate_mbit * 1e6 / 8 * 0.010))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "100ms"]


def _run(cmd: Sequence[str]) -> None:
    done = subprocess.run(list(cmd), capture_output=True, text=True)
    if done.returncode != 0:
        raise NetBedError(f"{' '.join(cmd)} failed: {done.stderr.strip() or done.returncode}")


def _ip(*args: str) -> None:
    _run(["ip", *args])


def _tc(*args: str) -> None:
    _run(["tc", *args])


def _netns_pids(netns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split() if p.isdigit()]


def _start_time(pid: int) -> str | None:
    """The start time of ``pid`` (``/proc/PID/stat`` field 22): tells a live owner from a new
    process that reuses its pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _teardown(state: Mapping[str, Any], wait_s: float = 5.0) -> None:
    """Remove the bed ``state`` describes: kill its hosts' processes (and wait for them, at
    most ``wait_s``: a namespace stays until its last process is gone), then remove the
    namespaces (their veth ends go with them), the machine-side links, the bridge, the
    ``/etc/netns`` directories and the state file."""
    hosts = state.get("hosts", [])
    for host in hosts:
        for pid in _netns_pids(host["netns"]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(_netns_pids(h["netns"]) for h in hosts):
        time.sleep(0.05)
    for host in hosts:
        subprocess.run(["ip", "netns", "del", host["netns"]], capture_output=True)
        subprocess.run(["ip", "link", "del", host["link"]], capture_output=True)
        shutil.rmtree(os.path.join(ETC_NETNS, host["netns"]), ignore_errors=True)
    subprocess.run(["ip", "link", "del", state["bridge"]], capture_output=True)
    with contextlib.suppress(OSError):
        os.remove(os.path.join(STATE_DIR, f"{state['id']}.json"))


def _states() -> Iterable[dict[str, Any]]:
    try:
        names = sorted(os.listdir(STATE_DIR))
    except OSError:
        return
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(STATE_DIR, name)) as f:
                yield json.load(f)
        except (OSError, ValueError):
            continue


def _owner_alive(state: Mapping[str, Any]) -> bool:
    pid = state.get("owner")
    return (
        isinstance(pid, int)
        and _start_time(pid) is not None
        and (_start_time(pid) == state.get("owner_start"))
    )


def sweep() -> list[str]:
    """Tear down every bed whose owner process is gone (killed before its ``down``), and any
    namespace or link named with :data:`PREFIX` that no live bed claims; returns the ids of the
    beds removed."""
    removed = []
    claimed: set[str] = set()
    for state in list(_states()):
        if _owner_alive(state):
            claimed.add(state["bridge"])
            claimed.update(h["netns"] for h in state.get("hosts", []))
            claimed.update(h["link"] for h in state.get("hosts", []))
            claimed.update(h["link"] + "p" for h in state.get("hosts", []))
            continue
        _teardown(state)
        removed.append(str(state["id"]))
    # Strays: a bed whose state file is gone (removed by hand) but whose interfaces are not.
    for netns in _names(["ip", "netns", "list"]):
        if netns.startswith(PREFIX) and netns not in claimed:
            for pid in _netns_pids(netns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
            shutil.rmtree(os.path.join(ETC_NETNS, netns), ignore_errors=True)
    for link in _names(["ip", "-o", "link", "show"], field=1):
        name = link.split("@")[0].rstrip(":")
        if name.startswith(PREFIX) and name not in claimed:
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    return removed


def leftovers() -> list[str]:
    """Namespaces, links, ``/etc/netns`` directories and state files of beds (any, live or
    not) on this machine: empty once every bed is down."""
    found = [f"netns {n}" for n in _names(["ip", "netns", "list"]) if n.startswith(PREFIX)]
    for link in _names(["ip", "-o", "link", "show"], field=1):
        name = link.split("@")[0].rstrip(":")
        if name.startswith(PREFIX):
            found.append(f"link {name}")
    with contextlib.suppress(OSError):
        found += [f"/etc/netns/{d}" for d in os.listdir(ETC_NETNS) if d.startswith(PREFIX)]
    with contextlib.suppress(OSError):
        found += [f"{STATE_DIR}/{f}" for f in os.listdir(STATE_DIR)]
    return found


def _names(cmd: list[str], field: int = 0) -> list[str]:
    out = subprocess.run(cmd, capture_output=True, text=True).stdout
    names = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) > field:
            names.append(parts[field])
    return names


def find_bed(address: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The live bed that has a host with ``address``, and that host (as :meth:`NetBed.describe`
    writes them), or ``None``: how a process that did not make the bed finds a link to cut."""
    for state in _states():
        if not _owner_alive(state):
            continue
        for host in state.get("hosts", []):
            if host.get("address") == address:
                return state, host
    return None


def set_link(link: str, up: bool) -> None:
    """Bring the machine-side link ``link`` of a bed's host up or down (root only)."""
    _ip("link", "set", link, "up" if up else "down")


__all__ = [
    "DEFAULT_SUBNET",
    "PREFIX",
    "STATE_DIR",
    "Host",
    "NetBed",
    "NetBedError",
    "find_bed",
    "leftovers",
    "set_link",
    "sweep",
    "tbf_args",
    "unavailable",
]
