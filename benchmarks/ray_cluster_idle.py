"""What the Ray tests' cluster costs while it waits: the CPU of every Ray process of the two-node
test cluster (``tests/ray_cluster.py``: a head with the dashboard, which Ray's state API needs,
and a worker node, 2 CPUs each) over a window in which nothing is scheduled.

    python benchmarks/ray_cluster_idle.py --seconds 60 --repeats 3

Reports the cluster's start-up (wall seconds, and the CPU seconds its processes used by the end of
a 15 s settling time), then per window the CPU seconds of all Ray processes, the share of one core
and the top processes; the median over ``--repeats`` windows. CPU times are read from ``/proc``
(psutil), so the machine's other load does not change them much (it changes wall time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import psutil

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
)


def ray_processes() -> dict[int, tuple[str, float]]:
    """``{pid: (command line, CPU seconds)}`` of this machine's Ray processes."""
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "cpu_times"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        times = proc.info["cpu_times"]
        if "ray" in cmd and proc.pid != os.getpid() and times is not None:
            found[proc.pid] = (cmd[:80], times.user + times.system)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="window length (s)")
    parser.add_argument("--repeats", type=int, default=3, help="windows")
    parser.add_argument("--top", type=int, default=8, help="processes listed per window")
    args = parser.parse_args()

    import ray

    from ray_cluster import SHARED_HEAD_ARGS, start_cluster

    t0 = time.monotonic()
    cluster = start_cluster(SHARED_HEAD_ARGS)
    ray.init(address=cluster.address)
    started = time.monotonic() - t0
    try:
        time.sleep(15)
        before = ray_processes()
        print(
            f"cluster started in {started:.1f} s; its {len(before)} processes used "
            f"{sum(c for _, c in before.values()):.1f} CPU-s by 15 s later"
        )
        totals = []
        for window in range(args.repeats):
            time.sleep(args.seconds)
            after = ray_processes()
            rows = sorted(
                (
                    (cpu - before.get(pid, ("", 0.0))[1], pid, cmd)
                    for pid, (cmd, cpu) in after.items()
                ),
                reverse=True,
            )
            total = sum(r[0] for r in rows)
            totals.append(total)
            print(
                f"window {window + 1}: {total:.2f} CPU-s in {args.seconds:g} s = "
                f"{100 * total / args.seconds:.1f} % of one core ({len(after)} processes)"
            )
            for cpu, pid, cmd in rows[: args.top]:
                print(f"    {cpu:6.2f}  {pid:>7}  {cmd}")
            before = after
        median = statistics.median(totals)
        print(
            f"median: {median:.2f} CPU-s per {args.seconds:g} s = "
            f"{100 * median / args.seconds:.1f} % of one core"
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
