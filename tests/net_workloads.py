"""Train functions and /proc readers for tests/multiprocess/test_control_plane.py (an importable
module, so the worker processes load the functions by reference)."""

from __future__ import annotations

import ipaddress
import os
import time

import torch
import torch.distributed as dist

import ringtrain as rt
from workloads import make_dataset, make_model, report_with_checkpoint

_TCP_LISTEN = "0A"  # the state column of a listening socket (include/net/tcp_states.h)


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _decode(hex_addr: str) -> tuple[str, int]:
    host_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(host_hex)
    # /proc prints the address as 32-bit words in host byte order (little-endian here)
    swapped = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(swapped)), int(port_hex, 16)


def tcp_listeners(pid: int) -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on (IPv4 and IPv6), read
    from ``/proc/PID/net/tcp*`` and matched to the process by the socket inodes of its fds."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _TCP_LISTEN and cols[9] in inodes:
                found.append(_decode(cols[1]))
    return sorted(found)


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def listeners_fn(config):
    """Every rank reports what it listens on while its process group is up (after a
    collective, so gloo's connections are made)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    own = [f"{h}|{p}" for h, p in tcp_listeners(os.getpid())]
    dist.barrier()
    rt.report({"listeners": own, "world": t.item()})


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.05)


def steady_fn(config):
    """``steps`` deterministic SGD steps (each rank its own shard of a fixed dataset), one
    report per step. Before step ``steps // 2`` every rank waits for the file
    ``config["gate"]``, so the test can act while the run is mid-training. Rank 0 saves the
    final parameters."""
    ctx = rt.get_context()
    model = rt.prepare_model(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = make_dataset().tensors
    x, y = x[ctx.world_rank :: ctx.world_size], y[ctx.world_rank :: ctx.world_size]
    steps = int(config["steps"])
    for step in range(steps):
        if step == steps // 2:
            _wait_for(config["gate"], timeout_s=300)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        last = step == steps - 1
        report_with_checkpoint(
            {"step": step, "loss": loss.item()}, model if last and ctx.world_rank == 0 else None
        )
