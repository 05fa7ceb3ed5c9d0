"""Placement of the Ray backend: the group's placement group, which leaves out the nodes whose
host does not answer (:func:`place_group`, the one function here that talks to Ray, through the
``ray`` module it is given), rank numbering from where the actors landed, and the explanation of
a placement group the cluster cannot grant."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ringtrain.launch.ray_hosts import OK, probe_many


class PlacementError(RuntimeError):
    """The cluster did not grant the workers' placement group in time."""


NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries with its id (what a bundle label selector can exclude)."""


@dataclass(frozen=True)
class Slot:
    """Where one worker of the group runs, from the actual placement.

    Attributes:
        bundle: index of its bundle (and actor) in the placement group.
        rank: world rank.
        local_rank: rank among the workers on its node.
        local_world_size: number of workers on its node.
        node_rank: index of its node (nodes numbered in order of their first bundle).
        node_id: the Ray node id.
    """

    bundle: int
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    node_id: str


def assign_ranks(node_ids: Sequence[str]) -> list[Slot]:
    """Number the workers node by node.

    Args:
        node_ids: the Ray node id of each bundle's actor, in bundle order.

    Returns:
        One :class:`Slot` per bundle, in bundle order. Bundle 0 always gets rank 0 (its actor
        hosts the rendezvous store), and the ranks of one node are consecutive, as with
        torchrun, so ``rank == node_rank * local_world_size + local_rank`` on uniform nodes.
    """
    nodes: dict[str, list[int]] = {}
    for bundle, node in enumerate(node_ids):
        nodes.setdefault(node, []).append(bundle)
    slots: list[Slot] = []
    rank = 0
    for node_rank, (node, bundles) in enumerate(nodes.items()):
        for local_rank, bundle in enumerate(bundles):
            slots.append(Slot(bundle, rank, local_rank, len(bundles), node_rank, node))
            rank += 1
    return sorted(slots, key=lambda s: s.bundle)


@dataclass(frozen=True)
class NodeResources:
    """One alive Ray node: its address and total resources (``{"CPU": 8.0, "GPU": 2.0}``)."""

    address: str
    total: Mapping[str, float]


def format_resources(resources: Mapping[str, float]) -> str:
    """``{"CPU": 1.0, "GPU": 1.0}`` as ``"CPU 1, GPU 1"``."""
    return ", ".join(f"{k} {v:g}" for k, v in sorted(resources.items())) or "nothing"


def explain_unplaceable(
    bundle: Mapping[str, float],
    count: int,
    strategy: str,
    nodes: Sequence[NodeResources],
    available: Mapping[str, float] | None = None,
) -> str:
    """Why ``count`` bundles of ``bundle`` cannot be placed with ``strategy`` on ``nodes``.

    Args:
        bundle: one worker's resources, e.g. ``{"CPU": 1.0, "GPU": 1.0}``.
        count: number of workers.
        strategy: ``PACK``, ``SPREAD``, ``STRICT_PACK`` or ``STRICT_SPREAD``.
        nodes: the cluster's alive nodes with their total resources.
        available: the cluster's currently free resources (to tell "missing" from "in use").

    Returns:
        One sentence naming the missing resources, or saying that they exist but are in use.
    """

    fmt = format_resources

    def fits(total: Mapping[str, float], times: int) -> int:
        """How many bundles fit in ``total`` (capped at ``times``)."""
        room = [
            math.floor(total.get(k, 0.0) / v + 1e-9) if v > 0 else times for k, v in bundle.items()
        ]
        return min([times, *room])

    need = {k: v * count for k, v in bundle.items()}
    have = {k: sum(n.total.get(k, 0.0) for n in nodes) for k in bundle}
    reasons = []
    missing = {k: need[k] - have[k] for k in bundle if need[k] > have[k] + 1e-9}
    if missing:
        reasons.append(
            f"missing {fmt(missing)}: {count} workers need {fmt(need)} in all, the cluster's "
            f"{len(nodes)} node(s) have {fmt(have)}"
        )
    per_node = [fits(n.total, count) for n in nodes]
    if not any(per_node):
        largest = max(nodes, key=lambda n: sum(n.total.get(k, 0.0) for k in bundle), default=None)
        reasons.append(
            f"no node can hold one worker's {fmt(bundle)}"
            + (
                f" (the largest has {fmt({k: largest.total.get(k, 0.0) for k in bundle})})"
                if largest
                else ""
            )
        )
    elif strategy == "STRICT_SPREAD" and sum(1 for f in per_node if f) < count:
        reasons.append(
            f"STRICT_SPREAD needs {count} nodes with {fmt(bundle)} each, the cluster has "
            f"{sum(1 for f in per_node if f)} (add nodes, or use placement_strategy='SPREAD')"
        )
    elif strategy == "STRICT_PACK" and max(per_node) < count:
        reasons.append(
            f"STRICT_PACK needs one node with {fmt(need)}, the best node holds only "
            f"{max(per_node)} of the {count} workers (use placement_strategy='PACK')"
        )
    elif not missing and sum(per_node) < count:
        reasons.append(
            f"the nodes can hold only {sum(per_node)} of the {count} workers of {fmt(bundle)} "
            "each (resources are split across nodes)"
        )
    if not reasons:
        free = fmt({k: (available or {}).get(k, 0.0) for k in bundle})
        reasons.append(
            f"the cluster has the resources, but they are in use by other jobs (free now: {free})"
        )
    return "; ".join(reasons)


def raylets(ray: Any) -> dict[str, tuple[str, int]]:
    """Node id -> ``(host, raylet port)`` of the nodes alive in Ray's view."""
    return {
        str(n["NodeID"]): (str(n["NodeManagerAddress"]), int(n["NodeManagerPort"]))
        for n in ray.nodes()
        if n.get("Alive") and n.get("NodeManagerAddress") and n.get("NodeManagerPort")
    }


def place_group(
    ray: Any,
    bundle: Mapping[str, float],
    count: int,
    strategy: str,
    timeout_s: float,
    created: Callable[[Any], None] = lambda pg: None,
) -> tuple[Any, dict[str, tuple[str, int]]]:
    """Create the placement group of ``count`` bundles of ``bundle`` and wait for it.

    Nodes whose host does not answer now (probed: :func:`~ringtrain.launch.ray_hosts.
    probe_many`) are left out with a bundle label selector: Ray keeps a partitioned or lost
    node alive in its view for up to a minute, and a bundle placed there would never start.

    Args:
        created: called with the placement group as soon as it exists (its owner removes it
            even if the wait then fails).

    Returns:
        The placement group, and the raylets of the alive nodes (node id -> ``(host, port)``).

    Raises:
        PlacementError: not granted within ``timeout_s``, naming what is missing and the
            nodes left out.
    """
    from ray.util.placement_group import placement_group

    nodes = raylets(ray)
    status = probe_many(nodes.values())
    avoid = sorted(node for node, where in nodes.items() if status.get(where) != OK)
    bundles = [dict(bundle)] * count
    selector = [{NODE_ID_LABEL: f"!in({','.join(avoid)})"}] * count if avoid else None
    pg = placement_group(bundles, strategy=strategy, bundle_label_selector=selector)
    created(pg)
    if pg.wait(timeout_seconds=timeout_s):  # asks the GCS; runs no task
        return pg, nodes
    known = [
        NodeResources(n.get("NodeManagerAddress", "?"), dict(n.get("Resources") or {}))
        for n in ray.nodes()
        if n.get("Alive") and str(n.get("NodeID")) not in avoid
    ]
    why = explain_unplaceable(bundle, count, strategy, known, ray.available_resources())
    if avoid:
        hosts = ", ".join(sorted(nodes[n][0] for n in avoid))
        why += f"; left out: node(s) {hosts}, whose host does not answer"
    raise PlacementError(
        f"Ray did not grant the placement group of {count} workers with "
        f"{format_resources(bundle)} each (placement_strategy={strategy!r}) within "
        f"placement_timeout_s={timeout_s:g}: {why}"
    )
