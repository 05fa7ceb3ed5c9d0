"""The control plane against strangers: what a run listens on, and what idle, garbage, stalled
or wrongly keyed connections can do to it (issue 18).

Real processes and real sockets throughout. No test assumes the machine's speed: timeouts are
generous, and "without delaying others" is checked by order (the honest worker's handshake
completes while the stalled one is still pending), not by a stopwatch.
"""

from __future__ import annotations

import os
import pickle
import random
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection

import pytest
import torch

import net_workloads
import ringtrain as rt
from ringtrain.launch.base import WorkerSpec, start_store
from ringtrain.launch.local import LocalLauncher, LocalWorkerGroup
from ringtrain.wire import handshake
from ringtrain.wire.channel import DriverListener, Hello, WorkerChannel, new_authkey
from support import wait_until

# --------------------------------------------------------------------------- helpers


class _Marker:
    """Unpickling this creates the file ``path``: proof that someone unpickled it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _framed(payload: bytes) -> bytes:
    """``payload`` framed as multiprocessing.connection frames it (4-byte big-endian size)."""
    return len(payload).to_bytes(4, "big") + payload


class _Collector:
    """``on_connection`` for a bare DriverListener: keeps the authenticated connections."""

    def __init__(self) -> None:
        self.conns: list[Connection] = []
        self.lock = threading.Lock()

    def __call__(self, conn: Connection) -> None:
        with self.lock:
            self.conns.append(conn)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def _hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


class Flood:
    """Idle and garbage connections against one address, kept open until :meth:`close`.

    Garbage: 1 to 300 random bytes (sometimes a pickle that would create a marker file when
    unpickled); half of those connections then close their sending side (half-open).
    """

    def __init__(self, address: tuple[str, int], rng: random.Random, marker: str) -> None:
        self.address = address
        self.rng = rng
        self.marker = marker
        self.socks: list[socket.socket] = []
        self.failed_connects = 0

    def _connect(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.address, timeout=30)
        except OSError:
            self.failed_connects += 1
            return None
        self.socks.append(sock)
        return sock

    def idle(self, n: int) -> None:
        for _ in range(n):
            self._connect()

    def garbage(self, n: int) -> None:
        evil = _framed(pickle.dumps(_Marker(self.marker)))
        for i in range(n):
            sock = self._connect()
            if sock is None:
                continue
            data = evil if i % 10 == 0 else self.rng.randbytes(self.rng.randint(1, 300))
            try:
                sock.sendall(data)
                if i % 2:
                    sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the listener already dropped it: fine

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks.clear()


# --------------------------------------------------------------------------- listeners


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_local_run_listens_on_loopback_only(tmp_path, world_size):
    """The driver's channel and store and each worker's gloo listener, read from /proc."""
    seen: dict[str, list[tuple[str, int]]] = {}

    class Watching(LocalLauncher):
        def start(self, spec):
            group = super().start(spec)
            seen["driver"] = net_workloads.tcp_listeners(os.getpid())
            return group

    result = rt.Trainer(
        net_workloads.listeners_fn,
        rt.ScalingConfig(num_workers=world_size),
        rt.RunConfig(name="listen", storage_path=str(tmp_path), progress="off"),
        launcher=Watching(),
    ).fit()
    assert result.error is None and result.failures == []
    driver = seen["driver"]
    assert len(driver) >= 2, f"expected the channel and the store in {driver}"
    assert all(net_workloads.is_loopback(h) for h, _ in driver), f"driver listens on {driver}"
    assert sorted(result.metrics_per_rank) == list(range(world_size))
    for rank, metrics in result.metrics_per_rank.items():
        listeners = [s.split("|") for s in metrics["listeners"]]
        assert listeners, f"rank {rank}: no gloo listener found"
        bad = [h for h, _ in listeners if not net_workloads.is_loopback(h)]
        assert not bad, f"rank {rank} listens on {listeners}"


def test_workers_get_the_loopback_interface_for_gloo(tmp_path):
    """gloo binds the interface the host name resolves to unless GLOO_SOCKET_IFNAME names one
    (on this machine the name may resolve to loopback anyway, so the variable is checked)."""
    group = LocalWorkerGroup(WorkerSpec(world_size=2, run_dir=str(tmp_path)), forward_output=False)
    try:
        env = _environ(next(iter(group.pids().values())))
    finally:
        group.stop(grace_s=0)
    for var in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        assert env.get(var) in ("lo", "lo0"), (var, env.get(var))


def _environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was exec'd with. Between its fork and its exec a child's
    ``/proc/PID/environ`` is still the parent's (on a loaded machine the exec can come late), so
    this waits for the exec: the worker's command line names its bootstrap."""

    def execd() -> bool:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ringtrain.launch.worker" in f.read()

    assert wait_until(execd, timeout_s=60), f"pid {pid} never exec'd the worker bootstrap"
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_the_store_listens_only_on_the_host_it_is_given():
    """``TCPStore("127.0.0.1", 0, is_master=True)`` alone listens on the wildcard (IPv4 and
    IPv6); start_store binds the host (the local run's, and the Ray driver's elastic store)."""
    store = start_store("127.0.0.1", 2)
    try:
        mine = [(h, p) for h, p in net_workloads.tcp_listeners(os.getpid()) if p == int(store.port)]
        assert mine == [("127.0.0.1", int(store.port))]
    finally:
        del store


# --------------------------------------------------------------------------- the handshake


def test_a_wrong_key_is_refused_and_nothing_it_sent_is_unpickled(tmp_path):
    key = new_authkey()
    got = _Collector()
    listener = DriverListener(key, got)
    marker = tmp_path / "unpickled"
    evil = _framed(pickle.dumps(_Marker(str(marker))))
    host, port = _hostport(listener.address)
    try:
        # 1. a pickle instead of the handshake
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(evil * 3)
            sock.settimeout(30)
            try:
                while sock.recv(4096):  # the challenge, then the reject, then EOF
                    pass
            except ConnectionResetError:
                pass
        # 2. the right protocol with the wrong key, then a pickle
        with pytest.raises(AuthenticationError, match="rejected"):
            WorkerChannel.connect(listener.address, new_authkey(), timeout_s=30)
        # 3. multiprocessing's own client (HMAC-MD5 challenge on 3.11) does not get in either
        from multiprocessing.connection import Client

        with pytest.raises((AuthenticationError, OSError, EOFError)):
            Client((host, port), authkey=key)
        assert wait_until(lambda: listener.handshakes.rejected >= 2, timeout_s=30)
        # the right key still gets in, and only then is anything unpickled
        ok = WorkerChannel.connect(listener.address, key, timeout_s=60)
        assert wait_until(lambda: len(got.conns) == 1, timeout_s=30)
        ok.send(Hello(rank=0, pid=os.getpid(), hostname="h"))
        assert got.conns[0].recv() == Hello(rank=0, pid=os.getpid(), hostname="h")
        got.close()  # the driver's end first: a worker's close waits for it (close_gracefully)
        ok.close()
    finally:
        listener.close()
        got.close()
    assert not marker.exists(), "a stranger's pickle was unpickled"
    assert len(got.conns) == 1


def test_the_worker_refuses_a_driver_that_does_not_hold_the_key():
    """Mutual: a stranger listening in the driver's place cannot pose as the driver."""
    impostor = DriverListener(new_authkey(), _Collector())
    try:
        with pytest.raises(AuthenticationError):
            WorkerChannel.connect(impostor.address, new_authkey(), timeout_s=30)
    finally:
        impostor.close()


def test_a_stalled_handshake_is_dropped_without_delaying_others():
    key = new_authkey()
    got = _Collector()
    listener = DriverListener(key, got, handshake_timeout_s=30)
    address = _hostport(listener.address)
    stalled = socket.create_connection(address, timeout=60)
    half = socket.create_connection(address, timeout=60)
    try:
        assert stalled.recv(len(handshake.MAGIC))  # the challenge came; it never answers
        half.sendall(b"\0" * 40)  # an answer cut short
        assert wait_until(lambda: listener.handshakes.pending() == 2, timeout_s=30)
        # an honest worker gets in while both are pending
        ok = WorkerChannel.connect(listener.address, key, timeout_s=60)
        assert wait_until(lambda: len(got.conns) == 1, timeout_s=30)
        assert listener.handshakes.pending() == 2, "the stalled handshakes ended too early"
        got.close()  # the driver's end first: a worker's close waits for it (close_gracefully)
        ok.close()
    finally:
        listener.close()
        got.close()
        stalled.close()
        half.close()

    short = DriverListener(key, _Collector(), handshake_timeout_s=0.5)
    try:
        idle = socket.create_connection(_hostport(short.address), timeout=60)
        # dropped after its deadline: the driver closes it (EOF after the challenge)
        idle.settimeout(60)
        received = b""
        while chunk := idle.recv(4096):
            received += chunk
        assert received.startswith(handshake.MAGIC)
        assert len(received) == len(handshake.MAGIC) + handshake.NONCE_BYTES
        assert short.handshakes.timed_out == 1
        idle.close()
    finally:
        short.close()


def test_the_backlog_covers_the_world_size():
    assert handshake.listen_backlog(1) == 128
    assert handshake.listen_backlog(500) == 1000
    key = new_authkey()
    got = _Collector()
    listener = DriverListener(key, got, world_size=300)
    try:
        # 300 workers at once: every one is authenticated
        chans: list[WorkerChannel] = []
        errors: list[BaseException] = []

        def one() -> None:
            try:
                chans.append(WorkerChannel.connect(listener.address, key, timeout_s=120))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one) for _ in range(300)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors[:3]
        assert wait_until(lambda: len(got.conns) == 300, timeout_s=60)
        got.close()  # the driver's ends first: a worker's close waits for its driver's
        for ch in chans:
            ch.close()
    finally:
        listener.close()
        got.close()


# --------------------------------------------------------------------------- runs under fire


def _fit_steady(tmp_path, name, world_size, launcher=None, gate=None):
    if gate is None:
        gate = tmp_path / f"{name}.gate"
        gate.touch()
    return rt.Trainer(
        net_workloads.steady_fn,
        rt.ScalingConfig(num_workers=world_size),
        rt.RunConfig(name=name, storage_path=str(tmp_path), progress="off"),
        train_loop_config={"steps": 6, "gate": str(gate)},
        launcher=launcher,
    ).fit(raise_on_error=False)


def _params(result) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "model.pt"), weights_only=True)["model"]


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_run_finishes_unchanged_under_a_flood_of_strangers(tmp_path, world_size):
    """200 idle and 200 garbage connections to the driver's channel (and a few to the
    store) during start-up, and again mid-training: same parameters, no failure."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    baseline = _fit_steady(tmp_path, "baseline", world_size)
    assert baseline.error is None, baseline.error

    gate = tmp_path / "flooded.gate"
    marker = tmp_path / "unpickled"
    floods: list[Flood] = []
    state: dict = {}

    def attack(group: LocalWorkerGroup) -> None:
        try:
            channel = _hostport(group._listener.address)
            store = ("127.0.0.1", group.store_port)
            for target, n in ((channel, 200), (store, 10)):
                flood = Flood(target, rng, str(marker))
                floods.append(flood)
                flood.idle(n)
                flood.garbage(n)
            state["startup_done_before_workers"] = len(group._conns) < group.world_size
            # mid-training: the workers wait at the gate until this flood is in place
            assert wait_until(lambda: len(group._conns) == group.world_size, timeout_s=300)
            flood = Flood(channel, rng, str(marker))
            floods.append(flood)
            flood.idle(200)
            flood.garbage(200)
            state["rejected"] = group._listener.handshakes.rejected
        except BaseException as exc:
            state["error"] = exc
        finally:
            gate.touch()

    class Attacked(LocalLauncher):
        def start(self, spec):
            group = super().start(spec)
            threading.Thread(target=attack, args=(group,), daemon=True).start()
            return group

    try:
        result = _fit_steady(tmp_path, "flooded", world_size, launcher=Attacked(), gate=gate)
    finally:
        for flood in floods:
            flood.close()
    msg = f"(seed {seed})"
    assert "error" not in state, f"{state['error']!r} {msg}"
    assert result.error is None and result.failures == [], f"{result.error} {msg}"
    assert sum(f.failed_connects for f in floods) == 0, msg
    assert state["rejected"] >= 1, f"the garbage never reached the handshake {msg}"
    assert not marker.exists(), f"a stranger's pickle was unpickled {msg}"
    expected, got = _params(baseline), _params(result)
    for key, value in expected.items():
        assert torch.equal(got[key], value), f"{key} differs {msg}"
    if not state["startup_done_before_workers"]:
        # not an error (a fast machine), but then the start-up flood proved less
        print(f"note: the workers connected before the start-up flood ended {msg}")


def test_a_stranger_on_the_store_does_not_stall_the_run(tmp_path):
    """Garbage and idle connections to the rendezvous store before the workers reach it."""
    rng = random.Random(0)
    baseline = _fit_steady(tmp_path, "baseline", 2)
    floods: list[Flood] = []

    class Attacked(LocalLauncher):
        def start(self, spec):
            group = super().start(spec)
            flood = Flood(("127.0.0.1", group.store_port), rng, str(tmp_path / "m"))
            floods.append(flood)
            flood.idle(50)
            flood.garbage(50)
            return group

    try:
        result = _fit_steady(tmp_path, "stored", 2, launcher=Attacked())
    finally:
        for flood in floods:
            flood.close()
    assert result.error is None and result.failures == [], result.error
    expected, got = _params(baseline), _params(result)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
