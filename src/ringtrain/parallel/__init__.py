"""How ``prepare_model`` parallelises a model: one typed strategy object per kind of wrapping.

:class:`DDPStrategy` (replicate, allreduce the gradients), :class:`FSDPStrategy` (shard with
FSDP2) and :class:`LocalStrategy` (place only) implement :class:`ModelStrategy`; see
:mod:`ringtrain.parallel.strategy`. A new kind of parallelism (a device mesh with tensor or
pipeline parallelism) is a new class with the same three methods, not a new keyword of
``prepare_model``.
"""

from ringtrain.parallel.strategy import (
    DDPStrategy,
    FSDPStrategy,
    LocalStrategy,
    ModelStrategy,
    ParallelStrategy,
    WrapContext,
    strategy_from_kwargs,
)

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "LocalStrategy",
    "ModelStrategy",
    "ParallelStrategy",
    "WrapContext",
    "strategy_from_kwargs",
]
