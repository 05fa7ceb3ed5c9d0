"""A worker's memory readings, sent with every timing window (:mod:`ringtrain.monitor.timing`):
resident memory, and on CUDA the caching allocator's figures and the GPU's utilisation."""

from __future__ import annotations

import os
import sys
from typing import Any

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)  # peak, not current


def memory_stats() -> dict[str, Any]:
    """``rss_bytes`` (resident memory of this process), and on a worker that uses CUDA
    ``gpu_allocated_bytes``, ``gpu_peak_bytes`` (``torch.cuda`` caching allocator, this device)
    and ``gpu_util`` (percent, when NVML is available); the GPU fields are ``None`` otherwise."""
    stats: dict[str, Any] = {
        "rss_bytes": _rss_bytes(),
        "gpu_allocated_bytes": None,
        "gpu_peak_bytes": None,
        "gpu_util": None,
    }
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        stats["gpu_allocated_bytes"] = int(torch.cuda.memory_allocated())
        stats["gpu_peak_bytes"] = int(torch.cuda.max_memory_allocated())
        try:
            stats["gpu_util"] = float(torch.cuda.utilization())
        except Exception:  # no NVML (pynvml) on this machine
            pass
    return stats
