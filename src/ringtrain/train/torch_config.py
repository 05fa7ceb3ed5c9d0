"""``ringtrain.train.torch.TorchConfig`` (Ray Train's), in its own module so that
:mod:`ringtrain.train.trainer` and :mod:`ringtrain.train.torch` both import it without importing
each other."""

from __future__ import annotations

from dataclasses import dataclass

from ringtrain.config import ScalingConfig

DEFAULT_TIMEOUT_S = 1800


@dataclass(frozen=True)
class TorchConfig:
    """Ray Train's ``TorchConfig``, for the values ringtrain can honour.

    Attributes:
        backend: ``None`` (NCCL with GPUs, gloo otherwise: what ringtrain always picks),
            ``"nccl"`` (needs ``use_gpu=True``) or ``"gloo"`` (needs ``use_gpu=False``).
        init_method: ``"env"`` (ringtrain's rendezvous is always ``env://``).
        timeout_s: 1800 (the collective timeout follows ``FailureConfig.worker_timeout_s``).
    """

    backend: str | None = None
    init_method: str = "env"
    timeout_s: int = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.backend not in (None, "nccl", "gloo"):
            raise ValueError(
                f"TorchConfig.backend must be None, 'nccl' or 'gloo', got {self.backend!r}"
            )
        if self.init_method != "env":
            raise ValueError(
                f"TorchConfig.init_method must be 'env', got {self.init_method!r} (ringtrain "
                "always rendezvouses through env://)"
            )
        if self.timeout_s != DEFAULT_TIMEOUT_S:
            raise ValueError(
                f"TorchConfig.timeout_s={self.timeout_s} is not supported: the collective "
                "timeout follows FailureConfig.worker_timeout_s (use RunConfig(failure_config="
                "FailureConfig(worker_timeout_s=...)))"
            )

    def check(self, scaling: ScalingConfig) -> None:
        """Raise ValueError when ``backend`` contradicts ``scaling.use_gpu``."""
        wanted = "nccl" if scaling.use_gpu else "gloo"
        if self.backend not in (None, wanted):
            raise ValueError(
                f"TorchConfig(backend={self.backend!r}) with ScalingConfig(use_gpu="
                f"{scaling.use_gpu}): ringtrain uses {wanted!r} there (leave backend=None)"
            )
