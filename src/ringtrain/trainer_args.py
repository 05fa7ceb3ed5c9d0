"""The driver's small decisions about a ``Trainer``'s arguments: which train function it was
given (ringtrain's name or Ray Train's), the default run name, and errors shown without
ringtrain's traceback. Re-exported by :mod:`ringtrain.trainer`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from ringtrain import slurm


def default_run_name(entrypoint: str) -> str:
    """``{entrypoint}_{YYYY-mm-dd_HH-MM-SS}``; inside a SLURM job ``{entrypoint}_slurm{JOB_ID}``,
    the same for the requeued job, which so resumes the run (:mod:`ringtrain.slurm`)."""
    safe = (
        "".join(c if c.isalnum() or c in "_.-" else "_" for c in entrypoint).strip("_.-") or "run"
    )
    return slurm.default_run_name(safe) or f"{safe}_{time.strftime('%Y-%m-%d_%H-%M-%S')}"


def _resolve_train_fn(
    train_fn: Callable[..., Any] | None,
    train_loop_per_worker: Callable[..., Any] | None,
    datasets: dict[str, Any] | None,
) -> Callable[..., Any]:
    """The train function from ringtrain's name or Ray Train's; refuses ``datasets``."""
    if datasets is not None:
        raise ValueError(
            "Trainer(datasets=...): Ray Data datasets are not supported; build a torch "
            "DataLoader inside the train function and pass it through prepare_data_loader() "
            "(it shards the data across workers like get_dataset_shard())"
        )
    if train_fn is not None and train_loop_per_worker is not None:
        raise TypeError(
            "Trainer got both train_fn and train_loop_per_worker (Ray Train's name for the same "
            "argument): give only one"
        )
    chosen = train_fn if train_fn is not None else train_loop_per_worker
    if chosen is None:
        raise TypeError(
            "Trainer needs the per-worker training function: Trainer(train_fn) or "
            "Trainer(train_loop_per_worker=train_fn)"
        )
    return chosen


def short_error(exc: BaseException) -> BaseException:
    """``exc`` without its traceback through ringtrain, for errors whose message is the whole
    story (configuration and usage errors): the user sees their own line and the fix. With
    ``RINGTRAIN_DEBUG=1`` the traceback is kept."""
    if os.environ.get("RINGTRAIN_DEBUG", "") not in ("", "0"):
        return exc
    return exc.with_traceback(None)
