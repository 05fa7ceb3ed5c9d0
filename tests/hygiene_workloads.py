"""Train functions for tests/multiprocess/test_process_hygiene.py (loaded by reference in the
workers).

``loader_fn`` iterates a ``DataLoader(num_workers=2)`` prepared by ringtrain and, once its loader
workers exist, writes ``{"pid", "loaders", "mp_temp", "mp_temp_files"}`` (its multiprocessing
temp dir and what is in it) to ``{pid_dir}/rank{R}.attempt{A}.json``; then by
``config["mode"]``: ``"hang"`` loops until it is stopped, ``"finish"`` returns after a few batches,
``"error"`` raises on rank 0, ``"kill_worker"`` SIGKILLs rank 1 in the first attempt (and the
second attempt finishes). Rank 0 of the first attempt also starts ``sleep 600`` in a session of
its own (``"escaped"``): a process that left the worker's process group.
"""

from __future__ import annotations

import json
import multiprocessing.util
import os
import signal
import subprocess
import time

import torch
from torch.utils.data import DataLoader, Dataset

import ringtrain as rt
from support import child_pids


class Slow(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i))


def loader_fn(config):
    ctx = rt.get_context()
    mode = config["mode"]
    loader = rt.prepare_data_loader(
        DataLoader(Slow(), batch_size=2, num_workers=2, persistent_workers=True)
    )
    written = False
    batches = 0
    while True:
        for _ in loader:
            batches += 1
            if not written:
                record = {
                    "pid": os.getpid(),
                    "loaders": sorted(child_pids(os.getpid())),
                    # Where this worker's loader workers put their sockets (launch/reaper.py):
                    # a batch has come through, so the listener of one is in it already.
                    "mp_temp": multiprocessing.util.get_temp_dir(),
                    "mp_temp_files": sorted(os.listdir(multiprocessing.util.get_temp_dir())),
                }
                if ctx.world_rank == 0 and ctx.attempt == 0:
                    # A child that leaves the worker's process group (its own session): only
                    # the run token in its environment can find it.
                    escaped = subprocess.Popen(["sleep", "600"], start_new_session=True)
                    record["escaped"] = escaped.pid
                path = os.path.join(config["pid_dir"], f"rank{ctx.world_rank}.attempt{ctx.attempt}")
                with open(path + ".tmp", "w") as f:
                    json.dump(record, f)
                os.replace(path + ".tmp", path + ".json")
                written = True
                if mode == "error" and ctx.world_rank == 0:
                    raise RuntimeError("the train function failed on purpose")
                if mode == "kill_worker" and ctx.world_rank == 1 and ctx.attempt == 0:
                    time.sleep(0.5)  # the test's watcher sees the file first
                    os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.02)
            if batches >= 20 and (mode == "finish" or (mode == "kill_worker" and ctx.attempt > 0)):
                return


def _waiting_for_the_test(release: str) -> None:
    while not os.path.exists(release):
        time.sleep(0.05)


def stack_dump_fn(config):
    """Write this worker's pid to ``{dir}/rank{R}.pid``, then wait (in ``_waiting_for_the_test``,
    the frame a stack dump must show) until ``{dir}/release`` exists."""
    ctx = rt.get_context()
    path = os.path.join(config["dir"], f"rank{ctx.world_rank}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    _waiting_for_the_test(os.path.join(config["dir"], "release"))
