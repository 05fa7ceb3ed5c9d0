"""The Ray backend's pure logic, without Ray running: rank assignment node by node, why a
placement cannot be satisfied, ScalingConfig's Ray fields (the cluster tests:
tests/backends/test_ray.py)."""

from __future__ import annotations

import pytest

import ringtrain as rt
from ringtrain.launch.ray import NodeResources, assign_ranks, explain_unplaceable


def test_assign_ranks_numbers_node_by_node():
    slots = assign_ranks(["b", "a", "b", "a", "c"])
    assert [(s.rank, s.node_rank, s.local_rank, s.local_world_size) for s in slots] == [
        (0, 0, 0, 2),
        (2, 1, 0, 2),
        (1, 0, 1, 2),
        (3, 1, 1, 2),
        (4, 2, 0, 1),
    ]


def test_explain_unplaceable_names_the_gap():
    two = [NodeResources("10.0.0.1", {"CPU": 8, "GPU": 2}), NodeResources("10.0.0.2", {"CPU": 8})]
    gpu = {"CPU": 1.0, "GPU": 1.0}
    assert "missing GPU 2: 4 workers need CPU 4, GPU 4 in all" in explain_unplaceable(
        gpu, 4, "PACK", two
    )
    assert "STRICT_PACK needs one node with CPU 10" in explain_unplaceable(
        {"CPU": 5.0}, 2, "STRICT_PACK", two
    )
    assert "can hold only 2 of the 3 workers" in explain_unplaceable({"CPU": 5.0}, 3, "SPREAD", two)
    assert "in use by other jobs (free now: CPU 0)" in explain_unplaceable(
        {"CPU": 1.0}, 2, "PACK", two, {"CPU": 0.0}
    )


def test_config_validation():
    with pytest.raises(ValueError, match="placement_strategy must be one of"):
        rt.ScalingConfig(backend="ray", placement_strategy="pack")
    with pytest.raises(ValueError, match="Ray Client"):
        rt.ScalingConfig(backend="ray", ray_address="ray://head:10001")
    with pytest.raises(ValueError, match="needs backend='ray'"):
        rt.ScalingConfig(ray_address="auto")
    with pytest.raises(ValueError, match="placement_timeout_s must be a positive"):
        rt.ScalingConfig(backend="ray", placement_timeout_s=0)
    with pytest.raises(ValueError, match="custom Ray resources need backend='ray'"):
        rt.ScalingConfig(resources_per_worker={"TPU": 1})
    assert rt.ScalingConfig(backend="ray", resources_per_worker={"TPU": 1}).backend == "ray"
