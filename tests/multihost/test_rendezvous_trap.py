"""The self-rendezvous trap across two real hosts: a SLURM job whose second node resolves the
rendezvous name to itself is refused at once, naming the rank, host, name and address (without
the check it waits for a store nobody starts there until the rendezvous times out); the same
job with the name resolving to node 0 on both hosts trains."""

from __future__ import annotations

import subprocess
import sys
import time

from ringtrain.testing.netbed import NetBed

SCRIPT = """
import torch, ringtrain as rt
model = rt.prepare_model(torch.nn.Linear(2, 2))
print("READY", rt.get_context().world_rank, flush=True)
"""


def _start(bed: NetBed, port: int, ranks: tuple[int, ...] = (0, 1)) -> list[subprocess.Popen]:
    procs = []
    for rank in ranks:
        host = bed.hosts[rank]
        env = {
            "SLURM_PROCID": str(rank),
            "SLURM_NTASKS": "2",
            "SLURM_NNODES": "2",
            "SLURM_NODEID": str(rank),
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS_PER_NODE": "1",
            "MASTER_ADDR": "master",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            bed.popen(
                host,
                [sys.executable, "-c", SCRIPT],
                env={**_base_env(), **env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK"))}


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_a_node_resolving_the_rendezvous_to_itself_is_refused_at_once():
    with NetBed(hosts=2, self_resolves="address") as bed:
        h1, h2 = bed.hosts
        bed.set_hosts(h1, {"master": h1.address})
        bed.set_hosts(h2, {"master": "127.0.0.1"})  # the trap: an image's "127.0.0.1 master"
        (trapped,) = procs = _start(bed, 29610, ranks=(1,))  # node 0 is not needed to see it
        try:
            t0 = time.monotonic()
            out, _ = trapped.communicate(timeout=120)
            took = time.monotonic() - t0
        finally:
            _stop(procs)
        assert trapped.returncode != 0, out
        assert "NetworkConfigError" in out, out
        assert "rank 1 on host h2 (node 1, started by slurm)" in out, out
        assert "MASTER_ADDR='master' resolves to 127.0.0.1" in out, out
        assert took < 60, took  # at once (5 s of waiting), not the rendezvous timeout

        # The same job with the name resolving to node 0 everywhere trains.
        bed.set_hosts(h2, {"master": h1.address})
        procs = _start(bed, 29611)
        try:
            outs = [p.communicate(timeout=180)[0] for p in procs]
        finally:
            _stop(procs)
        assert [p.returncode for p in procs] == [0, 0], outs
        assert "READY 0" in outs[0] and "READY 1" in outs[1], outs
