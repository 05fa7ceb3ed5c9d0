"""The train function of ``benchmarks/recovery.py`` (one importable module, so that the workers load
it by reference, as they would a user's module).

The worker bootstrap imports torch before it unpickles the train function; unpickling imports this
module, so ``T_IMPORT`` below is the moment the worker finished starting Python, importing
ringtrain and torch and talking to the driver, and before the process group is initialised.

Two workloads:

* ``small``: the overhead benchmark's MLP 784-1024-1024-10 (``_workload.build_model``), batches of
  64 synthetic samples per worker from a 2,048-sample dataset (16 steps per epoch per worker);
* ``large``: ``layers`` x ``nn.Linear(width, width)`` with ReLU between (6 x 4096: 100,687,872
  parameters, 403 MB of fp32), batches of ``batch`` samples per worker, MSE loss.

Both: SGD with momentum, ``rt.prepare_model`` (DDP), ``rt.prepare_data_loader``, one
``rt.TrainState`` (model, optimizer, data loader) restored at start and reported with
``rt.report(..., checkpoint=state)`` every ``every`` steps (the last report, after step ``steps``,
carries no checkpoint). On attempt 0, rank ``kill_rank`` SIGKILLs itself right after step
``kill_step`` (after writing ``time.time()`` to ``{out}/kill.json``); with ``wait_published`` it
first waits, without training, until the checkpoint it last reported is published.

Each rank writes its time stamps to ``{out}/a{attempt}_r{rank}.json`` (also when it fails).
"""

from __future__ import annotations

import time

T_IMPORT = time.time()

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from typing import Any  # noqa: E402

import _workload as wl  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ringtrain as rt  # noqa: E402


def build(config: dict[str, Any]) -> tuple[nn.Module, TensorDataset, nn.Module, float]:
    """(model, dataset, loss function, learning rate) of ``config["model"]``."""
    g = torch.Generator().manual_seed(wl.DATA_SEED)
    if config["model"] == "small":
        model = wl.build_model()
        n = config.get("samples", 2048)
        x = torch.randn(n, wl.IN_FEATURES, generator=g)
        y = torch.randint(0, wl.CLASSES, (n,), generator=g)
        return model, TensorDataset(x, y), nn.CrossEntropyLoss(), wl.LR
    width, layers = config["width"], config["layers"]
    torch.manual_seed(wl.MODEL_SEED)
    modules: list[nn.Module] = []
    for i in range(layers):
        modules.append(nn.Linear(width, width))
        if i < layers - 1:
            modules.append(nn.ReLU())
    n = config["samples"]
    x = torch.randn(n, width, generator=g)
    y = torch.randn(n, width, generator=g)
    return nn.Sequential(*modules), TensorDataset(x, y), nn.MSELoss(), 1e-4


def proc_start_time() -> float | None:
    """Wall-clock time this process was created (10 ms resolution), else None.

    ``/proc/self/stat`` gives the start in clock ticks since boot (``CLOCK_BOOTTIME``); converting
    it through ``/proc/stat``'s ``btime`` (whole seconds, adjusted by NTP) can be off by up to a
    second, so it is converted against the boot clock read now instead."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_s = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5)
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - start_s)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _published(run_dir: str | None) -> list[str]:
    if not run_dir or not os.path.isdir(run_dir):
        return []
    return sorted(n for n in os.listdir(run_dir) if n.startswith("checkpoint_"))


def _write_json(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def _kill_self(
    config: dict[str, Any], run_dir: str | None, step: int, ckpt_round: int | None
) -> None:
    """SIGKILL this process, after writing ``{out}/kill.json``. With ``wait_published``, first
    wait (without training) until the checkpoint of the last ``report(checkpoint=...)`` is
    published, so that the kill never lands while a rank still writes it in the background."""
    waited = 0.0
    if config.get("wait_published") and ckpt_round is not None and run_dir:
        target = os.path.join(run_dir, f"checkpoint_{ckpt_round:06d}")
        start = time.monotonic()
        while not os.path.isdir(target) and time.monotonic() - start < 120:
            time.sleep(0.02)
        waited = time.monotonic() - start
    kill = {"step": step, "published": _published(run_dir), "waited_for_publish_s": waited}
    kill["t_kill"] = time.time()
    _write_json(os.path.join(config["out"], "kill.json"), kill)
    os.kill(os.getpid(), signal.SIGKILL)


def train_fn(config: dict[str, Any]) -> None:
    t_entry = time.time()  # the bootstrap initialised the process group before calling us
    ctx = rt.get_context()
    rank, attempt = ctx.world_rank, ctx.attempt
    kill_step = (
        config.get("kill_step") if attempt == 0 and rank == config.get("kill_rank", 1) else None
    )
    record: dict[str, Any] = {
        "rank": rank,
        "attempt": attempt,
        "proc_start": proc_start_time(),
        "t_import": T_IMPORT,
        "t_entry": t_entry,
        "threads": torch.get_num_threads(),
    }
    out = os.path.join(config["out"], f"a{attempt}_r{rank}.json")
    steps: list[list[float]] = []  # [step, wall start, wall end, duration]
    reports: list[list[Any]] = []  # [step, with checkpoint, duration, wall start, wall end]
    record["steps"] = steps
    record["reports"] = reports
    try:
        net, dataset, loss_fn, lr = build(config)
        record["parameters"] = sum(p.numel() for p in net.parameters())
        record["t_built"] = time.time()
        model = rt.prepare_model(net)
        record["t_model"] = time.time()
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        loader = rt.prepare_data_loader(
            DataLoader(dataset, batch_size=config["batch"], shuffle=True)
        )
        state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
        record["restored"] = state.restore()
        record["restored_step"] = state.step
        record["t_restored"] = time.time()
        total, every = config["steps"], config["every"]
        record["first_step_wall"] = None
        # Report rounds of this attempt (attempt 0 starts at round 0; only it kills).
        next_round, last_ckpt_round = 0, None
        num_epochs = math.ceil(total / len(loader)) + 1
        for _epoch in state.epochs(num_epochs):
            for x, y in loader:
                w0 = time.time()
                p0 = time.perf_counter()
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                optimizer.step()
                state.step += 1
                duration = time.perf_counter() - p0
                w1 = time.time()
                steps.append([state.step, w0, w1, duration])
                if record["first_step_wall"] is None:
                    record["first_step_wall"] = w1
                if state.step == kill_step:
                    _kill_self(config, ctx.run_dir, state.step, last_ckpt_round)
                with_ckpt = state.step % every == 0 and state.step < total
                if with_ckpt or state.step == total:
                    metrics = {"step": state.step, "loss": loss.item()}
                    w0 = time.time()
                    p0 = time.perf_counter()
                    rt.report(metrics, checkpoint=state if with_ckpt else None)
                    duration = time.perf_counter() - p0
                    reports.append([state.step, with_ckpt, duration, w0, time.time()])
                    if with_ckpt:
                        last_ckpt_round = next_round
                    next_round += 1
                if state.step >= total:
                    break
            if state.step >= total:
                break
        record["t_end"] = time.time()
    finally:
        _write_json(out, record)
