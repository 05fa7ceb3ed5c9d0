"""``FSDPConfig``: how :func:`ringtrain.prepare_model` shards a model with FSDP2 (units,
mixed precision, CPU offload, activation checkpointing, meta-device initialisation), validated
when it is built. The sharding itself is :mod:`ringtrain.parallel.fsdp`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

MIXED_PRECISION = {
    "bf16": ("bfloat16", "float32"),
    "fp16": ("float16", "float32"),
}
"""``FSDPConfig.mixed_precision`` -> (parameter dtype for compute, gradient reduction dtype),
as names of ``torch`` dtypes (the config layer does not import torch)."""


def _is_module_class(obj: object) -> bool:
    """Whether ``obj`` is a subclass of ``torch.nn.Module``, without importing torch (a class
    whose method resolution order holds ``torch.nn.modules.module.Module``)."""
    return isinstance(obj, type) and any(
        (c.__module__, c.__qualname__) == ("torch.nn.modules.module", "Module") for c in obj.__mro__
    )


@dataclass(frozen=True)
class FSDPConfig:
    """How :func:`ringtrain.prepare_model` shards a model with ``parallel_strategy="fsdp"``.

    Attributes:
        shard_modules: the module classes that become FSDP units (e.g. ``[TransformerBlock]``);
            each instance is sharded on its own, so only one unit's full parameters exist at a
            time. ``None``: choose units by size (``min_num_params``).
        min_num_params: with ``shard_modules=None``, a module becomes a unit when its parameters
            that no smaller unit owns number at least this many (elements, not bytes).
        mixed_precision: ``"bf16"`` or ``"fp16"``: the all-gathered parameters used in forward and
            backward are cast to that dtype, gradients are reduce-scattered in float32, and the
            sharded parameters and the optimizer stay in float32; the root's output is cast back
            to float32. ``None`` (or ``"fp32"``): no casting.
        cpu_offload: keep the sharded parameters, gradients and optimizer state in (pinned) host
            memory and copy each unit to the GPU only for its forward and backward; the
            optimizer step runs on the CPU. On a CPU-only run it changes nothing.
        activation_checkpointing: recompute each unit's activations in backward instead of
            keeping them (about one more forward of compute for much less activation memory).
            Applied before sharding; parameter names do not change.
        reshard_after_forward: free each unit's full parameters after its forward and gather
            them again for backward (ZeRO-3). False keeps them from forward to backward (ZeRO-2
            memory for parameters, one all-gather fewer per step). The root is never resharded
            after forward (its parameters are needed first in backward).
        sync_module_states: broadcast rank 0's parameters and buffers to every rank before
            sharding (what DDP does on wrap), so that ranks that built the model with different
            seeds still start identical. Skipped for a meta-device model.
        init_fn: for a model built on the meta device (``with torch.device("meta"): ...``, no
            memory used): called as ``init_fn(model)`` under ``torch.no_grad()`` after sharding
            and ``to_empty``, to fill the sharded parameters and buffers (e.g.
            ``lambda m: [x.reset_parameters() for x in m.modules() if hasattr(x,
            "reset_parameters")]``). Random initialisation of sharded parameters is consistent
            across ranks but not bit-identical to initialising the full model.

    Raises:
        ValueError / TypeError: naming the field and the fix, for a bad value.
    """

    shard_modules: Sequence[type[nn.Module]] | None = None
    min_num_params: int = 1_000_000
    mixed_precision: str | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    sync_module_states: bool = True
    init_fn: Callable[[nn.Module], Any] | None = None

    def __post_init__(self) -> None:
        mods: Any = self.shard_modules
        if mods is not None:
            if isinstance(mods, type):
                mods = (mods,)
            if not isinstance(mods, (list, tuple)) or not mods:
                raise TypeError(
                    "FSDPConfig.shard_modules must be a non-empty list of nn.Module classes "
                    f"(e.g. [TransformerBlock]) or None for the size policy, got {mods!r}"
                )
            bad = [m for m in mods if not _is_module_class(m)]
            if bad:
                raise TypeError(
                    f"FSDPConfig.shard_modules must hold nn.Module classes, got {bad!r} (pass "
                    "the class itself, e.g. shard_modules=[TransformerBlock], not an instance "
                    "or a name)"
                )
            object.__setattr__(self, "shard_modules", tuple(mods))
        if isinstance(self.min_num_params, bool) or not isinstance(self.min_num_params, int):
            raise TypeError(
                f"FSDPConfig.min_num_params must be an int, got {self.min_num_params!r}"
            )
        if self.min_num_params < 1:
            raise ValueError(
                f"FSDPConfig.min_num_params must be >= 1, got {self.min_num_params} (it is the "
                "parameter count from which a module becomes its own FSDP unit)"
            )
        mp = self.mixed_precision
        if mp == "fp32":
            object.__setattr__(self, "mixed_precision", None)
        elif mp is not None and mp not in MIXED_PRECISION:
            raise ValueError(
                f"FSDPConfig.mixed_precision must be 'bf16', 'fp16', 'fp32' or None, got {mp!r} "
                "('bf16': compute in bfloat16, reduce gradients in float32)"
            )
        for name in (
            "cpu_offload",
            "activation_checkpointing",
            "reshard_after_forward",
            "sync_module_states",
        ):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"FSDPConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError(
                f"FSDPConfig.init_fn must be a function init_fn(model) or None, got "
                f"{self.init_fn!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly description (module classes by qualified name)."""
        return {
            "shard_modules": (
                [f"{m.__module__}.{m.__qualname__}" for m in self.shard_modules]
                if self.shard_modules is not None
                else None
            ),
            "min_num_params": self.min_num_params,
            "mixed_precision": self.mixed_precision,
            "cpu_offload": self.cpu_offload,
            "activation_checkpointing": self.activation_checkpointing,
            "reshard_after_forward": self.reshard_after_forward,
            "sync_module_states": self.sync_module_states,
            "init_fn": getattr(self.init_fn, "__qualname__", None) if self.init_fn else None,
        }
