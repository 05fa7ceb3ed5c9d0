"""In-process A/B of ringtrain's step timing, for ``timing_overhead.py`` (run under torchrun).

Both ranks build two identical DDP models: one plain, one instrumented exactly as
``rt.prepare_model`` instruments it when timing is on (``instrument_model``: forward hooks, a
gradient hook per parameter, the global optimizer hooks; with ``comm=hook`` also
``timed_allreduce_hook`` as DDP's communication hook, with ``comm=wait``, the CPU default, none),
plus the prepared loader's two timer calls per step. Short blocks of steps
alternate between them (off, on, on, off, ...), so slow drift of the machine cancels out in each
pair. Rank 0 prints one JSON line: per block, the median wall time of a step and the process's
CPU time per step (all its threads: the training thread, autograd, gloo), which other processes'
load disturbs much less than wall time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workload as wl
import torch
import torch.distributed as dist

from ringtrain.monitor import timing as tm


def tiny_model() -> torch.nn.Module:
    """Same layer structure (6 parameter tensors) as the workload, 0.4% of its parameters: the
    step is mostly fixed costs, so the instrumentation's absolute cost stands out."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(wl.IN_FEATURES, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, wl.CLASSES),
    )


def main() -> None:
    model_name, pairs, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    comm = sys.argv[4] if len(sys.argv) > 4 else "wait"  # MonitorConfig.comm_timing on CPU
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    build = wl.build_model if model_name == "workload" else tiny_model
    timer = tm.StepTimer()
    plain = torch.nn.parallel.DistributedDataParallel(build())
    timed = torch.nn.parallel.DistributedDataParallel(build())
    if comm == "hook":
        timed.register_comm_hook(None, tm.timed_allreduce_hook(timer))
    else:  # what prepare_model does on CPU by default
        timer.wait_comm_bytes = sum(p.numel() * 4 for p in timed.parameters())
    tm.instrument_model(timer, timed, timed.module)  # also installs the optimizer hooks
    hooks, timer.optimizer_hooks = timer.optimizer_hooks or (), None
    for h in hooks:
        h.remove()  # re-added per "on" block below, so "off" blocks run without them
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    optimizers = {"off": wl.make_optimizer(plain), "on": wl.make_optimizer(timed)}
    models = {"off": plain, "on": timed}
    x, y = wl.make_batch(rank)
    loss_fn = torch.nn.CrossEntropyLoss()

    cpu: dict[str, list[float]] = {"off": [], "on": []}

    def run_block(mode: str, steps: int) -> float:
        on = mode == "on"
        handles = []
        if on:
            handles = [
                register_optimizer_step_pre_hook(lambda *_: timer.optimizer_start()),
                register_optimizer_step_post_hook(lambda *_: timer.optimizer_end()),
            ]
        model, opt = models[mode], optimizers[mode]
        durations = []
        cpu0 = time.process_time()
        for _ in range(steps):
            t = time.perf_counter()
            if on:
                timer.loader_fetch_start()
                timer.loader_fetch_end(len(x))
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            durations.append(time.perf_counter() - t)
        if on:
            timer.loader_exhausted()
            timer.take_window()
        cpu[mode].append((time.process_time() - cpu0) / steps)
        for h in handles:
            h.remove()
        return statistics.median(durations)

    run_block("off", block)
    run_block("on", block)
    for samples in cpu.values():
        samples.clear()  # warm-up blocks
    off, on = [], []
    for i in range(pairs):
        order = ("off", "on") if i % 2 == 0 else ("on", "off")
        result = {}
        for mode in order:
            dist.barrier()
            result[mode] = run_block(mode, block)
        off.append(result["off"])
        on.append(result["on"])
    if rank == 0:
        record = {"model": model_name, "comm": comm, "block": block, "off": off, "on": on}
        record.update(cpu_off=cpu["off"], cpu_on=cpu["on"])  # CPU s per step, all threads
        print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
