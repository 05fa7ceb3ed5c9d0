"""How far one driver scales: the REAL controller and the REAL driver side of the channel
(``DriverListener`` handshakes, ``ChannelGroup`` reader threads) against N simulated workers that
speak the real protocol (HMAC handshake, Hello, Start, a Heartbeat and a Report every second,
rank 0's checkpoint every 10th round written in the background with a CheckpointDone), without
torch. The simulated workers run in a few separate processes (``--sim``), so the driver's CPU
time is the driver's own.

Per N it measures: the driver's CPU (process CPU seconds per second of run, all its threads),
report-to-publish latency (the last report of a round sent -> the controller completing the
round; median and p99), the driver's RSS, the time to detect a lost worker (one simulated worker
freezes: no heartbeat, no report, socket open; detection minus ``worker_timeout_s``), and the
time from that detection to the restart decision (``failure_grace_s`` included).

    .venv/bin/python benchmarks/controller_scale.py --sizes 8 64 256 1024 --measure-s 10 --repeats 3

Figures are medians over ``--repeats`` runs; the script also fits ``driver CPU = a * N + b`` on the
sizes up to 256 and prints its prediction for the larger ones.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import CheckpointConfig, FailureConfig
from ringtrain.controller.controller import Controller
from ringtrain.controller.policy import FailurePolicy
from ringtrain.launch.base import ChannelGroup, WorkerSpec
from ringtrain.monitor.progress import make_progress
from ringtrain.rundir import RunDirectory
from ringtrain.wire.channel import (
    CheckpointDone,
    Done,
    DriverListener,
    Event,
    Exited,
    Heartbeat,
    Hello,
    Report,
    WorkerChannel,
    new_authkey,
)

TIMEOUT_S = 3.0  # worker_timeout_s of the runs
GRACE_S = 1.0  # failure_grace_s of the runs


# ---------------------------------------------------------------- simulated workers (--sim)
def simulate(args: argparse.Namespace) -> None:
    """Run simulated workers ``args.ranks`` (one thread drives them all) until the driver goes."""
    key = bytes.fromhex(os.environ["SIM_AUTHKEY"])
    ranks = [int(r) for r in args.ranks.split(",")]
    chans: dict[int, WorkerChannel] = {}
    beat = time.monotonic()
    for rank in ranks:
        ch = WorkerChannel.connect(args.address, key, timeout_s=120)
        ch.send(Hello(rank=rank, pid=os.getpid(), hostname="sim"))
        ch.recv()  # Start
        chans[rank] = ch
        if time.monotonic() - beat > 0.5:  # the ones connected so far are alive, starting up
            beat = time.monotonic()
            for r, c in chans.items():
                c.send(Heartbeat(r, time.time(), None))
    run = Path(args.run_path)
    round_ = 0
    tick = time.time()
    while chans:
        tick += args.interval_s
        time.sleep(max(0.0, tick - time.time()))
        now = time.time()
        ckpt = round_ % 10 == 9
        for rank, ch in list(chans.items()):
            if rank == args.freeze_rank and now >= args.freeze_at:
                continue  # frozen: the socket stays open, nothing more is sent
            try:
                ch.send(Heartbeat(rank, now, 0.0, step=round_, progress_count=round_ + 1))
                metrics = {"step": round_, "loss": 1.0 / (round_ + 1), "sent": time.time()}
                ch.send(Report(rank, round_, now, metrics, checkpoint_pending=ckpt and rank == 0))
                if ckpt and rank == 0:
                    staging = run / f"checkpoint_{round_:06d}.tmp"
                    staging.mkdir(parents=True, exist_ok=True)
                    (staging / "model.bin").write_bytes(b"x" * 1024)
                    files = {"model.bin": {"size": 1024, "sha256": _sha(b"x" * 1024)}}
                    ch.send(CheckpointDone(rank, round_, files))
                if round_ + 1 >= args.rounds:
                    ch.send(Done(rank, time.time(), round_ + 1))
                    ch.close()
                    del chans[rank]
            except OSError:  # the driver stopped the group
                chans.pop(rank, None)
        round_ += 1


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- the driver side
class _Events(queue.Queue):
    """The group's event queue; remembers which ranks said Done (their EOF is a clean exit)."""

    def __init__(self) -> None:
        super().__init__()
        self.done: set[int] = set()

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if isinstance(item, Done):
            self.done.add(item.rank)
        super().put(item, block, timeout)


class SimGroup(ChannelGroup):
    """A worker group whose workers are simulated ones in ``procs`` processes; the channel side
    (listener, handshakes, one reader thread per connection, the event queue) is the real one.
    A worker's Exited follows its connection's EOF (0 after Done, else -9)."""

    def __init__(self, spec: WorkerSpec, procs: int, freeze_rank: int, freeze_at: float) -> None:
        self.spec = spec
        self.world_size = spec.world_size
        self._lock = threading.Lock()
        self._stopped = False
        self._conns: dict[int, Connection] = {}
        self._events = _Events()
        self._threads: list[threading.Thread] = []
        key = new_authkey()
        self.started, self.connected, self.all_connected_s = time.monotonic(), 0, float("nan")
        self._listener = DriverListener(
            key, self._on_connection, "127.0.0.1", world_size=spec.world_size
        )
        run_path = spec.run_dir
        env = {**os.environ, "SIM_AUTHKEY": key.hex()}
        self._procs = []
        for p in range(procs):
            ranks = ",".join(str(r) for r in range(p, spec.world_size, procs))
            cmd = [sys.executable, __file__, "--sim", "--address", self._listener.address]
            cmd += ["--ranks", ranks, "--run-path", run_path, "--rounds", "100000"]
            cmd += ["--freeze-rank", str(freeze_rank), "--freeze-at", str(freeze_at)]
            self._procs.append(subprocess.Popen(cmd, env=env))

    def _on_connection(self, conn: Connection) -> None:
        self.connected += 1
        if self.connected == self.world_size:
            self.all_connected_s = time.monotonic() - self.started
        t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
        t.start()
        self._threads.append(t)

    def _serve(self, conn: Connection) -> None:
        with contextlib.suppress(TypeError):  # stop() closed the connection under the reader
            self._read(conn)
        with self._lock:
            rank = next((r for r, c in self._conns.items() if c is conn), None)
            if rank is None or self._stopped:
                return
        code = 0 if rank in self._events.done else -9
        self._events.put(Exited(rank=rank, time=time.time(), returncode=code))

    def stop(self, grace_s: float = 5.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._listener.close()
        for conn in list(self._conns.values()):
            with contextlib.suppress(OSError):
                conn.close()
        for proc in self._procs:
            proc.kill()
            proc.wait()

    def pids(self) -> dict[int, int]:
        return {}


class _Idle:
    """The second attempt's group: the benchmark ends once the restart was decided."""

    def __init__(self, stop: threading.Event) -> None:
        stop.set()

    def poll(self, timeout_s: float) -> list[Event]:
        return []

    def stop(self, grace_s: float = 5.0) -> None:
        pass

    def pids(self) -> dict[int, int]:
        return {}


class Probe:
    """Driver-side callbacks: report-to-publish latency per round, the restart decision."""

    def __init__(self) -> None:
        self.sent: dict[int, float] = {}
        self.latency: list[tuple[float, float]] = []  # (driver time, seconds)
        self.failure_at: float | None = None

    def on_report(self, rank: int, round_: int, metrics: dict[str, Any]) -> None:
        sent = metrics.get("sent", 0.0)
        if sent > self.sent.get(round_, 0.0):
            self.sent[round_] = sent

    def on_round(self, round_: int, metrics: dict[str, Any]) -> None:
        now = time.time()
        self.latency.append((now, now - self.sent.pop(round_, now)))

    def on_failure(self, failure: Any) -> None:
        self.failure_at = time.time()


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _thread_cpu_s(tid: int) -> float:
    """CPU seconds (user + system) of this process's thread ``tid``."""
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_one(n: int, measure_s: float, warmup_s: float, profile: bool = False) -> dict[str, Any]:
    tmp = tempfile.mkdtemp(prefix="ctlscale")
    run_dir = RunDirectory(tmp, f"n{n}")
    run_dir.create()
    stop = threading.Event()
    probe = Probe()
    # Connect + warm up, then measure, then rank n//2 freezes.
    connect_s = 5.0 + n / 50
    t0 = time.time()
    freeze_at = t0 + connect_s + warmup_s + measure_s
    starts: list[Any] = []
    groups: list[SimGroup] = []

    class Launcher:
        def start(self, spec: WorkerSpec) -> Any:
            starts.append(time.time())
            if len(starts) > 1:
                return _Idle(stop)
            groups.append(SimGroup(spec, min(4, n), n // 2, freeze_at))
            return groups[-1]

    ctl = Controller(
        launcher=Launcher(),
        make_spec=lambda a, s, latest: WorkerSpec(world_size=n, run_dir=run_dir.path),
        world_size=n,
        run_dir=run_dir,
        checkpoints=CheckpointManager(run_dir.fs, run_dir.path, CheckpointConfig(num_to_keep=2)),
        failure_policy=FailurePolicy(FailureConfig(max_failures=1)),
        progress=make_progress("off"),
        callbacks=[probe],
        failure_grace_s=GRACE_S,
        worker_timeout_s=TIMEOUT_S,
        stop_event=stop,
    )
    cpu: dict[str, float] = {}
    events_file = Path(run_dir.path) / "events.jsonl"
    main_tid = threading.get_native_id()  # the controller's loop runs on this thread

    def sample() -> None:
        start = freeze_at - measure_s
        time.sleep(max(0.0, start - time.time()))
        cpu["t0"], cpu["c0"] = time.monotonic(), time.process_time()
        cpu["m0"] = _thread_cpu_s(main_tid)
        cpu["e0"] = events_file.stat().st_size
        time.sleep(max(0.0, freeze_at - time.time()))
        cpu["t1"], cpu["c1"] = time.monotonic(), time.process_time()
        cpu["m1"] = _thread_cpu_s(main_tid)
        cpu["e1"] = events_file.stat().st_size
        cpu["rss"] = _rss_mib()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        prof.runcall(ctl.run)
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    else:
        ctl.run()
    sampler.join(timeout=5)
    events = [json.loads(line) for line in (Path(run_dir.path) / "events.jsonl").open()]
    shutil.rmtree(tmp, ignore_errors=True)
    failure = next(e for e in events if e["type"] == "failure")
    decided = next(e for e in events if e["type"] == "decision")
    frozen = [e for e in events if e["type"] == "report" and e["rank"] == n // 2]
    last_sent = max(e["metrics"]["sent"] for e in frozen)
    published = sum(1 for e in events if e["type"] == "checkpoint")
    window = [s for t, s in probe.latency if freeze_at - measure_s <= t < freeze_at]
    window.sort()
    hellos = sum(1 for e in events if e["type"] == "report" and e["round"] == 0)
    return {
        "n": n,
        "connected": hellos,
        "connect_s": groups[0].all_connected_s,
        "driver_cpu": (cpu["c1"] - cpu["c0"]) / (cpu["t1"] - cpu["t0"]),
        "controller_thread_cpu": (cpu["m1"] - cpu["m0"]) / (cpu["t1"] - cpu["t0"]),
        "rounds_measured": len(window),
        "latency_med_ms": 1e3 * statistics.median(window) if window else float("nan"),
        "latency_p99_ms": 1e3 * window[min(len(window) - 1, int(0.99 * len(window)))]
        if window
        else float("nan"),
        "rss_mib": cpu["rss"],
        # From the frozen rank's last message (its last report, sent with its last heartbeat).
        "detect_over_timeout_s": failure["time"] - last_sent - TIMEOUT_S,
        "failure": failure["message"][:80],
        "decide_s": decided["time"] - failure["time"],
        "checkpoints_published": published,
        # Written during the measuring window (reports, checkpoints: the steady state).
        "events_bytes_per_s": (cpu["e1"] - cpu["e0"]) / (cpu["t1"] - cpu["t0"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sim", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address")
    parser.add_argument("--ranks")
    parser.add_argument("--run-path")
    parser.add_argument("--rounds", type=int, default=100000)
    parser.add_argument("--freeze-rank", type=int, default=-1)
    parser.add_argument("--freeze-at", type=float, default=float("inf"))
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--measure-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument(
        "--profile", action="store_true", help="cProfile the controller's thread (slower)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per size (medians)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    if args.sim:
        simulate(args)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * max(args.sizes) + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    rows = []
    for n in args.sizes:
        runs = []
        for _ in range(args.repeats):
            runs.append(run_one(n, args.measure_s, args.warmup_s, args.profile))
            print(json.dumps(runs[-1]), flush=True)
        # The median of each figure over the repeats.
        row = {
            k: statistics.median(r[k] for r in runs)
            if isinstance(v, int | float) and k != "n"
            else v
            for k, v in runs[0].items()
        }
        rows.append(row)
    fit = [r for r in rows if r["n"] <= 256]
    if len(fit) >= 2:
        xs, ys = [r["n"] for r in fit], [r["driver_cpu"] for r in fit]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        a = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
            (x - mx) ** 2 for x in xs
        )
        b = my - a * mx
        print(f"model: driver_cpu = {a:.3e} * N + {b:.4f}  (fitted on N <= 256, 1 round/s)")
        for r in rows:
            print(f"  N={r['n']}: predicted {a * r['n'] + b:.3f}, measured {r['driver_cpu']:.3f}")
    print()
    print(
        "| N | driver CPU (cores) | controller thread (cores) | report->publish median / p99 "
        "(ms) | driver RSS (MiB) | lost worker detected after timeout + (s) | detection -> "
        "decision (s) | events.jsonl (KB/s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['n']} | {r['driver_cpu']:.3f} | {r['controller_thread_cpu']:.3f} "
            f"| {r['latency_med_ms']:.1f} / "
            f"{r['latency_p99_ms']:.1f} | {r['rss_mib']:.0f} | {r['detect_over_timeout_s']:.2f} "
            f"| {r['decide_s']:.2f} | {r['events_bytes_per_s'] / 1e3:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
