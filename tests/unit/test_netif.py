"""Which interface a worker's gloo uses (cluster/netif.py), and what the Ray group refuses
before it starts workers that could not communicate (launch/ray_checks.py): pure logic, plus the
kernel's answers about this machine's own loopback (a socket, no process)."""

from __future__ import annotations

import socket

import pytest

from ringtrain.cluster.netif import (
    InterfaceChoice,
    check_not_self_rendezvous,
    choose_interface,
    give_up_after,
    interface_environment,
    interface_of,
    own_addresses,
    route_source,
    socket_fds,
    tcp_opened_by,
)
from ringtrain.launch.ray_actors import GroupWorker, NetworkConfigError
from ringtrain.launch.ray_checks import check_network


def test_the_route_to_loopback_is_the_loopback_interface():
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo"
    choice = choose_interface("127.0.0.1", {})
    assert (choice.ifname, choice.address, choice.source) == ("lo", "127.0.0.1", "route")
    assert choice.loopback


def test_a_users_interface_wins_and_its_variables_are_left_alone():
    choice = choose_interface("127.0.0.1", {"GLOO_SOCKET_IFNAME": "eth7"})
    assert (choice.ifname, choice.source) == ("eth7", "user")
    assert interface_environment(choice, {"GLOO_SOCKET_IFNAME": "eth7"}) == {}


def test_a_routed_choice_sets_every_variable_the_user_did_not():
    choice = InterfaceChoice("eth0", "10.77.0.2", "route", "10.77.0.1")
    env = interface_environment(choice, {"NCCL_SOCKET_IFNAME": "ib0"})
    assert env == {"GLOO_SOCKET_IFNAME": "eth0", "TP_SOCKET_IFNAME": "eth0"}
    assert not choice.loopback
    assert choice.describe() == "eth0 (10.77.0.2)"


def test_an_unresolvable_rendezvous_leaves_the_choice_to_gloo():
    choice = choose_interface("no-such-host.invalid", {})
    assert choice.source == "unknown" and choice.ifname is None
    assert interface_environment(choice, {}) == {}


def _worker(rank: int, ip: str) -> GroupWorker:
    return GroupWorker(actor=None, bundle=rank, name=f"w{rank}", info={"ip": ip}, rank=rank)


def _plan(**kw):
    plan = {"hostname": "h2", "interface": "eth0 (10.77.0.2)", "loopback": False, "unreachable": []}
    plan.update(kw)
    return plan


def test_a_group_whose_gloo_would_advertise_loopback_across_hosts_is_refused_naming_it():
    workers = [_worker(0, "10.77.0.1"), _worker(1, "10.77.0.2")]
    plans = [
        _plan(hostname="h1"),
        _plan(
            interface="lo (127.0.0.1, GLOO_SOCKET_IFNAME)",
            loopback=True,
            advertised="127.0.0.1",
            why="GLOO_SOCKET_IFNAME=lo",
            source="user",
        ),
    ]
    with pytest.raises(NetworkConfigError) as err:
        check_network(workers, plans, hosts=2)
    message = str(err.value)
    assert "rank 1 on host h2 (10.77.0.2)" in message
    assert "loopback address 127.0.0.1 (GLOO_SOCKET_IFNAME=lo)" in message
    assert "unset GLOO_SOCKET_IFNAME" in message
    check_network(workers, plans, hosts=1)  # one host: loopback reaches every peer


def test_a_worker_that_cannot_reach_the_rendezvous_is_named_with_its_interface():
    plans = [_plan(unreachable=["the rendezvous store at 10.77.0.1:4242 (timed out after 5 s)"])]
    with pytest.raises(NetworkConfigError) as err:
        check_network([_worker(2, "10.77.0.3")], plans, hosts=3)
    assert (
        "rank 2 on host h2 (10.77.0.3) cannot reach the rendezvous store at 10.77.0.1:4242 "
        "(timed out after 5 s) from interface eth0 (10.77.0.2)"
    ) in str(err.value)


def test_connections_a_group_opened_give_up_after_the_timeout():
    server = socket.create_server(("127.0.0.1", 0))
    try:
        client, opened = tcp_opened_by(
            lambda: socket.create_connection(server.getsockname(), timeout=5)
        )
        accepted, _ = server.accept()
        assert client.fileno() in opened and set(opened.values()) <= set(socket_fds().values())
        assert give_up_after(opened, 7.5) == 1
        user_timeout = getattr(socket, "TCP_USER_TIMEOUT", 18)
        assert client.getsockopt(socket.IPPROTO_TCP, user_timeout) == 7500
        assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert give_up_after(opened, None) == 0
        client.close()
        accepted.close()
    finally:
        server.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_own_addresses_are_loopback_and_this_hosts_interfaces():
    assert own_addresses(["127.0.0.1", "127.0.1.1", "::1"]) == ["127.0.0.1", "127.0.1.1", "::1"]
    assert own_addresses(["192.0.2.7", "not-an-address"]) == []  # TEST-NET-1: nobody's


def test_a_node_that_resolves_the_rendezvous_to_itself_is_refused_naming_it():
    port = _free_port()  # nothing listens there: node 0 is elsewhere
    with pytest.raises(NetworkConfigError) as err:
        check_not_self_rendezvous(
            "localhost", port, rank=3, node_rank=1, launcher="slurm", wait_s=0.3
        )
    msg = str(err.value)
    assert "rank 3" in msg and "node 1" in msg and "slurm" in msg
    assert "MASTER_ADDR='localhost'" in msg and "127.0.0.1" in msg and str(port) in msg
    assert socket.gethostname() in msg


def test_node_0_and_a_remote_rendezvous_are_not_checked():
    port = _free_port()
    check_not_self_rendezvous("localhost", port, rank=0, node_rank=0, launcher="torchrun")
    check_not_self_rendezvous("192.0.2.7", port, rank=1, node_rank=1, launcher="torchrun")


def test_nodes_sharing_one_machine_with_node_0_serving_here_pass():
    # torchrun --nnodes 2 --node-rank 1 --master-addr 127.0.0.1: node 0 is on this machine.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        check_not_self_rendezvous(
            "127.0.0.1", port, rank=1, node_rank=1, launcher="torchrun", wait_s=0.3
        )


def test_init_process_group_refuses_the_trap_before_any_group(monkeypatch):
    import torch.distributed as dist

    from ringtrain.cluster import netif
    from ringtrain.cluster.distributed import init_process_group
    from ringtrain.cluster.env import SlurmEnvironment

    monkeypatch.setattr(netif, "SELF_RENDEZVOUS_WAIT_S", 0.3)
    environ = {
        "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
        "SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "1", "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(_free_port()),
    }  # fmt: skip
    ctx = SlurmEnvironment(environ).context()
    with pytest.raises(NetworkConfigError, match="rendezvous with itself"):
        init_process_group(ctx)
    assert not dist.is_initialized()
