"""A Ray cluster on a :class:`~ringtrain.testing.netbed.NetBed`: one Ray node per host.

``ray start --head`` on the first host and ``ray start --address HEAD:PORT`` on the others, each
with its host's ``--node-ip-address``, as on real machines. Each host keeps Ray's files in its own
directory (``RAY_TMPDIR``, what a machine's own ``/tmp`` would be), so ``address="auto"`` on a host
finds the cluster that host joined, and nothing of another Ray instance on the machine is touched.
Run the driver on a host too (:meth:`RayBed.popen`, :meth:`RayBed.run`): only the hosts reach
each other.

Example::

    with NetBed(hosts=3) as bed, RayBed(bed) as ray_bed:
        ray_bed.run(bed.hosts[0], ["ringtrain", "run", "--backend", "ray", "--address",
                                   "auto", "-n", "3", "train.py"])
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ringtrain.testing.netbed import Host, NetBed

HEAD_PORT = 6379
START_ATTEMPTS = 2


class RayBed:
    """One Ray node per host of ``bed`` (see the module's docstring).

    Args:
        bed: the hosts (made already: :meth:`NetBed.up`).
        cpus: CPUs each node offers (Ray's ``--num-cpus``).
        env: more environment for every Ray node and every command run through this object.
        system_config: Ray's ``--system-config`` for the head (e.g. faster node-death
            detection: ``{"health_check_period_ms": 500, "health_check_failure_threshold": 4}``).
        start_timeout_s: how long each ``ray start`` may take.
        token_auth: turn on Ray's token authentication (Ray 2.60): a ``~/.ray/auth_token`` on
            every host (a ``HOME`` of the bed's own; the machine's is not touched), which the
            head finds by itself, and ``RAY_AUTH_MODE=token`` for ``ray start --address`` on
            the other hosts, as Ray's documentation asks. Drivers get the ``HOME`` only.
    """

    def __init__(
        self,
        bed: NetBed,
        *,
        cpus: int = 1,
        env: Mapping[str, str] | None = None,
        system_config: Mapping[str, Any] | None = None,
        start_timeout_s: float = 180.0,
        token_auth: bool = False,
    ) -> None:
        self.bed = bed
        self.cpus = cpus
        self.extra_env = dict(env or {})
        self.system_config = dict(system_config or {})
        self.start_timeout_s = start_timeout_s
        self.root = f"/tmp/{bed.bridge}"
        self.head = bed.hosts[0]
        self.address = f"{self.head.address}:{HEAD_PORT}"
        self.token_auth = token_auth
        if token_auth:
            self.extra_env["HOME"] = os.path.join(self.root, "home")

    def __enter__(self) -> RayBed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def env(self, host: Host, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a process on ``host``: this interpreter's ``bin`` first on
        ``PATH`` (``ray``, ``ringtrain``), the host's own ``RAY_TMPDIR``, and ``extra``."""
        env = dict(os.environ)
        bindir = os.path.dirname(sys.executable)
        env["PATH"] = os.pathsep.join([bindir, env.get("PATH", "")])
        env["RAY_TMPDIR"] = os.path.join(self.root, host.name)
        env.pop("RAY_ADDRESS", None)
        env.update(self.extra_env)
        env.update(extra or {})
        return env

    def start(self) -> RayBed:
        """Start the head, then one node on each other host; wait until all are in.

        Raises:
            RuntimeError: a node did not start (its output is in the message).
        """
        for host in self.bed.hosts:
            os.makedirs(os.path.join(self.root, host.name), exist_ok=True)
        if self.token_auth:
            import secrets

            token = os.path.join(self.extra_env["HOME"], ".ray", "auth_token")
            os.makedirs(os.path.dirname(token), exist_ok=True)
            with open(token, "w") as f:
                f.write(secrets.token_hex(16))
        try:
            for host in self.bed.hosts:
                self._start_node(host)
            self.wait_for_nodes(len(self.bed.hosts))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, host: Host) -> None:
        common = [
            "--node-ip-address",
            host.address,
            "--num-cpus",
            str(self.cpus),
            "--disable-usage-stats",
        ]
        if host is self.head:
            cmd = [
                "ray",
                "start",
                "--head",
                "--port",
                str(HEAD_PORT),
                "--include-dashboard",
                "false",
                *common,
            ]
            if self.system_config:
                import json

                cmd += ["--system-config", json.dumps(self.system_config)]
        else:
            cmd = ["ray", "start", "--address", self.address, *common]
        env = {"RAY_AUTH_MODE": "token"} if self.token_auth and host is not self.head else {}
        for attempt in range(1, START_ATTEMPTS + 1):
            done = self.run(host, cmd, env=env, check=False, timeout=self.start_timeout_s)
            if done.returncode == 0:
                return
            if attempt == START_ATTEMPTS:
                raise RuntimeError(
                    f"ray start on {host.name} ({host.address}) failed:\n{done.stdout[-2000:]}"
                    f"\n{done.stderr[-2000:]}"
                )
            self.bed.kill_host(host)

    def wait_for_nodes(self, count: int, timeout_s: float = 120.0) -> None:
        """Wait until ``count`` nodes are alive in the cluster (asked on the head)."""
        probe = (
            "import ray,sys; ray.init(address='auto', log_to_driver=False); "
            "print(sum(1 for n in ray.nodes() if n['Alive']))"
        )
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            done = self.run(self.head, [sys.executable, "-c", probe], check=False, timeout=120)
            lines = done.stdout.strip().splitlines()
            last = lines[-1] if lines else ""
            if done.returncode == 0 and last.isdigit() and int(last) >= count:
                return
            time.sleep(1.0)
        raise RuntimeError(f"the Ray cluster on bed {self.bed.id} has {last!r} of {count} nodes")

    def run(
        self,
        host: Host,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` on ``host`` with the bed's Ray environment (:meth:`env`)."""
        return self.bed.run(host, cmd, check=check, env=self.env(host, env), **kwargs)

    def popen(
        self, host: Host, cmd: Sequence[str], *, env: Mapping[str, str] | None = None, **kwargs: Any
    ) -> subprocess.Popen[Any]:
        """Start ``cmd`` on ``host`` with the bed's Ray environment."""
        return self.bed.popen(host, cmd, env=self.env(host, env), **kwargs)

    def restart_node(self, host: Host) -> None:
        """Start ``host``'s Ray node again (after :meth:`NetBed.kill_host`)."""
        self.bed.kill_host(host)
        self._start_node(host)

    def stop(self) -> None:
        """Stop every node: every process on the hosts is killed at once (what ``ray stop
        --force`` does, without its ten seconds per host), then the nodes' files are
        removed."""
        for host in self.bed.hosts:
            self.bed.kill_host(host)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(self.bed.pids(h) for h in self.bed.hosts):
            time.sleep(0.05)
        shutil.rmtree(self.root, ignore_errors=True)


__all__ = ["HEAD_PORT", "RayBed"]
