"""Ray across hosts with nothing to configure: three hosts of a network test bed, one Ray node
each, and a 3-worker SPREAD job started on the head host as a user would (``ringtrain run
--backend ray --address auto``, and ``rt.ScalingConfig(..., backend="ray",
placement_strategy="SPREAD")``), with no ``GLOO_SOCKET_IFNAME`` anywhere: each host's own name
resolves to 127.0.1.1, the trap that made gloo advertise loopback to the other hosts. It must
end bit-identical to the same job on local processes, one worker per host, and every listener
of the run (driver channel, rendezvous store, gloo) bound to its host's address, never the
wildcard (read from each host's own ``/proc/PID/net/tcp``). The cluster has Ray 2.60's token
authentication on (a ``~/.ray/auth_token`` on every host): the CLI finds it with ``auto``, and the
Python API reaches it by its explicit address, for which Ray does not enable the token itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hosts_workload import tcp_listeners
from support import assert_bit_identical, wait_until

pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")

pytestmark = pytest.mark.xdist_group("ray")  # one Ray cluster at a time on the machine

HERE = Path(__file__).resolve().parent
WORKLOAD = str(HERE / "hosts_workload.py")
STEPS = 24
_reference: dict[str, dict] = {}


def _env() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}


def reference(tmp_path_factory) -> dict:
    """The same job on 3 local worker processes, uninterrupted."""
    if "final" not in _reference:
        out = tmp_path_factory.mktemp("local") / "final.pt"
        runs = out.parent / "runs"
        cmd = [
            "ringtrain",
            "run",
            "-n",
            "3",
            "--storage-path",
            str(runs),
            "--name",
            "local",
            WORKLOAD,
            "--steps",
            str(STEPS),
            "--sleep",
            "0",
            "--out",
            str(out),
        ]
        done = subprocess.run(
            [sys.executable, "-m", "ringtrain.cli", *cmd[1:]],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, **_env()},
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        _reference["final"] = torch.load(out, weights_only=True)
    return _reference["final"]


def test_ringtrain_run_spreads_over_three_hosts_with_nothing_configured(
    ray_bed, tmp_path, tmp_path_factory
):
    bed = ray_bed.bed
    h1 = bed.hosts[0]
    out = tmp_path / "ray.pt"
    cmd = [
        "ringtrain",
        "run",
        "--backend",
        "ray",
        "--address",
        "auto",
        "-n",
        "3",
        "--placement-strategy",
        "SPREAD",
        "--storage-path",
        str(tmp_path / "runs"),
        "--name",
        "hosts",
        WORKLOAD,
        "--steps",
        str(STEPS),
        "--listeners-at",
        "4",
        "--out",
        str(out),
    ]
    driver = ray_bed.popen(
        h1, cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        files = [Path(f"{out}.listeners.{rank}.json") for rank in range(3)]
        assert wait_until(
            lambda: all(f.exists() for f in files) or driver.poll() is not None,
            timeout_s=400,
            interval_s=0.2,
        )
        driver_listeners = tcp_listeners(driver.pid) if driver.poll() is None else None
        output, _ = driver.communicate(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    assert driver.returncode == 0, output[-4000:]
    hosts = {}
    for rank, f in enumerate(files):
        record = json.loads(f.read_text())
        address = bed.host(record["host"]).address
        hosts[rank] = record["host"]
        assert record["worker"], f"rank {rank} listens on nothing (gloo?)"
        assert all(a == address for a, _ in record["worker"]), (
            f"rank {rank} on {record['host']} listens on {record['worker']}"
        )
        if rank == 0:  # its actor hosts the rendezvous store (the actor's other ports are Ray's)
            master, port = record["master"]
            store = [a for a, p in record["actor"] if p == port]
            assert master == address and store == [address], (record["master"], record["actor"])
    assert sorted(hosts.values()) == ["h1", "h2", "h3"], hosts  # one worker per host
    # The driver's channel (the driver's other ports are Ray's own, as a Ray driver's).
    channel = [a for a, p in driver_listeners or [] if p == int(record["driver"].split(":")[1])]
    assert channel == [h1.address], (record["driver"], driver_listeners)
    assert_bit_identical(torch.load(out, weights_only=True), reference(tmp_path_factory))


_API_DRIVER = """
import ringtrain as rt
import hosts_workload
result = rt.Trainer(
    hosts_workload.train_fn,
    rt.ScalingConfig(
        num_workers=3, backend="ray", placement_strategy="SPREAD", ray_address={address!r}
    ),
    rt.RunConfig(name="api", storage_path={runs!r}, progress="off"),
    train_loop_config={{"steps": {steps}, "out": {out!r}}},
).fit()
print(result.status)
"""


def test_the_python_api_with_spread_and_an_explicit_token_authenticated_address(
    ray_bed, tmp_path, tmp_path_factory
):
    h1 = ray_bed.bed.hosts[0]
    out = tmp_path / "api.pt"
    script = _API_DRIVER.format(
        runs=str(tmp_path / "runs"), steps=STEPS, out=str(out), address=ray_bed.address
    )
    done = ray_bed.run(
        h1, [sys.executable, "-c", textwrap.dedent(script)], env=_env(), check=False, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    hello = {
        line.split(" on ")[-1].strip()
        for line in (done.stdout + done.stderr).splitlines()
        if " of 3 on " in line
    }
    assert hello == {"h1", "h2", "h3"}, done.stdout[-2000:]
    assert_bit_identical(torch.load(out, weights_only=True), reference(tmp_path_factory))
