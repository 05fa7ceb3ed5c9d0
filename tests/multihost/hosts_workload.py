"""The multi-host tier's training: a small exact workload (dropout, momentum SGD, the prepared
loader) that checkpoints every 2 steps and sleeps a little per step, so that a fault from outside
(a cut link, a lost host) lands mid-run. Run as a script (``ringtrain run ... hosts_workload.py
--steps N --out PATH``) or as ``train_fn(config)``. At step ``--listeners-at`` each worker writes
the TCP listeners of its own process and of its parent (the Ray actor, which hosts rank 0's
rendezvous store) to ``OUT.listeners.RANK.json``; rank 0 saves the final state to ``OUT``."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt


def _decode(hex_addr: str) -> tuple[str, int]:
    import ipaddress

    host_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(host_hex)
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(swapped)), int(port_hex, 16)


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket ``pid`` listens on, from its namespace's
    ``/proc/PID/net/tcp*`` matched by socket inode."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    found.append(_decode(cols[1]))
    return sorted(found)


def train_fn(config: dict) -> None:
    ctx = rt.get_context()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(960, 8, generator=g), torch.randn(960, 2, generator=g)
    net = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 2)
    )
    model = rt.prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=24, shuffle=True))
    state = rt.TrainState(model=model, optimizer=opt, data_loader=loader)
    state.restore()
    out = config.get("out")
    print(f"rank {ctx.world_rank} of {ctx.world_size} on {socket.gethostname()}", flush=True)
    try:
        _loop(config, ctx, model, opt, loader, state)
    except Exception as exc:
        if config.get("save_on_error"):
            _save_on_error(config, ctx, state, exc)
        raise
    if ctx.world_rank == 0 and out:
        torch.save(
            {
                "step": state.step,
                "model": getattr(model, "module", model).state_dict(),
                "optimizer": opt.state_dict(),
            },
            out,
        )


def _save_on_error(config: dict, ctx, state, exc: Exception) -> None:
    """What many training loops do when a step fails: save a checkpoint, and here, as a
    determined attacker, keep trying every second for ``config["save_on_error"]`` seconds. On a
    worker cut off by a partition, every try after the controller declared it lost must be
    refused (no split brain). The tries go to ``OUT.on_error.HOST.A<attempt>.R<rank>.json``,
    outside the run directory, rewritten after each."""
    name = f"{config['out']}.on_error.{socket.gethostname()}.A{ctx.attempt}.R{ctx.world_rank}.json"
    record = {"host": socket.gethostname(), "error": f"{type(exc).__name__}: {exc}"[:300]}
    record["tries"] = []
    deadline = time.monotonic() + float(config["save_on_error"])
    while time.monotonic() < deadline:
        started = time.time()
        try:
            rt.report({"step": state.step, "on_error": 1}, checkpoint=state)
            outcome = "saved"
        except BaseException as err:  # recorded; the caller re-raises the step's error
            outcome = f"{type(err).__name__}: {err}"[:300]
        record["tries"].append({"started": started, "outcome": outcome})
        with open(name + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(name + ".tmp", name)
        time.sleep(1.0)


def _loop(config: dict, ctx, model, opt, loader, state) -> None:
    steps, out = config["steps"], config.get("out")
    while state.step < steps:
        for xb, yb in loader:
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            state.step += 1
            time.sleep(config.get("sleep", 0.05))
            if out and state.step == config.get("listeners_at", -1):
                _write_listeners(out, ctx.world_rank)
            every = config.get("every", 2)
            rt.report(
                {"loss": loss.item(), "step": state.step},
                checkpoint=state if state.step % every == 0 else None,
            )
            if state.step >= steps:
                break


def _write_listeners(out: str, rank: int) -> None:
    record = {
        "host": socket.gethostname(),
        "master": [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])],
        "driver": os.environ["RINGTRAIN_DRIVER_ADDR"],
        "worker": tcp_listeners(os.getpid()),
        "actor": tcp_listeners(os.getppid()),
    }
    with open(f"{out}.listeners.{rank}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=2)
    parser.add_argument("--listeners-at", type=int, default=-1)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    train_fn(
        {
            "steps": args.steps,
            "sleep": args.sleep,
            "every": args.every,
            "listeners_at": args.listeners_at,
            "out": args.out,
        }
    )
