"""Typed, validated configuration.

Every config is a frozen dataclass that rejects a bad value in ``__post_init__``, before any process
starts, with a message that names the field and the fix. ``to_dict()`` gives the JSON-able form that
is written to the run directory's ``config.json``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ringtrain.config.backends import check_backend_fields, check_backend_name
from ringtrain.config.failure import FailureConfig
from ringtrain.config.monitor import MonitorConfig
from ringtrain.config.parallel import ParallelConfig
from ringtrain.config.replica_groups import elastic_mesh_refusal
from ringtrain.config.spares import check_spares
from ringtrain.config.validation import check_int, short_errors

ELASTIC_BATCH_POLICIES = ("resize_batch", "accumulate", "scale_lr")
"""``ScalingConfig.elastic_batch_policy`` values (docs/elastic.md, "Same math")."""

CALLBACK_HOOKS = (
    "on_report",
    "on_round",
    "on_checkpoint",
    "on_failure",
    "on_timing",
    "on_straggler",
    "on_end",
)
"""The driver-side callback hooks a ``RunConfig.callbacks`` object may define."""

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@short_errors
@dataclass(frozen=True)
class ScalingConfig:
    """How many workers, and on what.

    Attributes:
        num_workers: world size, the number of data-parallel worker processes (>= 1); or a
            ``(min, max)`` pair for elastic training (either backend): the run starts with
            ``max`` workers and, when workers die, continues in place with the survivors while
            at least ``min`` remain (docs/elastic.md).
        use_gpu: give each worker one CUDA device and use NCCL; otherwise CPU and gloo.
        resources_per_worker: ``{"CPU": k}`` sets each worker's torch thread count to ``int(k)``
            (default: the machine's cores divided by ``num_workers``, at least 1); ``{"GPU": g}``
            must be 1 when ``use_gpu`` (one device per worker).
        backend: the launcher: ``"local"`` starts worker processes on this machine; ``"ray"``
            starts one Ray actor per worker on a Ray cluster (``pip install ringtrain[ray]``;
            see docs/ray.md). With ``"ray"``, ``resources_per_worker`` is each worker's Ray
            bundle (``CPU`` defaults to 1 and sets the torch threads; other keys are Ray custom
            resources).
        placement_strategy: ``backend="ray"`` only: how the workers' placement group spreads
            over nodes: ``"PACK"`` (as few nodes as possible), ``"SPREAD"`` (as many as
            possible), ``"STRICT_PACK"`` (one node) or ``"STRICT_SPREAD"`` (one worker per node).
        ray_address: ``backend="ray"`` only: the cluster to join (``"auto"``, ``"HOST:PORT"``);
            ``None`` uses ``RAY_ADDRESS`` or Ray already initialised in this process, else starts
            a Ray instance on this machine for the run. Ray Client (``ray://``) is not supported:
            run the driver on a node of the cluster.
        placement_timeout_s: ``backend="ray"`` only: seconds to wait for the cluster to grant
            the placement group before failing with the missing resources named.
        elastic_batch_policy: elastic runs only: how the optimisation follows the world size
            ``W`` (the loader's ``batch_size`` ``b`` is the per-worker batch at ``max``):
            ``"resize_batch"`` (default) keeps the global batch ``b * max`` with ``b * max / W``
            samples per worker; ``"accumulate"`` keeps it too, but
            ``PreparedDataLoader.micro_batches`` splits each worker's batch into micro-batches
            of at most ``b`` (memory of ``max`` workers); ``"scale_lr"`` keeps ``b`` per worker
            and scales every optimizer's learning rate by ``W / max`` (Goyal et al. 2017). See
            docs/elastic.md.
        elastic_grow_after_s: elastic runs only: after the group shrank below ``max``, start
            new workers this many seconds later (doubled after each grow whose new worker
            failed) and grow the group back to ``max`` at the next step boundary, the new
            workers receiving the state from a peer (seconds, >= 0; ``None``: never grow back).
            Ignored with an int ``num_workers``. See docs/elastic.md.
        parallel: the device mesh the workers form (:class:`ringtrain.ParallelConfig`:
            ``dp_replicate x dp_shard x tp x pp``, docs/parallelism.md); its sizes must
            multiply to ``num_workers``. ``None`` (default): plain data parallelism, as before
            (``prepare_model`` uses DDP; ``get_context().mesh`` is the mesh with ``dp_shard``
            = the world size). Not with elastic ``num_workers=(min, max)``.
        warm_start: ``backend="local"``: fork workers from a warm pool (one process per run
            that imported torch once; restarts and elastic newcomers skip ``import torch``).
            ``False``: a fresh interpreter per worker, for a train function whose module
            mutates process-global state at import (docs/fault-tolerance.md). Ray: ignored.
        preload_modules: ``backend="local"`` with ``warm_start``: modules (dotted names) the
            warm pool's zygote imports once, after torch and before it forks the workers, so
            that every worker, restarted worker and elastic newcomer finds them imported (e.g.
            ``("transformers",)``). ``Trainer.fit`` adds ``lightning.pytorch`` by itself when
            the train function's module uses Lightning (``ringtrain.launch.pool.AUTO_PRELOAD``;
            ~3 CPU-seconds per worker start on 2 cores).
            A module that fails to import there is left to the worker (which raises its own
            error if it imports it); one that starts a thread at import stops the zygote from
            forking (a thread's locks would be copied held): the workers then start cold, and
            the run's ``cold_start`` event says why. Ray: ignored.
        spares: hot spare workers (>= 0): started with the group and kept ready (imported,
            warmed up, connected), each takes a lost member's rank, or that of a member a
            preemption notice names, at the next step boundary with the state of a peer, so the
            group goes on at full size (a spare is started again to replace the one used).
            ``spares > 0`` resizes in place with an int ``num_workers`` too (the group never
            shrinks: no spare ready means a restart from disk). Local backend, CPU, plain data
            parallelism; ``ValueError`` otherwise (docs/elastic.md, "Hot spares").
    """

    num_workers: int | tuple[int, int] = 1
    use_gpu: bool = False
    resources_per_worker: Mapping[str, float] | None = None
    backend: str = "local"
    placement_strategy: str = "PACK"
    ray_address: str | None = None
    placement_timeout_s: float = 60.0
    elastic_batch_policy: str = "resize_batch"
    elastic_grow_after_s: float | None = 10.0
    parallel: ParallelConfig | None = None
    warm_start: bool = True
    preload_modules: tuple[str, ...] = ()
    spares: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.warm_start, bool):
            raise ValueError(
                f"ScalingConfig.warm_start must be True or False, got {self.warm_start!r}"
            )
        self._check_preload_modules()
        self._check_num_workers()
        self._check_parallel()
        self._check_elastic_batch_policy()
        grow = self.elastic_grow_after_s
        if grow is not None and (
            isinstance(grow, bool) or not isinstance(grow, (int, float)) or not grow >= 0
        ):
            raise ValueError(
                "ScalingConfig.elastic_grow_after_s must be a number of seconds >= 0 or None, "
                f"got {grow!r} (use e.g. 10.0 to grow back to max workers 10 s after a shrink, "
                "None to keep the smaller group)"
            )
        if not isinstance(self.use_gpu, bool):
            raise TypeError(f"ScalingConfig.use_gpu must be True or False, got {self.use_gpu!r}")
        check_backend_name(self)  # ValueError naming the known backends
        if self.resources_per_worker is not None:
            if not isinstance(self.resources_per_worker, Mapping):
                raise TypeError(
                    "ScalingConfig.resources_per_worker must be a dict like {'CPU': 2}, "
                    f"got {type(self.resources_per_worker).__name__}"
                )
            # A frozen dataclass may still hold a caller's mutable dict; keep our own copy.
            object.__setattr__(self, "resources_per_worker", dict(self.resources_per_worker))
        check_backend_fields(self)  # resource names, placement_strategy, ray_address, ...
        self._check_resource_amounts()
        check_spares(self)  # ringtrain.config.spares: where a spare cannot serve

    def _check_preload_modules(self) -> None:
        names = self.preload_modules
        if isinstance(names, str) or not isinstance(names, (tuple, list)):
            raise TypeError(
                "ScalingConfig.preload_modules must be a tuple of module names, got "
                f"{names!r} (e.g. preload_modules=('transformers',))"
            )
        for name in names:
            if not isinstance(name, str) or not _MODULE_RE.match(name):
                raise ValueError(
                    f"ScalingConfig.preload_modules: {name!r} is not a module name (dotted "
                    "identifiers, e.g. 'transformers' or 'lightning.pytorch')"
                )
            # Only the top-level package is looked up: a dotted name's parents would be
            # imported by find_spec, in the driver.
            if importlib.util.find_spec(name.split(".")[0]) is None:
                raise ValueError(
                    f"ScalingConfig.preload_modules: no module named {name.split('.')[0]!r} "
                    "in this environment (install it, or do not preload it)"
                )
        # JSON gives back a list (config.json); keep a hashable tuple.
        object.__setattr__(self, "preload_modules", tuple(names))

    def _check_resource_amounts(self) -> None:
        resources = self.resources_per_worker or {}
        for key, amount in resources.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
                raise ValueError(
                    f"ScalingConfig.resources_per_worker[{key!r}] must be a positive number, "
                    f"got {amount!r}"
                )
        gpus = resources.get("GPU")
        if gpus is not None and (not self.use_gpu or gpus != 1):
            raise ValueError(
                f"ScalingConfig.resources_per_worker['GPU']={gpus!r} is not supported: each "
                "worker drives exactly one GPU (set use_gpu=True and drop the 'GPU' key)"
            )

    def _check_num_workers(self) -> None:
        n = self.num_workers
        if isinstance(n, (tuple, list)):
            if len(n) != 2:
                raise ValueError(
                    f"ScalingConfig.num_workers must be an int or a (min, max) pair, got {n!r} "
                    "(use num_workers=(2, 4) for elastic training between 2 and 4 workers)"
                )
            fix = "use num_workers=(min, max) with 1 <= min <= max"
            check_int("ScalingConfig", "num_workers[0] (min)", n[0], 1, fix)
            check_int("ScalingConfig", "num_workers[1] (max)", n[1], 1, fix)
            if n[0] > n[1]:
                raise ValueError(
                    f"ScalingConfig.num_workers=({n[0]}, {n[1]}): min must be <= max ({fix})"
                )
            # JSON gives back a list (config.json); keep a hashable tuple.
            object.__setattr__(self, "num_workers", (int(n[0]), int(n[1])))
            return
        check_int(
            "ScalingConfig",
            "num_workers",
            n,
            1,
            "use num_workers=1 for a single process, or (min, max) for elastic training",
        )

    def _check_parallel(self) -> None:
        parallel = self.parallel
        if parallel is None:
            return
        if isinstance(parallel, Mapping):  # config.json gives back a dict
            parallel = ParallelConfig(**parallel)
            object.__setattr__(self, "parallel", parallel)
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(
                "ScalingConfig.parallel must be a ringtrain.ParallelConfig or None, got "
                f"{type(parallel).__name__} (e.g. parallel=rt.ParallelConfig(dp_shard=2, tp=2))"
            )
        if self.elastic:  # only the replica count may vary: ringtrain.config.replica_groups
            refusal = elastic_mesh_refusal(parallel, self.min_workers, self.max_workers)
            if refusal is not None:
                raise ValueError(refusal)
        mesh = parallel.resolve(self.max_workers)
        if self.use_gpu and mesh.tp > 1 and self.placement_strategy == "STRICT_SPREAD":
            raise ValueError(
                f"ScalingConfig(placement_strategy='STRICT_SPREAD', parallel=ParallelConfig("
                f"tp={mesh.tp})): tensor parallelism must stay within a node (its all-reduces "
                "run every layer) but STRICT_SPREAD puts one worker per node; use "
                "placement_strategy='PACK' or tp=1"
            )

    def _check_elastic_batch_policy(self) -> None:
        policy = self.elastic_batch_policy
        if policy not in ELASTIC_BATCH_POLICIES:
            raise ValueError(
                "ScalingConfig.elastic_batch_policy must be one of "
                f"{', '.join(map(repr, ELASTIC_BATCH_POLICIES))}, got {policy!r} ('resize_batch' "
                "and 'accumulate' keep the global batch, 'scale_lr' keeps the per-worker batch)"
            )
        if policy != "resize_batch" and not self.elastic:
            raise ValueError(
                f"ScalingConfig.elastic_batch_policy={policy!r} applies to elastic runs only, "
                f"got num_workers={self.num_workers!r} (give num_workers=(min, max), or drop "
                "elastic_batch_policy)"
            )

    @property
    def elastic(self) -> bool:
        """Whether ``num_workers`` is a ``(min, max)`` range (elastic training, docs/elastic.md)."""
        return isinstance(self.num_workers, tuple)

    @property
    def in_place(self) -> bool:
        """Whether the run resizes or replaces workers in place (elastic, or with spares)."""
        return self.elastic or self.spares > 0

    @property
    def min_workers(self) -> int:
        """The fewest workers the run continues with in place (``num_workers`` when an int)."""
        n = self.num_workers
        return n[0] if isinstance(n, tuple) else n

    @property
    def max_workers(self) -> int:
        """The world size the run starts with (``num_workers`` when an int)."""
        n = self.num_workers
        return n[1] if isinstance(n, tuple) else n

    def threads_per_worker(self, cpu_count: int | None = None) -> int:
        """Torch intra-op threads each worker uses (>= 1)."""
        if self.resources_per_worker and "CPU" in self.resources_per_worker:
            return max(1, int(self.resources_per_worker["CPU"]))
        cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        return max(1, cores // self.max_workers)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@short_errors
@dataclass(frozen=True)
class CheckpointConfig:
    """Which checkpoints to keep.

    Attributes:
        num_to_keep: keep at most this many checkpoints (``None``: keep all). The latest checkpoint
            is never deleted, so at most ``num_to_keep`` of the best plus the latest survive.
        checkpoint_score_attribute: a metric name reported with each checkpoint; checkpoints are
            ranked by it (``None``: ranked by recency).
        checkpoint_score_order: ``"max"`` keeps the highest scores, ``"min"`` the lowest.
        async_save: write ``TrainState`` checkpoints on a background thread: ``report`` copies
            the state to host memory and returns, the files are written while training goes on
            (the next checkpoint waits for the previous one). False writes before ``report``
            returns.
        from_scratch_if_invalid: when the run directory holds checkpoints and none of them
            verifies (docs/security.md), set them all aside and start from step 0. False (the
            default) refuses to start with a ``NoValidCheckpointError`` that lists them.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: Literal["max", "min"] = "max"
    async_save: bool = True
    from_scratch_if_invalid: bool = False

    def __post_init__(self) -> None:
        if self.num_to_keep is not None:
            check_int(
                "CheckpointConfig",
                "num_to_keep",
                self.num_to_keep,
                1,
                "use num_to_keep=None to keep every checkpoint",
            )
        if self.checkpoint_score_attribute is not None and (
            not isinstance(self.checkpoint_score_attribute, str)
            or not self.checkpoint_score_attribute
        ):
            raise ValueError(
                "CheckpointConfig.checkpoint_score_attribute must be a metric name (a non-empty "
                f"str) or None, got {self.checkpoint_score_attribute!r}"
            )
        if self.checkpoint_score_order not in ("max", "min"):
            raise ValueError(
                "CheckpointConfig.checkpoint_score_order must be 'max' or 'min', "
                f"got {self.checkpoint_score_order!r}"
            )
        if not isinstance(self.async_save, bool):
            raise TypeError(
                f"CheckpointConfig.async_save must be True or False, got {self.async_save!r}"
            )
        if not isinstance(self.from_scratch_if_invalid, bool):
            raise TypeError(
                "CheckpointConfig.from_scratch_if_invalid must be True or False, got "
                f"{self.from_scratch_if_invalid!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


DEFAULT_STORAGE_PATH = "./runs"


@short_errors
@dataclass(frozen=True)
class RunConfig:
    """Where a run writes, and how it behaves.

    Attributes:
        name: the run's directory name under ``storage_path`` (default: the entrypoint's name and a
            timestamp). Running again with the same name reuses the directory.
        storage_path: a local directory or an fsspec URL (``file://``, ``memory://``, ``s3://``...);
            ``None`` means the default, ``./runs`` (as ``None`` means Ray's default in Ray Train).
        checkpoint_config: checkpoint retention.
        failure_config: restart behaviour.
        callbacks: objects with any of the hooks in :data:`CALLBACK_HOOKS`
            (``on_report(rank, round, metrics)``, ``on_round(round, metrics)``,
            ``on_checkpoint(checkpoint, metrics)``, ``on_failure(failure)``,
            ``on_timing(rank, window)``, ``on_straggler(event)``, ``on_end(result)``), called on
            the driver; see docs/monitoring.md.
        progress: ``"auto"`` (live display on a terminal, log lines otherwise), ``"rich"``,
            ``"plain"`` or ``"off"``.
        monitor_config: step timing, straggler detection, TensorBoard and CSV logs.
        signing_key: the secret that signs checkpoint manifests and the run's ``payload.pkl`` and
            ``config.json`` (bytes or str, at least 16 bytes; never written anywhere). Default:
            ``$RINGTRAIN_SIGNING_KEY``, else your private key file (created on first use; see
            docs/security.md). Give the same key to every driver that resumes the run.
        signing_key_file: read the key from this file instead (it must be private: mode 0600).
        trust_unsigned: accept checkpoints, payloads and configs that are not signed with the key
            (a warning each time): only for run directories written before signing existed, or
            by a key you no longer have, and only if you trust everyone who can write the
            storage. Paths, sizes and SHA-256 are checked all the same.
    """

    name: str | None = None
    storage_path: str = DEFAULT_STORAGE_PATH
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    failure_config: FailureConfig = field(default_factory=FailureConfig)
    callbacks: Sequence[Any] = ()
    progress: Literal["auto", "rich", "plain", "off"] = "auto"
    monitor_config: MonitorConfig = field(default_factory=MonitorConfig)
    signing_key: bytes | str | None = field(default=None, repr=False)
    signing_key_file: str | None = None
    trust_unsigned: bool = False

    def __post_init__(self) -> None:
        if self.signing_key is not None and (
            not isinstance(self.signing_key, (bytes, str)) or len(self.signing_key) < 16
        ):
            raise ValueError(
                "RunConfig.signing_key must be bytes or str of at least 16 bytes (e.g. "
                "secrets.token_hex(32)), or None to use $RINGTRAIN_SIGNING_KEY or your key file"
            )
        if self.signing_key_file is not None:
            if not isinstance(self.signing_key_file, (str, os.PathLike)):
                raise TypeError(
                    "RunConfig.signing_key_file must be a path, got "
                    f"{type(self.signing_key_file).__name__}"
                )
            object.__setattr__(self, "signing_key_file", os.fspath(self.signing_key_file))
        if not isinstance(self.trust_unsigned, bool):
            raise TypeError(
                f"RunConfig.trust_unsigned must be True or False, got {self.trust_unsigned!r}"
            )
        if self.name is not None and (
            not isinstance(self.name, str) or not _NAME_RE.match(self.name)
        ):
            raise ValueError(
                f"RunConfig.name must be a directory name of letters, digits, '_', '.', '-', got "
                f"{self.name!r} (or leave it None for '<function>_<timestamp>')"
            )
        if self.storage_path is None:  # Ray's RunConfig(storage_path=None): the default
            object.__setattr__(self, "storage_path", DEFAULT_STORAGE_PATH)
        if not isinstance(self.storage_path, (str, os.PathLike)) or not str(self.storage_path):
            raise ValueError(
                "RunConfig.storage_path must be a directory or fsspec URL, "
                f"got {self.storage_path!r}"
            )
        object.__setattr__(self, "storage_path", os.fspath(self.storage_path))
        if not isinstance(self.checkpoint_config, CheckpointConfig):
            raise TypeError(
                "RunConfig.checkpoint_config must be a ringtrain.CheckpointConfig, got "
                f"{type(self.checkpoint_config).__name__}"
            )
        if not isinstance(self.failure_config, FailureConfig):
            raise TypeError(
                "RunConfig.failure_config must be a ringtrain.FailureConfig, got "
                f"{type(self.failure_config).__name__}"
            )
        if not isinstance(self.monitor_config, MonitorConfig):
            raise TypeError(
                "RunConfig.monitor_config must be a ringtrain.MonitorConfig, got "
                f"{type(self.monitor_config).__name__}"
            )
        if self.progress not in ("auto", "rich", "plain", "off"):
            raise ValueError(
                "RunConfig.progress must be 'auto', 'rich', 'plain' or 'off', "
                f"got {self.progress!r}"
            )
        callbacks = tuple(self.callbacks)
        for cb in callbacks:
            if not any(callable(getattr(cb, h, None)) for h in CALLBACK_HOOKS):
                raise TypeError(
                    f"RunConfig.callbacks: {cb!r} has none of the hooks {', '.join(CALLBACK_HOOKS)}"
                )
        object.__setattr__(self, "callbacks", callbacks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "storage_path": self.storage_path,
            "checkpoint_config": self.checkpoint_config.to_dict(),
            "failure_config": self.failure_config.to_dict(),
            "callbacks": [type(cb).__name__ for cb in self.callbacks],
            "progress": self.progress,
            "monitor_config": self.monitor_config.to_dict(),
        }
