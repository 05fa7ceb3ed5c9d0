"""A two-node Ray cluster on this machine for the Ray tests (tests/backends/conftest.py's
``cluster`` fixture) and the check that a test left nothing of ringtrain's behind in it."""

from __future__ import annotations

from typing import Any

from support import wait_until

# The shared cluster's head (tests/backends/conftest.py): a lost node is noticed within about a
# second (test_ray.py's node death test), not after Ray's default of ~30 s.
SHARED_HEAD_ARGS: dict[str, Any] = {
    "_system_config": {"health_check_period_ms": 300, "health_check_failure_threshold": 3}
}


def start_cluster(head_args: dict[str, Any] | None = None, attempts: int = 3) -> Any:
    """A head and a worker node, 2 CPUs each, the head with a dashboard (the state API needs it);
    ``head_args`` are more ``add_node`` arguments of the head (e.g. ``_system_config``).

    Ray gives a starting node 30 s (a constant in ray/_private/node.py) to register with the GCS;
    on a loaded machine a node can take longer, and the start raises. Try again, from a clean
    slate, rather than fail a test on the machine's speed."""
    from ray.cluster_utils import Cluster

    for attempt in range(1, attempts + 1):
        c = Cluster()
        try:
            c.add_node(num_cpus=2, include_dashboard=True, dashboard_port=0, **(head_args or {}))
            c.add_node(num_cpus=2)
            c.wait_for_nodes(timeout=120)
            return c
        except Exception as exc:  # "The current node timed out during startup", or a timeout
            c.shutdown()
            if attempt == attempts:
                raise
            print(f"the Ray test cluster did not start ({exc}); starting it again")
    raise AssertionError("unreachable")


def restore_worker_node(c: Any) -> None:
    """Give cluster ``c`` one live, schedulable worker node again: a test may have removed it
    (test_ray.py's node death) or drained it (test_ray_drain.py; Ray stops a drained node once it
    is idle), and the next module expects a head and a worker node, 2 CPUs each. A worker node
    that is dead or draining is killed (whatever of it is left) and replaced.

    Raises:
        TimeoutError: if the new node does not register with the GCS within 120 s.
    """
    live = c.global_state._live_node_ids()
    draining = {str(n) for n in c.global_state.get_draining_nodes()}
    for node in list(c.worker_nodes):
        if node.node_id not in live or node.node_id in draining:
            c.remove_node(node, allow_graceful=False)
    if not c.worker_nodes:
        c.add_node(num_cpus=2)
    c.wait_for_nodes(timeout=120)


def leftovers() -> tuple[list, list]:
    """Ray actors alive and placement groups not removed, on the Ray instance this process is
    connected to (named: another instance on the machine, e.g. one still shutting down, would
    make the state API's address discovery refuse with "multiple active Ray instances")."""
    import ray
    from ray.util.state import list_actors, list_placement_groups

    address = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
    actors = list_actors(address=address, filters=[("state", "=", "ALIVE")])
    groups = [g for g in list_placement_groups(address=address) if g.state != "REMOVED"]
    return actors, groups


def _cpus_free() -> bool:
    import ray

    return ray.available_resources().get("CPU", 0) == ray.cluster_resources().get("CPU", -1)


def assert_torn_down() -> None:
    """No actor alive, no placement group left, every CPU free again (Ray's state API and
    resource view lag a moment: bounded wait). Also keeps the next test's placement (SPREAD is
    best-effort) from seeing a node still busy."""
    import ray

    wait_until(lambda: leftovers() == ([], []) and _cpus_free(), timeout_s=20, interval_s=0.2)
    actors, groups = leftovers()
    assert actors == [], f"actors left alive: {actors}"
    assert groups == [], f"placement groups left: {groups}"
    assert _cpus_free(), f"resources still held: {ray.available_resources()}"
