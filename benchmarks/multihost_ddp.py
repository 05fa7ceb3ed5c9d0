"""Across three hosts: ringtrain's DDP step time against hand-written DDP under torchrun on the
same hosts, and gloo's allreduce bus bandwidth against the link rate. Needs root (the hosts are
network namespaces on a private bridge, ``ringtrain.testing.netbed``; one Ray node each).

    python benchmarks/multihost_ddp.py --rate-mbit 100 --steps 40 --repeats 5

Every host's link is limited to ``--rate-mbit`` Mbit/s each way (``tbf``). The workload is
``overhead.py``'s (``_workload.py``: an MLP of 1,863,690 parameters, 7.45 MB of float32
gradients per step, a batch of 64 per worker, one torch thread per worker), one worker per host:

* ``torchrun``: on each host ``torchrun --nnodes 3 --node-rank I --nproc-per-node 1
  --master-addr <h1's address>`` runs ``_ddp_worker.py`` (``init_process_group("gloo")`` +
  ``DistributedDataParallel``), with ``GLOO_SOCKET_IFNAME`` set to the host's interface by hand,
  as a torchrun user across hosts must;
* ``ringtrain``: ``_ringtrain_driver.py --workers 3 --backend ray --address auto --placement
  SPREAD`` on h1 (``rt.Trainer`` + ``rt.prepare_model``, a report every 50 steps); ringtrain
  picks the interface itself.

The two alternate (torchrun, ringtrain, torchrun, ...), after one untimed warm-up run of each.
A run's step time is the median of rank 0's step durations from step 10 on; the summary is the
median over the repeats, and the ratio ringtrain / torchrun (target <= 1.02).

Bus bandwidth: ``_mh_allreduce_worker.py`` under torchrun on the three hosts times
``dist.all_reduce`` of each ``--sizes`` (float32), the slowest rank's time per call, median over
``--ar-repeats``; busbw = S * 2(W-1)/W / time (the NCCL-tests convention: the bytes each host must
send for a ring allreduce, so the link rate is its ceiling).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ringtrain.testing.netbed import NetBed, unavailable
from ringtrain.testing.raybed import RayBed

HERE = Path(__file__).resolve().parent
WARMUP_STEPS = 10


def _median_step(prefix: Path) -> float:
    with open(f"{prefix}.rank0.json") as f:
        record = json.load(f)
    return statistics.median(record["step_durations"][WARMUP_STEPS:])


def _torchrun(
    bed: NetBed, script: str, args: list[str], port: int, timeout_s: float, tmp: Path
) -> None:
    """``script`` under torchrun, one process per host of ``bed``; raises if one fails."""
    hosts = bed.hosts
    procs = []
    for i, host in enumerate(hosts):
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            GLOO_SOCKET_IFNAME=host.ifname,
            TMPDIR=str(tmp),
            PYTHONPATH=str(HERE),
        )
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(hosts)),
            "--node-rank",
            str(i),
            "--nproc-per-node",
            "1",
            "--master-addr",
            hosts[0].address,
            "--master-port",
            str(port),
            str(HERE / script),
            *args,
        ]
        procs.append(
            bed.popen(host, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    deadline = time.monotonic() + timeout_s
    failed = []
    for host, proc in zip(hosts, procs, strict=True):
        try:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{host.name}: rc={proc.returncode}\n{out.decode()[-2000:]}")
    if failed:
        raise RuntimeError("torchrun failed:\n" + "\n".join(failed))


def _ringtrain(ray_bed: RayBed, steps: int, out: Path, timeout_s: float) -> None:
    bed = ray_bed.bed
    cmd = [
        sys.executable,
        str(HERE / "_ringtrain_driver.py"),
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--storage-path",
        str(out.parent / "runs"),
        "--workers",
        str(len(bed.hosts)),
        "--backend",
        "ray",
        "--address",
        "auto",
        "--placement",
        "SPREAD",
    ]
    done = ray_bed.run(
        bed.hosts[0],
        cmd,
        env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)},
        check=False,
        timeout=timeout_s,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"ringtrain failed: rc={done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate-mbit", type=float, default=100.0, help="each link's rate")
    parser.add_argument("--steps", type=int, default=40, help="steps per run (first 10 untimed)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each variant")
    parser.add_argument("--sizes", default="1048576,8388608,33554432", help="allreduce bytes")
    parser.add_argument("--ar-repeats", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=600.0, help="per run")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    why = unavailable()
    if why is not None:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="multihost-ddp-"))
    times: dict[str, list[float]] = {"torchrun": [], "ringtrain": []}
    port = 29511
    with NetBed(hosts=3, rate_mbit=args.rate_mbit) as bed, RayBed(bed, cpus=2) as ray_bed:
        for rep in range(args.repeats + 1):  # rep 0: warm-up of each, untimed
            for variant in ("torchrun", "ringtrain"):
                out = work / f"{variant}{rep}"
                out.mkdir()
                prefix = out / "t"
                t0 = time.monotonic()
                if variant == "torchrun":
                    port += 1
                    _torchrun(
                        bed,
                        "_ddp_worker.py",
                        ["--steps", str(args.steps), "--out", str(prefix)],
                        port,
                        args.timeout_s,
                        out,
                    )
                else:
                    _ringtrain(ray_bed, args.steps, prefix, args.timeout_s)
                step = _median_step(prefix)
                print(
                    f"{'warm-up' if rep == 0 else f'run {rep}'} {variant:9s} median step "
                    f"{step * 1e3:8.1f} ms (wall {time.monotonic() - t0:.0f} s)",
                    flush=True,
                )
                if rep:
                    times[variant].append(step)
        port += 1
        ar_out = work / "allreduce.json"
        _torchrun(
            bed,
            "_mh_allreduce_worker.py",
            ["--sizes", args.sizes, "--repeats", str(args.ar_repeats), "--out", str(ar_out)],
            port,
            args.timeout_s,
            work,
        )
        with open(ar_out) as f:
            allreduce = json.load(f)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["ringtrain"] / med["torchrun"]
    print(f"\n3 hosts, links {args.rate_mbit:g} Mbit/s, {args.repeats} interleaved runs each:")
    for k, v in times.items():
        print(
            f"  {k:9s} median step {med[k] * 1e3:8.1f} ms  runs: "
            + ", ".join(f"{x * 1e3:.0f}" for x in v)
        )
    print(f"  ratio ringtrain/torchrun {ratio:.3f} (target <= 1.02)")
    world = allreduce["world_size"]
    link = args.rate_mbit * 1e6 / 8
    rows = []
    print(f"\nallreduce bus bandwidth, W={world}, gloo, link {link / 1e6:.2f} MB/s:")
    for size, secs in allreduce["sizes"].items():
        t = statistics.median(secs)
        busbw = int(size) * 2 * (world - 1) / world / t
        rows.append(
            {"bytes": int(size), "median_s": t, "busbw_Bps": busbw, "of_link": busbw / link}
        )
        print(
            f"  {int(size) / 2**20:6.1f} MiB  {t * 1e3:8.1f} ms  busbw {busbw / 1e6:6.2f} MB/s"
            f"  = {busbw / link:.0%} of the link"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rate_mbit": args.rate_mbit,
                    "steps": args.steps,
                    "times_s": times,
                    "median_s": med,
                    "ratio": ratio,
                    "allreduce": rows,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
