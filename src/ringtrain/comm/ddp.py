"""Wrapping a module in ``DistributedDataParallel``, with ringtrain's step timing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ringtrain.env import DistributedContext
from ringtrain.monitor.timing import StepTimer, timed_allreduce_hook


def wrap_ddp(
    model: torch.nn.Module,
    ctx: DistributedContext,
    timer: StepTimer | None,
    *,
    ddp_kwargs: Mapping[str, Any] | None = None,
) -> torch.nn.Module:
    """Wrap ``model`` (already on ``ctx.device``) in DDP; the process group must be initialised.

    With step timing on, either registers a timed allreduce hook (``comm_timing="hook"``, or
    ``"auto"`` on CUDA) or records the gradient bytes so that the timer measures the step's wait
    for DDP's built-in allreduce (``"wait"``, ``"auto"`` on CPU).
    """
    device = ctx.device
    device_ids = [device.index] if device.type == "cuda" else None
    module = model
    ddp = torch.nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, **dict(ddp_kwargs or {})
    )
    if timer is not None:
        mode = timer.comm_timing
        if mode == "hook" or (mode == "auto" and device.type == "cuda"):
            # DDP's averaging allreduce, timed per bucket (launch to completion).
            ddp.register_comm_hook(None, timed_allreduce_hook(timer))
        else:
            # DDP's built-in allreduce (it averages while bucketing: no extra pass); the
            # step's wait for it after the last gradient is the exposed communication.
            timer.wait_comm_bytes = sum(
                p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
            )
    return ddp
