"""On Ray, the rendezvous store listens on its node's address, not the wildcard (issue 18).

Uses the two-node cluster fixture of tests/backends/conftest.py (started on this machine, so
the actor's sockets can be read from /proc)."""

from __future__ import annotations

import pytest

import net_workloads
from support import wait_until

ray = pytest.importorskip("ray", reason="the Ray backend needs Ray: pip install 'ringtrain[ray]'")
pytest.importorskip("ray.util.state", reason="the Ray state API needs ray[default]")

from ray_cluster import assert_torn_down  # noqa: E402
from ringtrain.launch.ray_worker import remote_worker_class  # noqa: E402


def test_the_rank0_actor_store_binds_the_node_address(cluster):
    actor = remote_worker_class(ray).options(num_cpus=1).remote()
    try:
        port = ray.get(actor.host_store.remote(2), timeout=120)
        info = ray.get(actor.node_info.remote(), timeout=120)
        # the socket is bound before host_store returns; the store takes it over meanwhile
        assert wait_until(
            lambda: any(p == port for _, p in net_workloads.tcp_listeners(info["pid"])),
            timeout_s=60,
        )
        ours = [(h, p) for h, p in net_workloads.tcp_listeners(info["pid"]) if p == port]
        assert ours == [(info["ip"], port)], f"the store listens on {ours}, not {info['ip']}"
        assert info["ip"] not in ("0.0.0.0", "::")
        # and it serves: a worker-side client can use it
        import torch.distributed as dist

        client = dist.TCPStore(info["ip"], port, is_master=False, timeout=_seconds(60))
        client.set("k", "v")
        assert client.get("k") == b"v"
        del client
    finally:
        ray.kill(actor, no_restart=True)
    assert_torn_down()


def _seconds(s: float):
    from datetime import timedelta

    return timedelta(seconds=s)
