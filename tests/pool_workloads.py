"""Train functions for tests/multiprocess/test_pool.py (loaded by reference in the workers)."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed

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


def probe_fn(config):
    """Write what a worker's interpreter fixed at start-up and who forked it to
    ``{out}/{tag}.rank{R}.json``: ``{"pid", "ppid", "hash", "path"}`` (``hash("ringtrain")``
    follows the ``PYTHONHASHSEED`` its interpreter started with)."""
    ctx = rt.get_context()
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "hash": hash("ringtrain"),
        "path": sys.path,
    }
    with open(os.path.join(config["out"], f"{config['tag']}.rank{ctx.world_rank}.json"), "w") as f:
        json.dump(record, f)
    rt.report({"rank": ctx.world_rank})
    # No rank leaves before every rank's gloo mesh is up (a rank that exited while another was
    # still connecting made that one fail with "Connection closed by peer").
    torch.distributed.barrier()


def preload_fn(config):
    """Write, before importing it, whether ``preload_probe`` was in this worker's modules and
    which process imported it, to ``{out}/{tag}.rank{R}.json``:
    ``{"pid", "ppid", "probe_imported_in"}`` (``None``: not imported before the train function),
    and with ``config["cuda"]`` ``"cuda_sum"``, the sum of a small CUDA tensor's elements."""
    ctx = rt.get_context()
    probe = sys.modules.get("preload_probe")
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "probe_imported_in": getattr(probe, "IMPORTED_IN", None),
    }
    if config.get("cuda"):  # a CUDA op in this worker (GPU machines only)
        record["cuda_sum"] = float(torch.ones(3, device="cuda").mul(2).sum())
    with open(os.path.join(config["out"], f"{config['tag']}.rank{ctx.world_rank}.json"), "w") as f:
        json.dump(record, f)
    rt.report({"rank": ctx.world_rank})
    if ctx.world_size > 1:  # world size 1 runs without a process group (distributed.py)
        torch.distributed.barrier()
