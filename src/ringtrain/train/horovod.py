"""``ray.train.horovod``'s names on ringtrain: ``HorovodTrainer`` and ``HorovodConfig``.

The train function calls ``ringtrain.horovod`` (``import ringtrain.horovod as hvd``): ``hvd.init()``
in a worker joins the process group the worker already has, so the loop of a Ray
``HorovodTrainer`` runs unchanged (docs/ray.md, docs/horovod.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.train.trainer import TorchTrainer


@dataclass(frozen=True)
class HorovodConfig:
    """Ray Train's ``HorovodConfig``; only its defaults: ringtrain starts the workers itself
    (no SSH, no MPI, no Gloo rendezvous server of Horovod's), so none of its settings applies.

    Raises:
        ValueError: for any field other than its default (the message names it).
    """

    nics: set[str] | None = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    ssh_str: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100

    def __post_init__(self) -> None:
        defaults = HorovodConfig.__dataclass_fields__
        for name, f in defaults.items():
            if getattr(self, name) != f.default:
                raise ValueError(
                    f"HorovodConfig.{name}={getattr(self, name)!r} does not apply: ringtrain "
                    "starts the workers itself (no SSH or MPI); leave it out (placement: "
                    "ScalingConfig(placement_timeout_s=...); hangs: FailureConfig("
                    "worker_timeout_s=...))"
                )


class HorovodTrainer(TorchTrainer):
    """Ray Train's ``HorovodTrainer``: the workers of :class:`ringtrain.Trainer` running a loop
    that uses ``ringtrain.horovod`` (``hvd.init()``, ``hvd.DistributedOptimizer``...).

    Args:
        train_loop_per_worker: the per-worker function, ``f(config)`` or ``f()``.
        scaling_config, run_config, train_loop_config: as :class:`TorchTrainer`.
        horovod_config: a :class:`HorovodConfig` (defaults only).
        datasets, dataset_config, metadata, resume_from_checkpoint: refused unless ``None``.

    Raises:
        TypeError, ValueError: as :class:`TorchTrainer`.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any] | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        *,
        train_loop_config: dict[str, Any] | None = None,
        horovod_config: HorovodConfig | None = None,
        **kwargs: Any,
    ) -> None:
        if horovod_config is not None and not isinstance(horovod_config, HorovodConfig):
            raise TypeError(
                "HorovodTrainer(horovod_config=...) must be a ringtrain.train.horovod."
                f"HorovodConfig, got {type(horovod_config).__name__}"
            )
        super().__init__(
            train_loop_per_worker,
            scaling_config,
            run_config,
            train_loop_config=train_loop_config,
            **kwargs,
        )


__all__ = ["HorovodConfig", "HorovodTrainer"]
