"""Model strategies: what ``prepare_model`` does to a module, one typed object per kind.

``prepare_model`` runs the same steps for every strategy, in torchtitan's order::

    precision = strategy.check(precision)   # validation, before any process group
    module = strategy.place(model, ctx)     # device placement
    ...                                     # precision, the before_wrap hooks
    (ringtrain.worker.hooks) model = strategy.wrap(module, ctx)      # DDP / FSDP2 / nothing
    ...                                     # the after_wrap hooks (step timing)

A strategy owns its options as the fields of a frozen dataclass and validates them when it is
built, with errors that name the field and the fix; so an option of one strategy can never be
forwarded to another only to be refused there. ``prepare_model``'s keywords (``parallel_strategy=``,
``comm_hook=``, ``fsdp_config=``...) are mapped onto one strategy by :func:`strategy_from_kwargs`,
with the error messages they always had.

A new kind of parallelism (a device mesh with tensor or pipeline parallelism, DeepSpeed) is a new
class with :class:`ModelStrategy`'s three methods; :class:`WrapContext` is where the worker-side
facts it needs (the mesh, when there is one) are handed to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from torch import nn

from ringtrain.cluster.env import DistributedContext
from ringtrain.comm.ddp import DDP_OPTIONS, check_bucket_order, validate_comm_options
from ringtrain.parallel.fsdp import FSDPConfig
from ringtrain.worker.precision import normalize_precision

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from ringtrain.worker.hooks import CommObserver

_DDP_ONLY = (
    "ddp_kwargs",
    "bucket_order",
    "comm_hook",
    "comm_hook_options",
    "bucket_cap_mb",
    "static_graph",
    "find_unused_parameters",
)
"""``prepare_model``'s keywords that configure DDP, in the order its errors list them."""

_FSDP_PRECISIONS = ("32", "32-true", "fp32")


@dataclass(frozen=True)
class WrapContext:
    """What a strategy is given to place and wrap a module on this worker.

    Attributes:
        context: the worker's context (ranks, world size, device).
        move_to_device: ``prepare_model(move_to_device=...)``: move parameters and buffers to
            ``context.device`` (FSDP places its shards itself and ignores it).
        precision: the normalised precision (``"32"``, ``"bf16-mixed"``, ``"16-mixed"``) that
            :meth:`ModelStrategy.check` returned.
        comm_observer: who times communication (the timing plug-in's step timer, from
            ``ModelSetup.comm_observer`` after the ``before_wrap`` hooks), else ``None``: DDP
            times its gradient allreduce for it.
        sync_token: set by an elastic ``before_wrap`` hook when every rank is about to load the
            same snapshot into the module: DDP then skips its initial broadcast and checks at the
            first forward instead (:func:`ringtrain.comm.ddp.sync_unless_restored`).
        mesh: the worker's ``DeviceMesh`` (``get_context().mesh``) for a strategy whose
            ``uses_mesh`` is true (:class:`ParallelStrategy`); ``None`` for the others.
    """

    context: DistributedContext
    move_to_device: bool = True
    precision: str = "32"
    comm_observer: CommObserver | None = None
    sync_token: int | None = None
    mesh: DeviceMesh | None = None

    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def world_size(self) -> int:
        return self.context.world_size


@runtime_checkable
class ModelStrategy(Protocol):
    """How ``prepare_model`` parallelises a module.

    Attributes:
        name: a short name for logs and errors (``"ddp"``, ``"fsdp"``, ``"none"``).
    """

    name: ClassVar[str]

    def check(self, precision: object) -> str:
        """Validate ``prepare_model(precision=...)`` against this strategy; return it normalised.

        Raises:
            ValueError: the precision is unknown, or this strategy does its own (FSDP).
        """
        ...

    def place(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        """Put ``model`` on its device (before precision hooks and wrapping)."""
        ...

    def wrap(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        """Return the module to train (a wrapper, or ``model`` itself)."""
        ...


def _place(model: nn.Module, ctx: WrapContext) -> nn.Module:
    return model.to(ctx.device) if ctx.move_to_device else model


@dataclass(frozen=True)
class LocalStrategy:
    """No data parallelism: the module is placed on the worker's device and returned unwrapped
    (``prepare_model(parallel_strategy=None)``); gradients are not synchronised."""

    name: ClassVar[str] = "none"

    def check(self, precision: object) -> str:
        return normalize_precision(precision)

    def place(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        return _place(model, ctx)

    def wrap(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        return model


@dataclass(frozen=True)
class DDPStrategy:
    """Replicate the model on every rank and average the gradients in backward
    (``DistributedDataParallel``, when the world size is above 1; see docs/comm.md).

    Attributes:
        ddp_kwargs: extra ``DistributedDataParallel`` arguments (``gradient_as_bucket_view``,
            ``broadcast_buffers``...); not ``device_ids`` (set from the local rank) nor
            ``bucket_order``.
        comm_hook: how gradients are allreduced: ``None`` (DDP's fp32 allreduce), ``"bf16"`` /
            ``"fp16"`` (16 bits on the wire), ``"powersgd"`` (low-rank, error feedback).
        comm_hook_options: PowerSGD's options
            (:data:`ringtrain.comm.ddp.POWERSGD_DEFAULTS`); only with ``comm_hook="powersgd"``.
        bucket_cap_mb: DDP's gradient bucket size, megabytes > 0 (``None``: DDP's 25).
        static_graph: the used parameters and the graph do not change between steps.
        find_unused_parameters: let DDP find parameters without a gradient each step.
        bucket_order: ``"fixed"`` (bit-exact resume at any world size,
            :class:`ringtrain.comm.ddp.FixedOrderDDP`) or ``"rebuild"`` (torch's DDP).

    Raises:
        ValueError: at construction, naming the field and the fix: an unknown hook, bucket
            order or PowerSGD option; a value of the wrong type or range; an option given both
            as a field and in ``ddp_kwargs`` with different values.
    """

    ddp_kwargs: Mapping[str, Any] | None = None
    comm_hook: str | None = None
    comm_hook_options: Mapping[str, Any] | None = None
    bucket_cap_mb: float | None = None
    static_graph: bool | None = None
    find_unused_parameters: bool | None = None
    bucket_order: str = "fixed"

    name: ClassVar[str] = "ddp"

    def __post_init__(self) -> None:
        # Copies: the caller's dicts may change after the strategy is built.
        for name in ("ddp_kwargs", "comm_hook_options"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, dict(value))
        self.ddp_arguments()

    def ddp_arguments(self) -> dict[str, Any]:
        """The keyword arguments for ``DistributedDataParallel``: ``ddp_kwargs`` merged with the
        fields that are set."""
        return _ddp_arguments({f.name: getattr(self, f.name) for f in fields(self)}, "DDPStrategy")

    def check(self, precision: object) -> str:
        return normalize_precision(precision)

    def place(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        return _place(model, ctx)

    def wrap(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        """``DistributedDataParallel`` over the default process group (initialised here) at
        world size > 1 (:func:`ringtrain.comm.ddp.wrap_ddp`); ``model`` itself at world size 1."""
        if ctx.world_size == 1:
            return model
        from ringtrain.cluster.distributed import init_process_group
        from ringtrain.comm.ddp import wrap_ddp

        init_process_group(ctx.context)
        return wrap_ddp(
            model,
            ctx.context,
            ctx.comm_observer,
            ddp_kwargs=self.ddp_arguments(),
            comm_hook=self.comm_hook,
            comm_hook_options=self.comm_hook_options,
            loss_scaling=ctx.precision == "16-mixed",
            defer_sync_generation=ctx.sync_token,
            bucket_order=self.bucket_order,
        )


@dataclass(frozen=True)
class FSDPStrategy:
    """Shard parameters, gradients and optimizer state over the ranks with FSDP2
    ``fully_shard`` (also at world size 1); see docs/fsdp.md. Build the optimizer after
    ``prepare_model``.

    Attributes:
        config: the sharding options (units, mixed precision, CPU offload, activation
            checkpointing, meta-device init); mixed precision is ``config.mixed_precision``,
            not ``prepare_model(precision=...)``.

    Raises:
        TypeError: ``config`` is not a :class:`ringtrain.FSDPConfig`.
    """

    config: FSDPConfig = field(default_factory=FSDPConfig)

    name: ClassVar[str] = "fsdp"

    def __post_init__(self) -> None:
        if not isinstance(self.config, FSDPConfig):
            raise TypeError(
                f"FSDPStrategy.config must be a ringtrain.FSDPConfig, got "
                f"{type(self.config).__name__} (e.g. FSDPStrategy(FSDPConfig(mixed_precision="
                "'bf16')))"
            )

    def check(self, precision: object) -> str:
        if str(precision) not in _FSDP_PRECISIONS:
            raise ValueError(
                f"prepare_model(parallel_strategy='fsdp', precision={precision!r}): with FSDP use "
                "fsdp_config=FSDPConfig(mixed_precision='bf16') instead (parameters are cast when "
                "all-gathered; gradients are reduced in float32)"
            )
        return "32"

    def place(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        return model  # wrap places the shards (on the host with cpu_offload; meta: to_empty)

    def wrap(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        """:func:`ringtrain.parallel.fsdp.wrap_fsdp`: checks first, then the process group,
        broadcast, activation checkpointing, ``fully_shard`` per unit and on the root."""
        from ringtrain.parallel.fsdp import wrap_fsdp

        return wrap_fsdp(model, ctx.context, self.config)


@dataclass(frozen=True)
class ParallelStrategy:
    """The device mesh's strategy (``ScalingConfig(parallel=rt.ParallelConfig(...))``;
    docs/parallelism.md): tensor parallelism from ``tp_plan`` on ``mesh["tp"]``, then FSDP2 over
    ``mesh["dp_replicate", "dp_shard"]`` (HSDP) or ``mesh["dp_shard"]``, in torchtitan's order
    (:func:`ringtrain.parallel.tensor.wrap_on_mesh`). Build the optimizer after
    ``prepare_model``.

    Attributes:
        tp_plan: module-name pattern (``fnmatch``) -> ``"colwise"``, ``"rowwise"``,
            ``"sequence"`` or a ``torch.distributed.tensor.parallel.ParallelStyle``; ``None``:
            no tensor parallelism. Every pattern must match a module (checked at wrap). With
            ``tp == 1`` the plan is checked and has no effect.
        fsdp: FSDP's options (units, mixed precision, activation checkpointing...).

    Raises:
        TypeError / ValueError: a malformed plan or a style that is not known, naming the
            pattern and the fix; ``fsdp`` is not a :class:`ringtrain.FSDPConfig`.
    """

    tp_plan: Mapping[str, Any] | None = None
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)

    name: ClassVar[str] = "mesh"
    uses_mesh: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.tp_plan is not None:
            from ringtrain.parallel.tensor import check_tp_plan

            object.__setattr__(self, "tp_plan", check_tp_plan(self.tp_plan))
        if not isinstance(self.fsdp, FSDPConfig):
            raise TypeError(
                f"ParallelStrategy.fsdp must be a ringtrain.FSDPConfig, got "
                f"{type(self.fsdp).__name__} (e.g. ParallelStrategy(fsdp=FSDPConfig("
                "shard_modules=[Block])))"
            )

    def check(self, precision: object) -> str:
        return FSDPStrategy(self.fsdp).check(precision)

    def place(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        return model  # wrap places the shards

    def wrap(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        """:func:`ringtrain.parallel.tensor.wrap_on_mesh` on ``ctx.mesh`` (the worker's mesh
        when ``None``)."""
        from ringtrain.parallel.tensor import wrap_on_mesh

        mesh = ctx.mesh if ctx.mesh is not None else ctx.context.mesh
        return wrap_on_mesh(model, ctx.context, mesh, self.fsdp, self.tp_plan)


def strategy_from_kwargs(
    parallel_strategy: str | None = "ddp",
    fsdp_config: FSDPConfig | None = None,
    **ddp_options: Any,
) -> ModelStrategy:
    """The strategy that ``prepare_model``'s keywords describe.

    Args:
        parallel_strategy: ``"ddp"``, ``"fsdp"`` or ``None`` (:class:`LocalStrategy`).
        fsdp_config: FSDP's options (only with ``parallel_strategy="fsdp"``).
        **ddp_options: the DDP keywords of ``prepare_model`` (``ddp_kwargs``, ``comm_hook``,
            ``comm_hook_options``, ``bucket_cap_mb``, ``static_graph``,
            ``find_unused_parameters``, ``bucket_order``); ``None`` (and ``bucket_order=
            "fixed"``) mean "not given". With ``parallel_strategy=None`` they are validated
            and have no effect, as before strategies existed.

    Raises:
        ValueError: an unknown ``parallel_strategy``; ``fsdp_config`` without ``"fsdp"``; a
            DDP option with ``"fsdp"``; a bad DDP option (see :class:`DDPStrategy`).
        TypeError: ``fsdp_config`` is not a ``ringtrain.FSDPConfig``.
    """
    unknown = sorted(set(ddp_options) - set(_DDP_ONLY))
    if unknown:
        raise TypeError(f"prepare_model() got unexpected keyword argument(s) {unknown}")
    if parallel_strategy not in ("ddp", "fsdp", None):
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) is not supported "
            "(use 'ddp', 'fsdp', 'diloco', or None to leave the model unwrapped)"
        )
    if parallel_strategy == "fsdp" or fsdp_config is not None:
        return _fsdp_from_kwargs(parallel_strategy, fsdp_config, ddp_options)
    given = {k: v for k, v in ddp_options.items() if v is not None}
    _ddp_arguments(given, "prepare_model")  # its errors in prepare_model's words first
    ddp = DDPStrategy(**given)
    return ddp if parallel_strategy == "ddp" else LocalStrategy()


def _ddp_arguments(options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Validate :class:`DDPStrategy`'s fields given as ``options`` (missing ones: defaults) and
    return DDP's keyword arguments; errors name ``where`` (``"prepare_model"`` for its keywords,
    ``"DDPStrategy"`` for the object)."""
    check_bucket_order(options.get("bucket_order", "fixed"), where)
    direct = {name: options.get(name) for name in DDP_OPTIONS}
    return validate_comm_options(
        options.get("comm_hook"),
        options.get("comm_hook_options"),
        direct,
        options.get("ddp_kwargs"),
        where,
    )


def _fsdp_from_kwargs(
    parallel_strategy: str | None,
    fsdp_config: object,
    ddp_options: Mapping[str, Any],
) -> FSDPStrategy:
    if parallel_strategy != "fsdp":
        raise ValueError(
            f"prepare_model(fsdp_config=...) needs parallel_strategy='fsdp', got "
            f"parallel_strategy={parallel_strategy!r}"
        )
    given = [
        name
        for name in _DDP_ONLY
        if ddp_options.get(name) is not None
        and not (name == "bucket_order" and ddp_options[name] == "fixed")
    ]
    if given:
        raise ValueError(
            f"prepare_model(parallel_strategy='fsdp'): {', '.join(given)} only apply to DDP; "
            "FSDP's options are in fsdp_config=ringtrain.FSDPConfig(...)"
        )
    config = fsdp_config if fsdp_config is not None else FSDPConfig()
    if not isinstance(config, FSDPConfig):
        raise TypeError(
            f"prepare_model(fsdp_config=...) must be a ringtrain.FSDPConfig, got "
            f"{type(config).__name__}"
        )
    return FSDPStrategy(config)
