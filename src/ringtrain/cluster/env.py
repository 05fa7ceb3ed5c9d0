"""Where rank information comes from: one class per cluster environment.

This is the only module that reads the distributed environment variables. Each launcher that can
start a worker is one :class:`ClusterEnvironment` (as Lightning Fabric's ``ClusterEnvironment``):
:class:`RingtrainEnvironment` (our own launcher), :class:`TorchrunEnvironment`,
:class:`SlurmEnvironment` and :class:`SingleProcessEnvironment` (no launcher: one process). Each
says whether it started this process (``detect()``) and builds the :class:`DistributedContext`
(``context()``); :data:`ENVIRONMENTS` is the order they are asked in.

ringtrain's local launcher sets the same variables torchrun sets (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), Horovod's,
and the bootstrap of its driver channel (:data:`BOOTSTRAP_ENV`). Everything else the driver tells a
worker travels typed, as a :class:`~ringtrain.wire.worker_config.WorkerConfig` inside the channel's
authenticated ``Start`` message, which the worker puts into its context
(:meth:`DistributedContext.with_config`).

Why the bootstrap stays in the environment: a worker must know where the driver listens and the
secret that authenticates it before it can receive anything over the channel, and a variable is how
a parent hands both to a child it starts (a command line would show the secret in ``ps``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ringtrain.cluster.worker_env import (
    BOOTSTRAP_ENV,
    ENV_ATTEMPT,
    ENV_AUTHKEY,
    ENV_DRIVER_ADDR,
    ENV_RAY_NODE_ID,
    ENV_RUN_TOKEN,
    LOOPBACK_IFNAME_VARS,
    loopback_environment,
    loopback_interface,
    worker_environment,
)
from ringtrain.wire.worker_config import WorkerConfig

__all__ = [
    "BOOTSTRAP_ENV",
    "ENVIRONMENTS",
    "ENV_ATTEMPT",
    "ENV_AUTHKEY",
    "ENV_DRIVER_ADDR",
    "ENV_RAY_NODE_ID",
    "ENV_RUN_TOKEN",
    "LOOPBACK_IFNAME_VARS",
    "ClusterEnvironment",
    "DistributedContext",
    "RingtrainEnvironment",
    "SingleProcessEnvironment",
    "SlurmEnvironment",
    "TorchrunEnvironment",
    "context_from_env",
    "detect_environment",
    "detect_source",
    "loopback_environment",
    "loopback_interface",
    "worker_environment",
]


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
        config: what the driver told this worker
        (:class:`~ringtrain.wire.worker_config.WorkerConfig`;
            the defaults outside a ringtrain-launched worker).
        mesh: this worker's ``torch.distributed.DeviceMesh`` (a property, built on first use):
            dimensions ``("pp", "dp_replicate", "dp_shard", "tp")`` sized by
            ``ScalingConfig.parallel``; without one, ``dp_shard`` is the world size and the
            others 1 (:mod:`ringtrain.cluster.mesh`).
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
    config: WorkerConfig = field(default_factory=WorkerConfig, repr=False)
    _cache: dict[str, Any] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def with_config(self, config: WorkerConfig) -> DistributedContext:
        """This context with the driver's ``config`` (from ``Start``): its ``use_gpu``,
        ``attempt`` and ``run_dir`` become the context's."""
        return dataclasses.replace(
            self,
            use_gpu=config.use_gpu,
            attempt=config.attempt,
            run_dir=config.run_dir,
            config=config,
        )

    def __getstate__(self) -> dict[str, Any]:
        # The cached mesh holds process groups of this process: never pickled with the context.
        return {**self.__dict__, "_cache": {}}

    @property
    def mesh(self) -> Any:
        """This worker's ``DeviceMesh`` over the default process group (initialised here if it
        is not yet), built on first use by every rank: a collective, so call it on all ranks.
        See :func:`ringtrain.cluster.mesh.context_mesh`."""
        from ringtrain.cluster.mesh import context_mesh

        return context_mesh(self, self._cache)

    @property
    def worker_timeout_s(self) -> float | None:
        """``FailureConfig.worker_timeout_s`` of the run (None: no hang detection)."""
        return self.config.worker_timeout_s

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


class ClusterEnvironment:
    """One way a process can be started as a rank of a job (a launcher's variables).

    Subclasses set :attr:`source` and implement :meth:`detect` and the rank methods;
    :meth:`context` assembles and checks them.

    Args:
        environ: the environment to read (default ``os.environ``).
    """

    source: ClassVar[str] = "single"

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.environ: Mapping[str, str] = os.environ if environ is None else environ

    def detect(self) -> bool:
        """Whether this environment started the process."""
        raise NotImplementedError

    def world_size(self) -> int:
        return 1

    def world_rank(self) -> int:
        return 0

    def local_rank(self) -> int:
        return 0

    def local_world_size(self) -> int:
        return 1

    def node_rank(self) -> int:
        return 0

    def master_addr(self) -> str:
        return self.environ.get("MASTER_ADDR") or "127.0.0.1"

    def master_port(self) -> int:
        return _int(self.environ, "MASTER_PORT", default=29500)

    def use_gpu(self) -> bool:
        """Under torchrun/SLURM nobody tells us: use the GPU when this process can see one."""
        return _cuda_requested(self.environ)

    def attempt(self) -> int:
        return _int(self.environ, ENV_ATTEMPT, "TORCHELASTIC_RESTART_COUNT", default=0)

    def context(self) -> DistributedContext:
        """The context of this process.

        Raises:
            ValueError: if a variable is malformed or ranks are out of range.
            KeyError: if a variable this environment needs is missing.
        """
        rank, world_size = self.world_rank(), self.world_size()
        local_rank, local_world_size = self.local_rank(), self.local_world_size()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        if not 0 <= local_rank < local_world_size:
            raise ValueError(
                f"local rank {local_rank} is outside [0, local_world_size={local_world_size})"
            )
        return DistributedContext(
            world_rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=self.node_rank(),
            master_addr=self.master_addr(),
            master_port=self.master_port(),
            use_gpu=self.use_gpu(),
            attempt=self.attempt(),
            source=self.source,
        )


class TorchrunEnvironment(ClusterEnvironment):
    """Started by ``torchrun`` (or anything that sets ``RANK`` and ``WORLD_SIZE``)."""

    source: ClassVar[str] = "torchrun"

    def detect(self) -> bool:
        return bool(self.environ.get("RANK") and self.environ.get("WORLD_SIZE"))

    def world_size(self) -> int:
        return _int(self.environ, "WORLD_SIZE")

    def world_rank(self) -> int:
        return _int(self.environ, "RANK")

    def local_rank(self) -> int:
        return _int(self.environ, "LOCAL_RANK", default=0)

    def local_world_size(self) -> int:
        return _int(self.environ, "LOCAL_WORLD_SIZE", default=self.world_size())

    def node_rank(self) -> int:
        return _int(self.environ, "GROUP_RANK", "NODE_RANK", default=0)


class RingtrainEnvironment(TorchrunEnvironment):
    """Started by ringtrain's launcher: torchrun's variables plus the driver channel's bootstrap
    (:data:`BOOTSTRAP_ENV`). The device, attempt and run directory come with the driver's
    ``WorkerConfig`` in ``Start`` (:meth:`DistributedContext.with_config`); until then the
    context says CPU."""

    source: ClassVar[str] = "ringtrain"

    def detect(self) -> bool:
        return bool(self.environ.get(ENV_DRIVER_ADDR))

    def use_gpu(self) -> bool:
        return False

    def driver_address(self) -> str:
        """``host:port`` of the driver's channel."""
        return self.environ[ENV_DRIVER_ADDR]

    def authkey(self) -> bytes:
        """The channel's secret.

        Raises:
            KeyError: if the launcher did not set it.
        """
        return bytes.fromhex(self.environ[ENV_AUTHKEY])


class SlurmEnvironment(ClusterEnvironment):
    """Started by SLURM's ``srun`` with more than one task."""

    source: ClassVar[str] = "slurm"

    def detect(self) -> bool:
        env = self.environ
        return bool(
            env.get("SLURM_PROCID")
            and env.get("SLURM_NTASKS")
            and _int(env, "SLURM_NTASKS", default=1) > 1
        )

    def world_size(self) -> int:
        return _int(self.environ, "SLURM_NTASKS")

    def world_rank(self) -> int:
        return _int(self.environ, "SLURM_PROCID")

    def local_rank(self) -> int:
        return _int(self.environ, "SLURM_LOCALID", default=0)

    def local_world_size(self) -> int:
        env = self.environ
        return _int(env, "SLURM_NTASKS_PER_NODE", default=0) or max(
            1, self.world_size() // _int(env, "SLURM_NNODES", default=1)
        )

    def node_rank(self) -> int:
        return _int(self.environ, "SLURM_NODEID", default=0)

    def master_addr(self) -> str:
        return self.environ.get("MASTER_ADDR") or _first_slurm_host(
            self.environ.get("SLURM_NODELIST", "")
        )


class SingleProcessEnvironment(ClusterEnvironment):
    """No launcher: one process, world size 1, on the CPU (a plain ``python`` run)."""

    source: ClassVar[str] = "single"

    def detect(self) -> bool:
        return True

    def context(self) -> DistributedContext:
        return DistributedContext()


ENVIRONMENTS: tuple[type[ClusterEnvironment], ...] = (
    RingtrainEnvironment,
    TorchrunEnvironment,
    SlurmEnvironment,
    SingleProcessEnvironment,
)
"""The cluster environments in the order they are asked: the first whose ``detect()`` is true
describes the process (ringtrain's launcher also sets torchrun's variables, so it comes first;
a single process is the fallback)."""


def detect_environment(environ: Mapping[str, str] | None = None) -> ClusterEnvironment:
    """The :class:`ClusterEnvironment` that started this process (the first of
    :data:`ENVIRONMENTS` that detects itself in ``environ``, default ``os.environ``)."""
    for cls in ENVIRONMENTS:
        candidate = cls(environ)
        if candidate.detect():
            return candidate
    return SingleProcessEnvironment(environ)  # unreachable: the last one always detects


def detect_source(environ: Mapping[str, str] | None = None) -> str:
    """Which launcher started this process: ringtrain, torchrun, slurm, or single."""
    return detect_environment(environ).source


def context_from_env(environ: Mapping[str, str] | None = None) -> DistributedContext:
    """Build the context of this process from its environment.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        The context; ``source == "single"`` and ``world_size == 1`` when no launcher is detected.

    Raises:
        ValueError: if a variable is malformed or ranks are out of range.
    """
    return detect_environment(environ).context()


def _cuda_requested(env: Mapping[str, str]) -> bool:
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
