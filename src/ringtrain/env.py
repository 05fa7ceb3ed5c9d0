"""Where rank information comes from.

This is the only module that reads the distributed environment variables. ringtrain's local launcher
sets the same variables torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) plus a few ``RINGTRAIN_*``
ones for its driver channel, so a worker it starts, a process started by torchrun and one started by
SLURM's ``srun`` are all described by one :class:`DistributedContext`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# Variables of the ringtrain launcher contract (driver -> worker).
ENV_DRIVER_ADDR = "RINGTRAIN_DRIVER_ADDR"  # "host:port" of the driver's report channel
ENV_AUTHKEY = "RINGTRAIN_AUTHKEY"  # hex secret of the channel
ENV_RUN_DIR = "RINGTRAIN_RUN_DIR"  # the run directory (path or fsspec URL)
ENV_ATTEMPT = "RINGTRAIN_ATTEMPT"  # 0 on the first attempt
ENV_USE_GPU = "RINGTRAIN_USE_GPU"  # "1" when workers drive one CUDA device each
ENV_START_ROUND = "RINGTRAIN_START_ROUND"  # first report round of this attempt
ENV_THREADS = "RINGTRAIN_NUM_THREADS"
ENV_WORKER_TIMEOUT = "RINGTRAIN_WORKER_TIMEOUT_S"  # FailureConfig.worker_timeout_s ("" = none)
ENV_ASYNC_CHECKPOINT = "RINGTRAIN_ASYNC_CHECKPOINT"  # "1": TrainState saves in the background
ENV_TIMING = "RINGTRAIN_TIMING_INTERVAL_S"  # step timing window in seconds ("" or unset = off)
ENV_COMM_TIMING = "RINGTRAIN_COMM_TIMING"  # MonitorConfig.comm_timing
ENV_MAX_STEPS = "RINGTRAIN_MAX_STEPS"  # stop cleanly after this many steps (`ringtrain bench`)
ENV_ELASTIC = "RINGTRAIN_ELASTIC"  # "min,max,snapshot_interval_steps" (elastic runs only)
ENV_ELASTIC_BATCH = "RINGTRAIN_ELASTIC_BATCH"  # ScalingConfig.elastic_batch_policy (elastic)


@dataclass(frozen=True)
class DistributedContext:
    """Everything a worker knows about its place in the job.

    Attributes:
        world_rank: this worker's rank in ``[0, world_size)``.
        world_size: number of workers.
        local_rank: rank among the workers on this node; selects the CUDA device.
        local_world_size: number of workers on this node.
        node_rank: index of this node.
        master_addr: host of rank 0's rendezvous store.
        master_port: port of rank 0's rendezvous store.
        use_gpu: whether this worker drives ``cuda:{local_rank}``.
        attempt: 0 on the first attempt; incremented each time the group is restarted.
        run_dir: the run directory (path or fsspec URL), or ``None`` outside a ringtrain run.
        source: where the information came from: ``"ringtrain"``, ``"torchrun"``, ``"slurm"``,
            or ``"single"`` (no distributed environment: a single process).
    """

    world_rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    use_gpu: bool = False
    attempt: int = 0
    run_dir: str | None = None
    source: str = "single"
    extra: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def worker_timeout_s(self) -> float | None:
        """``FailureConfig.worker_timeout_s`` of the run (None: no hang detection)."""
        text = self.extra.get(ENV_WORKER_TIMEOUT, "")
        return float(text) if text else None

    @property
    def device(self) -> Any:
        """The ``torch.device`` this worker computes on."""
        import torch

        if self.use_gpu:
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    # Ray Train's ``TrainContext`` method names (ray.train.get_context()), beside the attributes
    # above, so that ported code runs unchanged; see docs/ray.md for the ones left out.

    def get_world_size(self) -> int:
        """``world_size`` (Ray Train's name)."""
        return self.world_size

    def get_world_rank(self) -> int:
        """``world_rank`` (Ray Train's name)."""
        return self.world_rank

    def get_local_rank(self) -> int:
        """``local_rank`` (Ray Train's name)."""
        return self.local_rank

    def get_local_world_size(self) -> int:
        """``local_world_size`` (Ray Train's name)."""
        return self.local_world_size

    def get_node_rank(self) -> int:
        """``node_rank`` (Ray Train's name)."""
        return self.node_rank

    def get_experiment_name(self) -> str:
        """The run's name (``RunConfig.name``: the last part of ``run_dir``); ``""`` outside a
        ringtrain run."""
        if not self.run_dir:
            return ""
        return self.run_dir.rstrip("/").rsplit("/", 1)[-1]

    def get_trial_name(self) -> str:
        """The run's name, as :meth:`get_experiment_name` (a Tuner trial is one run)."""
        return self.get_experiment_name()

    def get_trial_dir(self) -> str:
        """The run directory (path or fsspec URL); ``""`` outside a ringtrain run."""
        return self.run_dir or ""

    def get_storage(self) -> Any:
        """Not available: Ray's ``StorageContext`` has no counterpart.

        Raises:
            NotImplementedError: always; use ``run_dir`` (the run directory) and
                ``report(metrics, checkpoint=...)`` to persist files.
        """
        raise NotImplementedError(
            "get_context().get_storage(): ringtrain has no Ray StorageContext; use "
            "get_context().run_dir (the run directory) and report(..., checkpoint=...) to "
            "persist files"
        )


def _int(environ: Mapping[str, str], *names: str, default: int | None = None) -> int:
    for name in names:
        value = environ.get(name)
        if value not in (None, ""):
            try:
                return int(value)
            except ValueError as exc:
                raise ValueError(
                    f"environment variable {name}={value!r} is not an integer"
                ) from exc
    if default is None:
        raise KeyError(f"none of the environment variables {', '.join(names)} is set")
    return default


def detect_source(environ: Mapping[str, str] | None = None) -> str:
    """Which launcher started this process: ringtrain, torchrun, slurm, or single."""
    env = os.environ if environ is None else environ
    if env.get(ENV_DRIVER_ADDR):
        return "ringtrain"
    if env.get("RANK") and env.get("WORLD_SIZE"):
        return "torchrun"
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS") and int(env["SLURM_NTASKS"]) > 1:
        return "slurm"
    return "single"


def context_from_env(environ: Mapping[str, str] | None = None) -> DistributedContext:
    """Build the context of this process from its environment.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        The context; ``source == "single"`` and ``world_size == 1`` when no launcher is detected.

    Raises:
        ValueError: if a variable is malformed or ranks are out of range.
    """
    env = os.environ if environ is None else environ
    source = detect_source(env)
    if source == "single":
        return DistributedContext(use_gpu=env.get(ENV_USE_GPU) == "1")
    if source == "slurm":
        world_size = _int(env, "SLURM_NTASKS")
        rank = _int(env, "SLURM_PROCID")
        local_rank = _int(env, "SLURM_LOCALID", default=0)
        local_world_size = _int(env, "SLURM_NTASKS_PER_NODE", default=0) or max(
            1, world_size // _int(env, "SLURM_NNODES", default=1)
        )
        node_rank = _int(env, "SLURM_NODEID", default=0)
        master_addr = env.get("MASTER_ADDR") or _first_slurm_host(env.get("SLURM_NODELIST", ""))
        master_port = _int(env, "MASTER_PORT", default=29500)
    else:
        world_size = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_rank = _int(env, "LOCAL_RANK", default=0)
        local_world_size = _int(env, "LOCAL_WORLD_SIZE", default=world_size)
        node_rank = _int(env, "GROUP_RANK", "NODE_RANK", default=0)
        master_addr = env.get("MASTER_ADDR", "127.0.0.1")
        master_port = _int(env, "MASTER_PORT", default=29500)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(
            f"local rank {local_rank} is outside [0, local_world_size={local_world_size})"
        )
    use_gpu = env.get(ENV_USE_GPU) == "1" if ENV_USE_GPU in env else _cuda_requested(env)
    return DistributedContext(
        world_rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=master_port,
        use_gpu=use_gpu,
        attempt=_int(env, ENV_ATTEMPT, "TORCHELASTIC_RESTART_COUNT", default=0),
        run_dir=env.get(ENV_RUN_DIR) or None,
        source=source,
        extra={
            k: env[k]
            for k in (
                ENV_DRIVER_ADDR,
                ENV_AUTHKEY,
                ENV_START_ROUND,
                ENV_WORKER_TIMEOUT,
                ENV_ASYNC_CHECKPOINT,
                ENV_TIMING,
                ENV_COMM_TIMING,
                ENV_MAX_STEPS,
                ENV_ELASTIC,
                ENV_ELASTIC_BATCH,
            )
            if k in env
        },
    )


def _cuda_requested(env: Mapping[str, str]) -> bool:
    # Under torchrun/SLURM nobody tells us; use the GPU when this process can see one.
    if env.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist such as ``node[01-04,07]`` or ``a1,a2``."""
    if not nodelist:
        return "127.0.0.1"
    head = nodelist.split(",")[0]
    if "[" in nodelist:
        prefix, _, rest = nodelist.partition("[")
        first = rest.split(",")[0].split("-")[0].rstrip("]")
        return prefix + first
    return head


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
    use_gpu: bool,
    attempt: int,
    run_dir: str,
    driver_addr: str,
    authkey_hex: str,
    start_round: int,
) -> dict[str, str]:
    """The variables the launcher sets in each worker: torchrun's, Horovod's, plus ringtrain's
    channel.

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
        ENV_THREADS: str(threads),
        ENV_USE_GPU: "1" if use_gpu else "0",
        ENV_ATTEMPT: str(attempt),
        ENV_RUN_DIR: run_dir,
        ENV_DRIVER_ADDR: driver_addr,
        ENV_AUTHKEY: authkey_hex,
        ENV_START_ROUND: str(start_round),
        "PYTHONUNBUFFERED": "1",
    }


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
