"""``ringtrain.train.torch.TorchTrainer``: :class:`ringtrain.Trainer` with Ray Train's arguments."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.launch.base import Launcher
from ringtrain.train.torch_config import TorchConfig
from ringtrain.trainer import Trainer


class TorchTrainer(Trainer):
    """Ray Train's ``TorchTrainer``: :class:`ringtrain.Trainer` with Ray's arguments.

    Args:
        train_loop_per_worker: the per-worker function, ``f(config)`` or ``f()``.
        scaling_config: workers and resources (``ringtrain.ScalingConfig``; add
            ``backend="ray"`` to run on a Ray cluster).
        run_config: ``ringtrain.RunConfig`` (``storage_path=None`` is the default ``./runs``).
        train_loop_config: the ``config`` given to ``train_loop_per_worker``.
        torch_config: a :class:`TorchConfig`.
        datasets, dataset_config, metadata, resume_from_checkpoint: Ray Data and deprecated Ray
            arguments: refused unless ``None``.
        launcher: how workers start (ringtrain's extension).

    Raises:
        TypeError, ValueError: as :class:`ringtrain.Trainer`, and for an unsupported argument
            (the message names the alternative).
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any] | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        *,
        train_loop_config: dict[str, Any] | None = None,
        torch_config: TorchConfig | None = None,
        datasets: dict[str, Any] | None = None,
        dataset_config: Any = None,
        metadata: dict[str, Any] | None = None,
        resume_from_checkpoint: Any = None,
        launcher: Launcher | None = None,
        train_fn: Callable[..., Any] | None = None,
    ) -> None:
        for name, value, fix in (
            ("dataset_config", dataset_config, "feed a torch DataLoader via prepare_data_loader"),
            ("metadata", metadata, "pass it in train_loop_config"),
            (
                "resume_from_checkpoint",
                resume_from_checkpoint,
                "run again with the same RunConfig(name=...) or use TorchTrainer.restore(path)",
            ),
        ):
            if value is not None:
                raise ValueError(f"TorchTrainer({name}=...) is not supported: {fix}")
        super().__init__(
            train_fn,
            scaling_config,
            run_config,
            train_loop_config=train_loop_config,
            launcher=launcher,
            train_loop_per_worker=train_loop_per_worker,
            datasets=datasets,
        )
        if torch_config is not None:
            if not isinstance(torch_config, TorchConfig):
                raise TypeError(
                    "TorchTrainer(torch_config=...) must be a ringtrain.train.torch.TorchConfig, "
                    f"got {type(torch_config).__name__}"
                )
            torch_config.check(self.scaling_config)
