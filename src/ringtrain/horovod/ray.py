"""``horovod.ray``: ``RayExecutor`` and ``ElasticRayExecutor`` on ringtrain's Ray backend.

A Horovod script on Ray changes ``from horovod.ray import RayExecutor`` into
``from ringtrain.horovod.ray import RayExecutor`` (and ``import horovod.torch as hvd`` into
``import ringtrain.horovod as hvd``); the rest keeps Horovod's names and signatures
(``create_settings``, ``start``, ``run``, ``execute``, ``run_remote``, ``execute_single``,
``shutdown``, ``num_workers``, ``cpus_per_worker``, ``use_gpu``...).

How it runs: every ``run``/``execute`` call is one :class:`ringtrain.Trainer` run with
``ScalingConfig(backend="ray")``: ``num_workers`` Ray actors in a placement group (one bundle of
``cpus_per_worker`` CPUs, and a GPU with ``use_gpu``, each), a gloo (CPU) or NCCL (GPU) process
group, the function called on every rank, its return values sent back by rank. So one call gets
ringtrain's guarantees (no orphan process, worker tracebacks in the error, restarts up to
``reset_limit``).

The one difference from Horovod: Horovod keeps its actors (and the ``executable_cls`` object in
each) alive from ``start()`` to ``shutdown()``, so successive ``execute`` calls see the state
earlier calls left. Here each call starts fresh actors and builds a fresh ``executable_cls``
object in each: state does not carry from one call to the next (run the whole loop inside one
``execute``, or checkpoint). ``run_remote`` blocks until the call is done and returns Ray object
references to the results (Horovod's returns before the workers finish). ``callbacks`` (Horovod's
stream of worker results) are refused: use ``ringtrain.report`` and ``RunConfig(callbacks=...)``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ringtrain.horovod.run import _fit


@dataclasses.dataclass(frozen=True)
class RaySettings:
    """What ``RayExecutor.create_settings`` / ``ElasticRayExecutor.create_settings`` return.

    Attributes:
        timeout_s: Horovod's Gloo rendezvous timeout; accepted and ignored (start-up is never a
            hang in ringtrain; see :func:`ringtrain.horovod.run`).
        placement_group_timeout_s: seconds to wait for Ray to grant the workers' placement group
            (``ScalingConfig.placement_timeout_s``).
        min_np, max_np: the elastic range (``ElasticRayExecutor``); ``None`` for a fixed size.
        reset_limit: how many worker-group restarts to allow (default 0).
        elastic_timeout, cooldown_range, ssh_identity_file, nics, verbose: accepted for
            Horovod compatibility; ``verbose`` prints one progress line per round.
    """

    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    min_np: int | None = None
    max_np: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600
    cooldown_range: tuple[int, int] | None = None
    ssh_identity_file: str | None = None
    nics: Any = None
    verbose: int = 1


def _refuse_callbacks(callbacks: Sequence[Callable[..., Any]] | None) -> None:
    if callbacks:
        raise ValueError(
            "RayExecutor(callbacks=...): Horovod's worker-result callbacks are not supported; "
            "report from the workers with ringtrain.report(metrics) and receive them on the "
            "driver with RunConfig(callbacks=[...]) of a ringtrain.Trainer"
        )


class RayExecutor:
    """Runs a function on ``num_workers`` Ray actors joined in one Horovod (gloo/NCCL) group.

    Args:
        settings: from :meth:`create_settings` (or ``None``: the defaults).
        num_workers: world size; or give ``num_hosts`` (and ``num_workers_per_host``).
        num_hosts, num_workers_per_host: ``num_workers = num_hosts * num_workers_per_host``
            (placed with Ray's ``PACK`` strategy, not strictly per host).
        cpus_per_worker: CPUs of each worker's Ray bundle (also its torch thread count).
        use_gpu: one CUDA device per worker, NCCL.
        gpus_per_worker: must be 1 (or ``None``) with ``use_gpu``.
        min_workers, max_workers: an elastic range (``num_workers`` is then ignored).
        reset_limit: restarts allowed (overrides ``settings.reset_limit``).
        cpus_per_slot, gpus_per_slot: Horovod's elastic aliases of ``cpus_per_worker`` /
            ``gpus_per_worker``.
        use_current_placement_group, cooldown_range, elastic_timeout, override_discovery:
            accepted and ignored.

    Raises:
        ValueError: ``gpus_per_worker`` without ``use_gpu``, or neither ``num_workers``,
            ``num_hosts`` nor ``min_workers``.
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        ssh_str: str | None = None,
        placement_group_timeout_s: float = 100,
        nics: Any = None,
        verbose: int = 1,
    ) -> RaySettings:
        """Horovod's settings object (``ssh_str`` is ignored: no SSH is used)."""
        return RaySettings(
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            ssh_identity_file=ssh_identity_file,
            nics=nics,
            verbose=verbose,
        )

    def __init__(
        self,
        settings: RaySettings | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: int = 1,
        use_gpu: bool = False,
        gpus_per_worker: int | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[int, int] | None = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
        *,
        cpus_per_slot: int | None = None,
        gpus_per_slot: int | None = None,
    ) -> None:
        self.settings = settings if settings is not None else RaySettings()
        if cpus_per_slot is not None:
            cpus_per_worker = cpus_per_slot
        if gpus_per_slot is not None:
            gpus_per_worker = gpus_per_slot
        if gpus_per_worker and not use_gpu:
            raise ValueError(
                "gpus_per_slot is set, but use_gpu is False. "
                "use_gpu must be True if gpus_per_slot is set."
            )
        if use_gpu and gpus_per_worker not in (None, 1):
            raise ValueError(
                f"RayExecutor(gpus_per_worker={gpus_per_worker}): ringtrain gives each worker "
                "exactly one GPU; use gpus_per_worker=1 (or None) and more workers"
            )
        if num_workers is None and num_hosts is not None:
            num_workers = num_hosts * num_workers_per_host
        if num_workers is None and min_workers is None:
            raise ValueError(
                "RayExecutor needs num_workers=N (or num_hosts=H with num_workers_per_host, "
                "or min_workers= for an elastic run)"
            )
        self.num_workers = num_workers
        self.num_hosts = num_hosts
        self.num_workers_per_host = num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = gpus_per_worker or 1
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.reset_limit = reset_limit if reset_limit is not None else self.settings.reset_limit
        self._started = False
        self._executable: tuple[Any, list[Any], dict[str, Any]] | None = None
        self._env: dict[str, str] = {}

    @property
    def _workers(self) -> int | tuple[int, int]:
        if self.min_workers is None and self.max_workers is None:
            assert self.num_workers is not None
            return self.num_workers
        low = self.min_workers if self.min_workers is not None else 1
        high = self.max_workers if self.max_workers is not None else self.num_workers or low
        return (low, high) if low != high else low

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: list[Any] | None = None,
        executable_kwargs: dict[str, Any] | None = None,
        extra_env_vars: dict[str, str] | None = None,
    ) -> None:
        """Record what each call builds in every worker: an ``executable_cls(*executable_args,
        **executable_kwargs)`` object (passed to :meth:`execute`'s function) and the
        environment variables ``extra_env_vars``. Nothing starts yet (each call starts its
        workers; see the module docstring)."""
        self._executable = (
            (executable_cls, list(executable_args or []), dict(executable_kwargs or {}))
            if executable_cls is not None
            else None
        )
        self._env = {str(k): str(v) for k, v in (extra_env_vars or {}).items()}
        self._started = True

    def _call(self, body: Callable[[], Any], name: str) -> list[Any]:
        if not self._started:
            raise RuntimeError("RayExecutor: call start() before run()/execute()")
        env = dict(self._env)

        def worker_body() -> Any:
            os.environ.update(env)
            return body()

        worker_body.__name__ = name
        resources: dict[str, float] = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            resources["GPU"] = 1.0
        return _fit(
            worker_body,
            (),
            {},
            workers=self._workers,
            backend="ray",
            resources=resources,
            use_gpu=self.use_gpu,
            max_failures=self.reset_limit or 0,
            verbose=bool(self.settings.verbose and self.settings.verbose > 1),
            storage_path=None,
            name=None,
            placement_timeout_s=float(self.settings.placement_group_timeout_s),
        )

    def _make_executable(self) -> Callable[[], Any]:
        spec = self._executable

        def make() -> Any:
            if spec is None:
                return None
            cls, args, kwargs = spec
            return cls(*args, **kwargs)

        return make

    def execute(
        self,
        fn: Callable[[Any], Any],
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``fn(executable)`` on every worker; the results by rank (``executable`` is the
        ``executable_cls`` object of :meth:`start`, ``None`` without one)."""
        _refuse_callbacks(callbacks)
        make = self._make_executable()
        return self._call(lambda: fn(make()), "horovod_execute")

    def run(
        self,
        fn: Callable[..., Any],
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``fn(*args, **kwargs)`` on every worker; the results by rank."""
        _refuse_callbacks(callbacks)
        call_args, call_kwargs = list(args or []), dict(kwargs or {})
        return self._call(lambda: fn(*call_args, **call_kwargs), "horovod_run")

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """As :meth:`run`, returning ``ray.ObjectRef`` s of the results (``ray.get`` them).
        Unlike Horovod's, it returns after the workers finished."""
        import ray

        return [ray.put(value) for value in self.run(fn, args, kwargs)]

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker only (the others start and idle); its
        result. ``fn`` must not use collectives (the other ranks do not take part)."""
        make = self._make_executable()

        def chief_only() -> Any:
            from ringtrain.worker.session import get_context

            return fn(make()) if get_context().world_rank == 0 else None

        return self._call(chief_only, "horovod_execute_single")[0]

    def shutdown(self) -> None:
        """Forget ``start()``'s executable; the actors of each call are already gone."""
        self._started = False
        self._executable = None


class ElasticRayExecutor:
    """Horovod's elastic executor on Ray (deprecated in Horovod 0.28 in favour of
    ``RayExecutor(min_workers=...)``): runs ``worker_fn`` on ``min_np..max_np`` actors.

    Args:
        settings: from :meth:`create_settings` (``min_np``, ``max_np``, ``reset_limit``).
        use_gpu, cpus_per_slot, gpus_per_slot: per-worker resources as in :class:`RayExecutor`.
        env_vars: environment variables set in every worker.
        override_discovery: accepted and ignored (ringtrain does not poll a host script).
    """

    @staticmethod
    def create_settings(
        min_np: int = 1,
        max_np: int | None = None,
        reset_limit: int | None = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: str | None = None,
        nics: Any = None,
        cooldown_range: tuple[int, int] | None = None,
        verbose: int = 1,
        **kwargs: Any,
    ) -> RaySettings:
        """Horovod's elastic settings (unknown keyword arguments are ignored, as Horovod
        passes them on to its discovery)."""
        return RaySettings(
            timeout_s=timeout_s,
            min_np=min_np,
            max_np=max_np,
            reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            cooldown_range=cooldown_range,
            ssh_identity_file=ssh_identity_file,
            nics=nics,
            verbose=verbose,
        )

    def __init__(
        self,
        settings: RaySettings,
        use_gpu: bool = False,
        cpus_per_slot: int = 1,
        gpus_per_slot: int | None = None,
        env_vars: dict[str, str] | None = None,
        override_discovery: bool = True,
    ) -> None:
        warnings.warn(
            "ElasticRayExecutor is deprecated in Horovod; use RayExecutor(min_workers=...)",
            DeprecationWarning,
            stacklevel=2,
        )
        if settings.max_np is None:
            raise ValueError(
                "ElasticRayExecutor.create_settings(max_np=...) is required by ringtrain: the "
                "run starts with max_np workers (it does not discover hosts as they join)"
            )
        self.settings = settings
        self._env = dict(env_vars or {})
        self._executor = RayExecutor(
            settings,
            min_workers=settings.min_np,
            max_workers=settings.max_np,
            cpus_per_worker=cpus_per_slot,
            use_gpu=use_gpu,
            gpus_per_worker=gpus_per_slot,
            reset_limit=settings.reset_limit,
        )

    def start(self) -> None:
        """Prepare (nothing starts until :meth:`run`)."""
        self._executor.start(extra_env_vars=self._env)

    def run(
        self,
        worker_fn: Callable[[], Any],
        callbacks: Sequence[Callable[..., Any]] | None = None,
    ) -> list[Any]:
        """``worker_fn()`` on every worker of the elastic group; the results by rank."""
        return self._executor.run(worker_fn, callbacks=callbacks)
