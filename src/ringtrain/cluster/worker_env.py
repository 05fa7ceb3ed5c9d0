"""What a launcher puts into a worker's environment: torchrun's and Horovod's rank variables,
the thread counts, the GPUs a CPU worker does not see, the bootstrap of ringtrain's driver
channel (:data:`BOOTSTRAP_ENV`), and the variables that keep gloo on loopback for a run on one
machine.

The writing side of :mod:`ringtrain.cluster.env` (which reads these variables back in the worker);
it imports nothing of ringtrain, so both the launchers and ``env`` can use it.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

# The bootstrap of the ringtrain launcher (driver -> worker, before the channel exists).
ENV_DRIVER_ADDR = "RINGTRAIN_DRIVER_ADDR"  # "host:port" of the driver's report channel
ENV_AUTHKEY = "RINGTRAIN_AUTHKEY"  # hex secret of the channel
ENV_RUN_TOKEN = "RINGTRAIN_RUN_TOKEN"  # marks every process of a local group (launch/reaper.py)
ENV_RAY_NODE_ID = "RINGTRAIN_RAY_NODE_ID"  # informational: the Ray node a worker runs on
# Read for the attempt number when another launcher sets it; ours sends WorkerConfig.attempt.
ENV_ATTEMPT = "RINGTRAIN_ATTEMPT"

BOOTSTRAP_ENV = frozenset({ENV_DRIVER_ADDR, ENV_AUTHKEY, ENV_RUN_TOKEN, ENV_RAY_NODE_ID})
"""The only ``RINGTRAIN_*`` variables a launcher sets in a worker's environment: the channel's
address and secret (needed before ``Start`` can arrive), the reaper's run token (it finds a group's
processes by their environment) and, on Ray, the node id (informational). Configuration travels in
:class:`~ringtrain.wire.worker_config.WorkerConfig`."""


def worker_environment(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int,
    master_addr: str,
    master_port: int,
    threads: int,
    driver_addr: str,
    authkey_hex: str,
) -> dict[str, str]:
    """The variables the launcher sets in each worker: torchrun's, Horovod's, the thread count
    OpenMP and MKL read at start-up, and the bootstrap of ringtrain's channel (the rest of what
    the driver tells a worker comes typed in ``Start``: :mod:`ringtrain.wire.worker_config`).

    Horovod's (``HOROVOD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``, ``_CROSS_RANK``,
    ``_CROSS_SIZE``), as ``horovodrun`` sets them, for Horovod scripts and tooling: the cross
    rank of a worker is the index of its node among the nodes that have a worker with the same
    local rank, i.e. ``node_rank`` with the same number of workers on every node, and the cross
    size is the number of nodes (``world_size / local_world_size``).
    """
    num_nodes = max(1, -(-world_size // max(1, local_world_size)))
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(world_size),
        "HOROVOD_LOCAL_RANK": str(local_rank),
        "HOROVOD_LOCAL_SIZE": str(local_world_size),
        "HOROVOD_CROSS_RANK": str(node_rank),
        "HOROVOD_CROSS_SIZE": str(num_nodes),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        ENV_DRIVER_ADDR: driver_addr,
        ENV_AUTHKEY: authkey_hex,
        "PYTHONUNBUFFERED": "1",
    }


def cpu_worker_devices(use_gpu: bool, user_env: Mapping[str, str]) -> dict[str, str]:
    """``{"CUDA_VISIBLE_DEVICES": ""}`` for a CPU worker (``ScalingConfig.use_gpu=False``), so
    that it sees no GPU of the machine, as Ray does for an actor that asked for none: a library
    that picks its device by itself (``torch.cuda.is_available()``, Lightning's
    ``accelerator="auto"``) then computes on the CPU that ringtrain gave the worker, instead of on a
    GPU every CPU worker would share. ``{}`` with ``use_gpu``, or when ``user_env`` (the run's
    extra worker environment) names ``CUDA_VISIBLE_DEVICES`` itself."""
    if use_gpu or "CUDA_VISIBLE_DEVICES" in user_env:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ""}


LOOPBACK_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables that make gloo, TensorPipe and NCCL's bootstrap listen on one interface."""


def loopback_interface() -> str:
    """The name of this machine's loopback interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    for name in ("lo", "lo0", *names):
        if name in names and name.startswith("lo"):
            return name
    return "lo"


def loopback_environment() -> dict[str, str]:
    """The variables a worker of a run on this machine gets so that its communication
    libraries listen on loopback only: gloo (and TensorPipe, and NCCL's bootstrap) otherwise
    bind the interface that the host name resolves to, reachable from the network.
    A multi-node backend (Ray) must not set them."""
    name = loopback_interface()
    return {var: name for var in LOOPBACK_IFNAME_VARS}
