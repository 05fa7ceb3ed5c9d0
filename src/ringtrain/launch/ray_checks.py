"""What the Ray worker group checks before it starts worker processes, so that a cluster that
cannot run the group is named at once (not retried until ``max_failures`` is spent):

* **storage** (:func:`blind_workers`): a local run directory that some node cannot see;
* **network** (:func:`network_plans`, :func:`check_network`): each worker's actor, on its own
  node, picks the interface that routes to the rendezvous address
  (:func:`ringtrain.cluster.netif.choose_interface`; ``GLOO_SOCKET_IFNAME`` of the cluster or the
  run wins) and tries to reach the rendezvous store and the driver's channel from it. A group on
  several hosts whose gloo would advertise a loopback address, or a worker that cannot reach the
  rendezvous or the driver, is a :class:`~ringtrain.launch.ray_actors.NetworkConfigError` naming
  the rank, its host, the interface it chose and the address it could not reach.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Sequence
from typing import Any

from ringtrain.launch.ray_actors import GroupWorker, NetworkConfigError

PROBE_TIMEOUT_S = 5.0
"""How long a worker's actor tries to connect to the rendezvous store and the driver."""


def blind_workers(ray: Any, run_dir: str, workers: list[GroupWorker]) -> list[GroupWorker]:
    """The workers (on nodes other than the driver's) that cannot see a local run directory
    (a shared filesystem mounted at the same path is needed): checked with a marker file the
    driver writes. An fsspec URL is reached the same way by every node."""
    import fsspec

    from ringtrain.checkpoint.storage import is_local_fs

    fs, path = fsspec.core.url_to_fs(run_dir)
    if not is_local_fs(fs):
        return []
    here = ray.get_runtime_context().get_node_id()
    remote: dict[str, GroupWorker] = {}
    for w in workers:
        if w.info["node_id"] != here:
            remote.setdefault(w.info["node_id"], w)
    if not remote:
        return []  # every worker runs on the driver's node
    os.makedirs(path, exist_ok=True)
    marker = os.path.join(path, f".ringtrain-shared-{secrets.token_hex(4)}")
    with open(marker, "w") as f:
        f.write("visible from every node?\n")
    try:
        seen = ray.get([w.actor.path_exists.remote(marker) for w in remote.values()])
    finally:
        with contextlib.suppress(OSError):
            os.remove(marker)
    blind_nodes = {n for n, ok in zip(remote, seen, strict=True) if not ok}
    return [w for w in workers if w.info["node_id"] in blind_nodes]


def network_plans(
    ray: Any,
    pairs: Sequence[tuple[GroupWorker, dict[str, str]]],
    master: tuple[str, int],
    driver_addr: str,
    timeout_s: float,
) -> list[dict[str, Any]]:
    """Ask each worker's actor for its network plan (:meth:`RayWorker.net_plan
    <ringtrain.launch.ray_worker.RayWorker.net_plan>`) for the environment it is about to get.

    Raises:
        NetworkConfigError: an actor did not answer within ``timeout_s`` (its host is
            unreachable), naming the rank, host and address.
    """
    refs = [w.actor.net_plan.remote(master, driver_addr, env, PROBE_TIMEOUT_S) for w, env in pairs]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    silent = [w for (w, _), ref in zip(pairs, refs, strict=True) if ref not in done]
    if silent:
        raise NetworkConfigError(
            "; ".join(
                f"rank {w.rank} on host {w.info.get('hostname', '?')} ({w.info.get('ip', '?')}) "
                f"did not answer within {timeout_s:g} s (is its host reachable from the "
                f"driver's node?)"
                for w in silent
            )
        )
    return list(ray.get(refs))


def check_network(
    workers: Sequence[GroupWorker], plans: Sequence[dict[str, Any]], hosts: int
) -> None:
    """Refuse a group that cannot communicate: a worker that cannot reach the rendezvous
    store or the driver from the interface it chose, or, on ``hosts`` > 1 hosts, one whose
    gloo would listen on and advertise a loopback address.

    Raises:
        NetworkConfigError: naming each such rank, its host, its interface and what it could
            not reach.
    """
    problems = []
    for w, plan in zip(workers, plans, strict=True):
        where = f"rank {w.rank} on host {plan.get('hostname', '?')} ({w.info.get('ip', '?')})"
        chosen = plan.get("interface", "?")
        for what in plan.get("unreachable", []):
            problems.append(f"{where} cannot reach {what} from interface {chosen}")
        if hosts > 1 and plan.get("loopback"):
            problems.append(
                f"{where}: gloo would listen on and advertise the loopback address "
                f"{plan.get('advertised', '?')} ({plan.get('why', '')}), which the other "
                f"{hosts - 1} host(s) cannot reach; "
                + (
                    "unset GLOO_SOCKET_IFNAME or set it to the cluster network's interface"
                    if plan.get("source") == "user"
                    else "set GLOO_SOCKET_IFNAME to the cluster network's interface"
                )
            )
    if problems:
        raise NetworkConfigError(
            "the worker group cannot communicate across its hosts: " + "; ".join(problems)
        )


__all__ = ["PROBE_TIMEOUT_S", "blind_workers", "check_network", "network_plans"]
