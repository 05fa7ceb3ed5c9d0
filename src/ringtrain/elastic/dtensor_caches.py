"""DTensor's per-process caches, which must not outlive an elastic group generation."""

from __future__ import annotations

import torch


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions and redistribution plans (this thread's: the
    train function's, which :func:`ringtrain.elastic.worker.run_elastic`
    calls).
    They are keyed by ``DeviceMesh`` equality (layout and dimension names, not process groups),
    so after an elastic group re-forms, a new mesh equal to one of an earlier generation
    (growing back to the same size) would get DTensors on the old mesh, whose process groups
    are destroyed, back from them."""
    import sys

    if "torch.distributed.tensor" not in sys.modules:
        return  # no DTensor was ever made in this process
    from torch.distributed.tensor import DTensor, _redistribute

    caches = (
        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding,
        getattr(_redistribute, "_gen_transform_infos", None),
    )
    for cache in caches:
        clear = getattr(cache, "cache_clear", None)
        if callable(clear):
            clear()
    planners = getattr(_redistribute, "_planner_cache", None)
    if isinstance(planners, dict):
        planners.clear()
    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if callable(native):  # the C++ dispatch fast path's own cache (torch >= 2.9)
        native()
