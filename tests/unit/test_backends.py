"""Backends as objects (ringtrain.launch.backends): the one lookup from ``ScalingConfig.backend``
to LocalBackend / RayBackend, their validation, host checks, capacity and sweep-trial
environment. Pure logic: Ray is a fake module that records what is asked of it."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ringtrain as rt
from ringtrain.launch.backends import (
    BACKENDS,
    Capacity,
    LocalBackend,
    RayBackend,
    backend_for,
    cluster_capacity,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "ringtrain"


class FakeRay:
    """The few calls of the ``ray`` module that RayBackend makes: ``is_initialized``, ``init``,
    ``cluster_resources``, ``shutdown`` and ``remote``; ``calls`` records them in order."""

    def __init__(
        self, resources: dict[str, float], *, initialized: bool = False, head: bool = True
    ) -> None:
        self.resources = resources
        self.initialized = initialized
        self.head = head
        self.calls: list[tuple[Any, ...]] = []
        self._private = SimpleNamespace(worker=SimpleNamespace(_global_node=None))

    def is_initialized(self) -> bool:
        return self.initialized

    def init(self, address: str | None = None, log_to_driver: bool = True) -> None:
        self.calls.append(("init", address, log_to_driver))
        self.initialized = True
        self._private.worker._global_node = SimpleNamespace(head=self.head)

    def cluster_resources(self) -> dict[str, float]:
        self.calls.append(("cluster_resources",))
        return dict(self.resources)

    def shutdown(self) -> None:
        self.calls.append(("shutdown",))
        self.initialized = False

    def remote(self, cls: type) -> Any:
        self.calls.append(("remote", cls.__name__))
        return SimpleNamespace(cls=cls)


CLUSTER = {
    "CPU": 8.0,
    "GPU": 2.0,
    "TPU": 1.0,
    "memory": 1e10,
    "object_store_memory": 1e9,
    "node:10.0.0.1": 1.0,
    "node:__internal_head__": 1.0,
    "accelerator_type:A100": 1.0,
}


def test_one_lookup_names_each_backend_and_refuses_unknown_ones():
    assert BACKENDS == ("local", "ray")
    local = backend_for(rt.ScalingConfig())
    ray = backend_for(rt.ScalingConfig(backend="ray"))
    assert isinstance(local, LocalBackend) and local.name == "local" and local.local_processes
    assert isinstance(ray, RayBackend) and ray.name == "ray" and not ray.local_processes
    bad = SimpleNamespace(backend="slurm")
    with pytest.raises(ValueError, match=r"must be one of 'local', 'ray', got 'slurm'"):
        backend_for(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend='local'"):
        rt.ScalingConfig(backend="slurm")


def test_no_backend_branches_left_in_the_source():
    branch = re.compile(r"\bbackend\s*(==|!=)")
    hits = [
        f"{path.relative_to(SRC)}:{n}: {line.strip()}"
        for path in sorted(SRC.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if branch.search(line)
    ]
    assert hits == [], "use backend_for(scaling) instead of comparing the string:\n" + "\n".join(
        hits
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resources_per_worker": {"TPU": 1}}, "custom Ray resources need backend='ray'"),
        ({"ray_address": "auto"}, "ray_address='auto' needs backend='ray', got backend='local'"),
        ({"placement_strategy": "SPREAD"}, "placement_strategy='SPREAD' needs backend='ray'"),
        ({"placement_strategy": "pack"}, "placement_strategy must be one of 'PACK', 'SPREAD'"),
        ({"placement_timeout_s": 0}, "placement_timeout_s must be a positive number"),
        ({"ray_address": "ray://head:10001"}, "Ray Client (ray://) is not supported"),
        ({"ray_address": ""}, "ray_address must be 'auto', 'HOST:PORT' or None"),
    ],
)
def test_local_backend_refuses_what_only_ray_honours(kwargs, message):
    with pytest.raises(ValueError) as info:
        rt.ScalingConfig(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"resources_per_worker": {"": 1}}, "unknown resource ''"),
        ({"resources_per_worker": {3: 1}}, "unknown resource 3"),
        ({"placement_strategy": "pack"}, "placement_strategy must be one of"),
        ({"placement_timeout_s": float("nan")}, "placement_timeout_s must be a positive"),
        ({"ray_address": "ray://head:10001"}, "Ray Client (ray://) is not supported"),
        ({"resources_per_worker": {"TPU": 0}}, "resources_per_worker['TPU'] must be a positive"),
    ],
)
def test_ray_backend_validation(kwargs, message):
    with pytest.raises(ValueError) as info:
        rt.ScalingConfig(backend="ray", **kwargs)
    assert message in str(info.value)


def test_ray_backend_accepts_its_own_fields():
    s = rt.ScalingConfig(
        num_workers=(2, 4),
        backend="ray",
        resources_per_worker={"CPU": 2, "TPU": 1},
        placement_strategy="STRICT_SPREAD",
        ray_address="10.0.0.1:6379",
        placement_timeout_s=5,
    )
    assert s.resources_per_worker == {"CPU": 2, "TPU": 1}
    backend_for(s).validate()
    backend_for(s).check_host()  # the cluster's GPUs are the placement group's to check
    gpu = rt.ScalingConfig(num_workers=64, use_gpu=True, backend="ray")
    backend_for(gpu).check_host()
    assert backend_for(gpu).trial_env([0, 1]) == {}  # Ray assigns a trial's GPUs


def test_local_backend_checks_this_hosts_gpus():
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    backend_for(rt.ScalingConfig(num_workers=64)).check_host()  # CPU workers: nothing to check
    with pytest.raises(ValueError, match="needs 64 CUDA devices, this machine has"):
        backend_for(rt.ScalingConfig(num_workers=64, use_gpu=True)).check_host()


def test_local_backend_capacity_and_trial_env():
    backend = backend_for(rt.ScalingConfig(num_workers=2))
    capacity = backend.capacity()
    assert capacity.where == "this machine"
    assert capacity.resources["CPU"] == float(len(os.sched_getaffinity(0)))
    assert set(capacity.resources) <= {"CPU", "GPU"}
    backend.close()  # nothing to release; idempotent
    assert backend.trial_env([1, 3]) == {"CUDA_VISIBLE_DEVICES": "1,3"}
    assert backend.trial_env([]) == {}


def test_cluster_capacity_drops_rays_bookkeeping():
    assert cluster_capacity(CLUSTER) == {"CPU": 8.0, "GPU": 2.0, "TPU": 1.0}


def test_ray_capacity_starts_ray_for_the_sweep_and_shuts_it_down(monkeypatch):
    fake = FakeRay(CLUSTER, head=True)  # no cluster found: ray.init started a head here
    monkeypatch.setitem(sys.modules, "ray", fake)
    backend = backend_for(rt.ScalingConfig(backend="ray", ray_address="auto"))
    assert backend.capacity() == Capacity({"CPU": 8.0, "GPU": 2.0, "TPU": 1.0}, "the Ray cluster")
    assert ("init", "auto", False) in fake.calls
    assert ("remote", "RayWorker") in fake.calls  # the launcher's own actor class
    backend.capacity()  # connected once
    assert [c for c in fake.calls if c[0] == "init"] == [("init", "auto", False)]
    backend.close()
    backend.close()
    assert fake.calls.count(("shutdown",)) == 1 and not fake.initialized


@pytest.mark.parametrize("initialized", [True, False])
def test_ray_capacity_leaves_a_cluster_it_did_not_start(monkeypatch, initialized):
    fake = FakeRay({"CPU": 4.0}, initialized=initialized, head=False)
    monkeypatch.setitem(sys.modules, "ray", fake)
    backend = backend_for(rt.ScalingConfig(backend="ray"))
    assert backend.capacity().resources == {"CPU": 4.0}
    backend.close()
    assert ("shutdown",) not in fake.calls and fake.initialized
    assert any(c[0] == "init" for c in fake.calls) is not initialized


def test_ray_backend_names_the_extra_when_ray_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    backend = backend_for(rt.ScalingConfig(num_workers=2, backend="ray"))
    for call in (backend.launcher, backend.capacity):
        with pytest.raises(ImportError, match=re.escape("pip install 'ringtrain[ray]'")):
            call()


def test_ray_launcher_makes_its_own_actor_class_and_groups_by_kind(monkeypatch):
    from ringtrain.launch.ray import ElasticRayWorkerGroup, RayLauncher, RayWorkerGroup
    from ringtrain.launch.ray_worker import RayWorker, remote_worker_class

    fake = FakeRay({"CPU": 1.0}, initialized=True)
    monkeypatch.setitem(sys.modules, "ray", fake)
    first, second = RayLauncher(), RayLauncher()
    first.connect()
    first.connect()
    second.connect()
    assert fake.calls == [("remote", "RayWorker")] * 2  # once per launcher, no module cache
    assert remote_worker_class(fake).cls is RayWorker
    assert RayLauncher.from_scaling_config(
        rt.ScalingConfig(backend="ray", resources_per_worker={"CPU": 2, "TPU": 1})
    ).bundle(use_gpu=True) == {"CPU": 2.0, "TPU": 1.0, "GPU": 1.0}
    growable = ("resize", "grow", "discard", "send")
    assert all(callable(getattr(ElasticRayWorkerGroup, m, None)) for m in growable)
    assert not any(hasattr(RayWorkerGroup, m) for m in ("resize", "grow", "discard"))
    assert issubclass(ElasticRayWorkerGroup, RayWorkerGroup)
