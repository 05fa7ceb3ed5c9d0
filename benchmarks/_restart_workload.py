"""Train function and torchrun script of ``benchmarks/restart.py`` (workers import it by name).

Every rank writes the wall time of its first DDP step per attempt to
``{out}/rank{R}.attempt{A}``; on attempt 0 the last rank writes ``{out}/killed`` and SIGKILLs
itself right after that step. Run as a script (``torchrun``), it does one step and writes
``{out}/rank{R}.attempt0``.
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _step(model, opt) -> None:
    import torch

    loss = model(torch.ones(4, 8)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _write(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.time()))


def train_fn(config):
    import torch

    import ringtrain as rt

    ctx = rt.get_context()
    model = rt.prepare_model(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)
    _write(os.path.join(config["out"], f"rank{ctx.world_rank}.attempt{ctx.attempt}"))
    if config["kill"] and ctx.attempt == 0 and ctx.world_rank == ctx.world_size - 1:
        _write(os.path.join(config["out"], "killed"))
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":  # torchrun
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _write(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.attempt0"))
    dist.destroy_process_group()
