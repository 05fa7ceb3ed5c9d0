"""Train functions for tests/multiprocess/test_pool.py (loaded by reference in the workers)."""

from __future__ import annotations

import json
import os

import ringtrain as rt
import workloads


def parent_fn(config):
    """Write ``{"pid", "ppid"}`` to ``{pid_dir}/rank{R}.attempt{A}.json``, then run
    ``workloads.exact_fn``."""
    ctx = rt.get_context()
    path = os.path.join(config["pid_dir"], f"rank{ctx.world_rank}.attempt{ctx.attempt}.json")
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "ppid": os.getppid()}, f)
    workloads.exact_fn(config)
