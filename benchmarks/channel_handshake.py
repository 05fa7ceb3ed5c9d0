"""The channel's handshake, side by side: multiprocessing.connection's Listener/Client (the
baseline, HMAC-MD5 on Python 3.11, handshake inside ``accept()``) against ringtrain's
DriverListener/WorkerChannel (HMAC-SHA256 both ways, non-blocking handshake loop).

Measures, medians over ``--runs``:

1. one client: connect + authenticate + one round trip (ms);
2. ``--clients`` clients at once (threads): time until all are authenticated (ms);
3. one honest client while ``--idle`` idle connections sit on the listener (those that could
   connect: a full backlog refuses the rest): time until it is authenticated, capped at
   ``--cap-s`` (the baseline stalls behind the first idle one).

    python benchmarks/channel_handshake.py --runs 5
"""

from __future__ import annotations

import argparse
import secrets
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import Client, Listener
from typing import Any

from ringtrain.wire.channel import DriverListener, WorkerChannel


class _Baseline:
    def __init__(self, key: bytes, backlog_clients: int) -> None:
        # as ringtrain's DriverListener was before issue 18 (Listener's default backlog of 1)
        self.listener = Listener(("127.0.0.1", 0), family="AF_INET", authkey=key)
        self.key = key
        self.conns: list[Any] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return
            except Exception:
                continue
            self.conns.append(conn)
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    def connect(self) -> Any:
        return Client(self.address, family="AF_INET", authkey=self.key)

    def close(self) -> None:
        self.listener.close()


class _Ringtrain:
    def __init__(self, key: bytes, backlog_clients: int) -> None:
        self.key = key
        self.listener = DriverListener(key, self._on, world_size=backlog_clients)

    def _on(self, conn: Any) -> None:
        threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    @property
    def address(self) -> tuple[str, int]:
        host, _, port = self.listener.address.rpartition(":")
        return host, int(port)

    def connect(self) -> Any:
        return WorkerChannel.connect(self.listener.address, self.key, timeout_s=120).conn

    def close(self) -> None:
        self.listener.close()


def _echo(conn: Any) -> None:
    try:
        while True:
            conn.send(conn.recv())
    except (EOFError, OSError):
        pass


def _one(server: Any) -> float:
    t0 = time.perf_counter()
    conn = server.connect()
    conn.send("ping")
    assert conn.recv() == "ping"
    dt = time.perf_counter() - t0
    conn.close()
    return dt


def _many(server: Any, n: int, cap_s: float) -> float:
    done: list[Any] = []
    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=lambda: done.append(server.connect()), daemon=True)
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + cap_s - time.perf_counter()))
    dt = time.perf_counter() - t0
    for c in list(done):
        c.close()
    return dt if len(done) == n else float("inf")


def _behind_idle(server: Any, idle: int, cap_s: float) -> float:
    socks = []
    for _ in range(idle):
        try:  # a full backlog drops SYNs: such a connect times out (it would stall too)
            socks.append(socket.create_connection(server.address, timeout=0.2))
        except OSError:
            pass
    result: list[float] = []
    t0 = time.perf_counter()

    def honest() -> None:
        try:
            conn = server.connect()
        except OSError:
            return  # the baseline's connect timed out in a full backlog: counted as stalled
        result.append(time.perf_counter() - t0)
        conn.close()

    t = threading.Thread(target=honest, daemon=True)
    t.start()
    t.join(cap_s)
    for s in socks:
        s.close()
    t.join(30)  # the baseline gets to it once the idle ones are closed
    return result[0] if result and result[0] <= cap_s else float("inf")


def _shown(median: float, xs: list[float], cap_s: float) -> str:
    stalled = sum(x == float("inf") for x in xs)
    if median == float("inf"):
        return f"stalled (> {cap_s:g} s in {stalled}/{len(xs)} runs)"
    return f"{median * 1e3:.1f}" + (f" ({stalled}/{len(xs)} runs stalled)" if stalled else "")


def _median(fn: Callable[[], float], runs: int) -> tuple[float, list[float]]:
    xs = [fn() for _ in range(runs)]
    return statistics.median(xs), xs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--idle", type=int, default=200)
    ap.add_argument("--cap-s", type=float, default=10.0)
    args = ap.parse_args(argv)
    print(f"python {sys.version.split()[0]}, runs={args.runs}")
    rows = []
    for name, cls in (("multiprocessing (baseline)", _Baseline), ("ringtrain", _Ringtrain)):
        key = secrets.token_bytes(32)
        server: _Baseline | _Ringtrain = cls(key, args.clients)
        try:
            one, _ = _median(partial(_one, server), args.runs * 10)
            many, many_xs = _median(partial(_many, server, args.clients, args.cap_s), args.runs)
            idle, idle_xs = _median(partial(_behind_idle, server, args.idle, args.cap_s), args.runs)
        finally:
            server.close()
        rows.append((name, one, many, many_xs, idle, idle_xs))
    print(
        f"| listener | 1 client (ms) | {args.clients} clients (ms) | "
        f"1 client behind {args.idle} idle (ms) |"
    )
    print("|---|---|---|---|")
    for name, one, many, many_xs, idle, idle_xs in rows:
        print(
            f"| {name} | {one * 1e3:.2f} | {_shown(many, many_xs, args.cap_s)} | "
            f"{_shown(idle, idle_xs, args.cap_s)} |"
        )
    base, ours = rows[0], rows[1]
    print(f"ratio ringtrain/baseline, 1 client: {ours[1] / base[1]:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
