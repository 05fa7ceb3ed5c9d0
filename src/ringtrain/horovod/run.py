"""``horovod.run``: start ``np`` worker processes, call a function in each, return its results.

Horovod's Python launcher (``import horovod; horovod.run(fn, args=(...), np=2)``) spawns the
workers over SSH/MPI or Gloo and returns ``[fn(*args, **kwargs) of rank 0, of rank 1, ...]``. Here
the same call is one :class:`ringtrain.Trainer` run on this machine (local processes, gloo on CPU):
each worker calls ``func(*args, **kwargs)`` (``hvd.init()`` inside ``func`` joins the worker
group, as under ``horovodrun``) and sends the return value back to the driver with its last
``report``. The run directory is a temporary one, removed afterwards, unless ``storage_path`` is
given.

What maps to what:

============================  =========================================================
``np`` / ``num_proc``         ``ScalingConfig(num_workers=np)``
``min_np``, ``max_np``        ``ScalingConfig(num_workers=(min_np, max_np))`` (elastic)
``reset_limit``               ``FailureConfig(max_failures=reset_limit)``
``hosts`` / ``hostfile``      only this machine (``localhost:N``); other hosts: ``backend="ray"``
                              through :class:`ringtrain.horovod.ray.RayExecutor`
``use_mpi=True``, ``mpi_args``  refused (no MPI: ringtrain runs on torch.distributed / gloo)
``verbose``                   progress lines on stderr (``RunConfig(progress="plain")``)
SSH, NIC, cache, executable   accepted and ignored (they configure Horovod's remote launch)
``start_timeout``             accepted and ignored: start-up is never a hang here, and ringtrain's
                              hang detection (``FailureConfig.worker_timeout_s``, 600 s) starts
                              at a worker's first sign of progress (a prepared batch, a
                              ``TrainState`` step, a report), which plain Horovod code never gives
============================  =========================================================
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any

RETURN_KEY = "horovod.run.return"
"""The metric under which each rank sends ``func``'s return value to the driver."""


@dataclasses.dataclass(frozen=True)
class _Returned:
    """A rank's return value, carried through ``report`` as cloudpickled bytes: untouched (a bare
    0-d tensor would be turned into a number, as metrics are), pickled without the channel's
    multiprocessing reducers (which would send a tensor as a shared-memory file descriptor, not
    its data), and logged as a short ``repr`` in ``events.jsonl``."""

    type_name: str
    blob: bytes

    @classmethod
    def wrap(cls, value: Any) -> _Returned:
        from ringtrain.wire.payload import dumps

        return cls(type(value).__name__, dumps(value))

    def unwrap(self) -> Any:
        return pickle.loads(self.blob)

    def __repr__(self) -> str:
        return f"<return value of type {self.type_name}, {len(self.blob)} bytes>"


def _call_and_report(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """The worker side: ``func(*args, **kwargs)``, its value reported to the driver."""
    from ringtrain.worker.session import report

    value = func(*args, **kwargs)
    report({RETURN_KEY: _Returned.wrap(value)})
    return value


def _local_hosts_slots(hosts: str | None, hostfile: str | None) -> int | None:
    """The slot count of ``hosts``/``hostfile`` if they name only this machine; else raise."""
    entries: list[str] = []
    if hosts:
        entries = [h.strip() for h in hosts.split(",") if h.strip()]
    elif hostfile:
        with open(hostfile) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line:
                    name, _, rest = line.partition(" ")
                    slots = rest.strip().removeprefix("slots=") or "1"
                    entries.append(f"{name}:{slots}")
    if not entries:
        return None
    total = 0
    for entry in entries:
        name, _, slots = entry.partition(":")
        if name not in ("localhost", "127.0.0.1"):
            raise ValueError(
                "horovod.run(hosts=...): ringtrain.horovod.run starts workers on this machine "
                f"only, got host {name!r}; on a cluster use ringtrain.horovod.ray.RayExecutor "
                "(a Ray cluster) or `ringtrain run` under SLURM/torchrun on each node"
            )
        total += int(slots or 1)
    return total


def run(
    func: Callable[..., Any],
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    num_proc: int = 1,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    slots: int | None = None,
    reset_limit: int | None = None,
    cooldown_range: tuple[int, int] | None = None,
    hosts: str | None = None,
    hostfile: str | None = None,
    start_timeout: float | None = None,
    ssh_port: int | None = None,
    ssh_identity_file: str | None = None,
    disable_cache: bool | None = None,
    output_filename: str | None = None,
    verbose: int | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    mpi_args: str | None = None,
    network_interface: str | None = None,
    executable: str | None = None,
    np: int | None = None,
    min_np: int | None = None,
    max_np: int | None = None,
    *,
    storage_path: str | None = None,
    name: str | None = None,
) -> list[Any]:
    """Run ``func(*args, **kwargs)`` in ``num_proc`` worker processes; return their results.

    Horovod's signature (0.28.1), including the deprecated ``np``/``min_np``/``max_np`` aliases.
    ``func`` and its arguments are shipped with cloudpickle; ``func`` calls ``hvd.init()``
    (``import ringtrain.horovod as hvd``) and then any ``hvd`` collective.

    Args:
        func: the per-worker function; its return value must be picklable.
        args, kwargs: passed to ``func`` on every rank.
        num_proc: the number of worker processes (``np`` is the deprecated alias).
        min_num_proc, max_num_proc: an elastic range (both needed): the run starts with what it
            can get and resizes within it (ringtrain's elastic restarts, see docs/elastic.md).
        reset_limit: how many worker-group restarts (failures or resizes) to allow (default 0).
        hosts, hostfile: only this machine (``"localhost:4"``); their slot count must match
            ``num_proc`` when given without it.
        verbose: truthy: one progress line per round on stderr.
        use_gloo, use_mpi, mpi_args: gloo always; ``use_mpi=True`` is refused.
        slots, cooldown_range, start_timeout, ssh_port, ssh_identity_file, disable_cache,
            output_filename, network_interface, executable: accepted for compatibility and
            ignored.
        storage_path: keep the run directory under this path (default: a temporary directory,
            removed afterwards). Keyword-only; not in Horovod.
        name: the run's name under ``storage_path`` (default ``horovod_run_<func name>``).

    Returns:
        ``[return value of rank 0, of rank 1, ...]`` (the final world size's ranks).

    Raises:
        ValueError: ``hosts`` and ``hostfile`` both given, ``use_gloo`` and ``use_mpi`` both true,
            ``use_mpi=True``, or a host other than this machine.
        ringtrain.TrainingFailedError: a worker raised or died (beyond ``reset_limit``); the
            error carries each worker's traceback.
    """
    if np is not None:
        if num_proc == 1:
            num_proc = np
        warnings.warn("np is deprecated, use num_proc instead", DeprecationWarning, stacklevel=2)
    if min_np is not None:
        min_num_proc = min_num_proc if min_num_proc is not None else min_np
        warnings.warn(
            "min_np is deprecated, use min_num_proc instead", DeprecationWarning, stacklevel=2
        )
    if max_np is not None:
        max_num_proc = max_num_proc if max_num_proc is not None else max_np
        warnings.warn(
            "max_np is deprecated, use max_num_proc instead", DeprecationWarning, stacklevel=2
        )
    if hosts is not None and hostfile is not None:
        raise ValueError("Argument hosts and hostfile only allow one provided.")
    if use_gloo and use_mpi:
        raise ValueError("Argument use_gloo and use_mpi only allow one set True.")
    if use_mpi:
        raise ValueError(
            "horovod.run(use_mpi=True): ringtrain has no MPI controller; its workers talk over "
            "torch.distributed (gloo on CPU, NCCL on GPU): pass use_gloo=True or leave both unset"
        )
    host_slots = _local_hosts_slots(hosts, hostfile)
    if host_slots is not None and num_proc == 1 and np is None:
        num_proc = host_slots
    workers: int | tuple[int, int] = num_proc
    if min_num_proc is not None or max_num_proc is not None:
        low = min_num_proc if min_num_proc is not None else num_proc
        high = max_num_proc if max_num_proc is not None else max(num_proc, low)
        workers = (low, high) if low != high else low
    return _fit(
        func,
        tuple(args),
        dict(kwargs or {}),
        workers=workers,
        backend="local",
        resources=None,
        use_gpu=False,
        max_failures=reset_limit or 0,
        verbose=bool(verbose),
        storage_path=storage_path,
        name=name,
    )


def _fit(
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    workers: int | tuple[int, int],
    backend: str,
    resources: dict[str, float] | None,
    use_gpu: bool,
    max_failures: int,
    verbose: bool,
    storage_path: str | None,
    name: str | None,
    placement_timeout_s: float = 60.0,
) -> list[Any]:
    """One Trainer run of ``func`` on every rank; the per-rank return values, by rank."""
    from ringtrain.config import (
        FailureConfig,
        MonitorConfig,
        RunConfig,
        ScalingConfig,
    )
    from ringtrain.trainer import Trainer

    def horovod_run() -> None:
        _call_and_report(func, args, kwargs)

    horovod_run.__name__ = f"horovod_run_{getattr(func, '__name__', 'func')}"
    failure = FailureConfig(max_failures=max_failures)
    scaling = ScalingConfig(
        num_workers=workers,
        use_gpu=use_gpu,
        resources_per_worker=resources,
        backend=backend,
        placement_timeout_s=placement_timeout_s,
    )
    tmp = None
    if storage_path is None:
        tmp = storage_path = tempfile.mkdtemp(prefix="ringtrain-horovod-run-")
    try:
        run_config = RunConfig(
            name=name or horovod_run.__name__,
            storage_path=storage_path,
            failure_config=failure,
            progress="plain" if verbose else "off",
            monitor_config=MonitorConfig(tensorboard=False, csv=False),
        )
        result = Trainer(horovod_run, scaling, run_config).fit()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    values = []
    for rank in sorted(result.metrics_per_rank):
        returned = result.metrics_per_rank[rank].get(RETURN_KEY)
        values.append(returned.unwrap() if isinstance(returned, _Returned) else returned)
    return values
