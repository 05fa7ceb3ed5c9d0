"""Mixed precision: autocast on the prepared model, loss scaling for fp16.

``prepare_model(model, precision=...)`` takes the names Lightning uses:

- ``"32"`` (default): nothing changes.
- ``"bf16-mixed"``: the model's forward runs under ``torch.autocast(device, torch.bfloat16)``
  (CPU and CUDA); parameters, gradients and optimizer state stay float32. bf16 has float32's
  exponent range, so no loss scaling is needed.
- ``"16-mixed"``: the forward runs under ``torch.autocast(device, torch.float16)``; fp16
  gradients underflow without loss scaling, so the loss is multiplied by a dynamic scale before
  backward and the gradients divided by it before the step (``torch.amp.GradScaler``, Micikevicius
  et al., "Mixed Precision Training", ICLR 2018).

Floating outputs of the forward are cast back to float32, so the loss is computed in float32 (as
Accelerate's ``convert_outputs_to_fp32`` and Lightning Fabric do). The loop stays that of plain
PyTorch with two names familiar from Ray Train and Accelerate::

    model = rt.prepare_model(net, precision="16-mixed")
    optimizer = rt.prepare_optimizer(torch.optim.AdamW(model.parameters()))
    state = rt.TrainState(model=model, optimizer=optimizer)  # saves the GradScaler too
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        rt.backward(loss)        # scaler.scale(loss).backward()
        optimizer.step()         # scaler.step(optimizer); scaler.update()

Under ``"32"`` and ``"bf16-mixed"`` ``rt.backward(loss)`` is ``loss.backward()`` and the
prepared optimizer is a pass-through, so the same loop serves every precision.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ringtrain.worker.hooks import ModelSetup, WorkerPlugin

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
"""The values of ``prepare_model(precision=...)``."""

_ALIASES = {"32-true": "32", "32": "32", "bf16-mixed": "bf16-mixed", "16-mixed": "16-mixed"}


def normalize_precision(precision: Any) -> str:
    """``precision`` as one of :data:`PRECISIONS` (``"32-true"`` and ``32`` mean ``"32"``).

    Raises:
        ValueError: for anything else, naming the accepted values.
    """
    key = (
        str(precision)
        if isinstance(precision, int) and not isinstance(precision, bool)
        else precision
    )
    if not isinstance(key, str) or key not in _ALIASES:
        raise ValueError(
            f"precision={precision!r} is not supported (use '32', 'bf16-mixed' or '16-mixed')"
        )
    return _ALIASES[key]


def check_precision(precision: str, device: torch.device) -> None:
    """Raise a clear error if ``device`` cannot run ``precision``.

    Raises:
        ValueError: autocast is not available for ``device.type``, or the dtype is not supported
            by autocast there (e.g. bf16 on a GPU without bf16 support).
    """
    if precision == "32":
        return
    from torch.amp.autocast_mode import is_autocast_available

    if not is_autocast_available(device.type):
        raise ValueError(
            f"precision={precision!r}: torch.autocast is not available on {device.type} "
            "(use precision='32')"
        )
    if precision == "bf16-mixed" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision='bf16-mixed': {torch.cuda.get_device_name(device)} does not support "
            "bfloat16 (use precision='16-mixed')"
        )
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    try:
        with torch.autocast(device.type, dtype=dtype):
            pass
    except (RuntimeError, ValueError) as exc:  # torch rejects the dtype on this device
        raise ValueError(
            f"precision={precision!r} is not supported on {device.type} by this torch "
            f"({torch.__version__}): {exc} (use precision='32' or 'bf16-mixed')"
        ) from exc


def _to_float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, dict):
        return type(value)({k: _to_float32(v) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_to_float32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_to_float32(v) for v in value)
    return value


class AutocastHooks:
    """Forward hooks that run a module's forward under ``torch.autocast`` and cast its floating
    outputs to float32. Hooks (not a replaced ``forward``) keep the module picklable and
    ``copy.deepcopy``-able, and leave its ``state_dict`` keys unchanged."""

    def __init__(self, device_type: str, dtype: torch.dtype) -> None:
        self.device_type = device_type
        self.dtype = dtype
        self._entered: list[Any] = []

    def pre(self, _module: Any, _args: Any) -> None:
        ctx = torch.autocast(self.device_type, dtype=self.dtype)
        ctx.__enter__()
        self._entered.append(ctx)

    def post(self, _module: Any, _args: Any, output: Any) -> Any:
        if self._entered:  # always_call: also after an exception in forward
            self._entered.pop().__exit__(None, None, None)
        return _to_float32(output) if output is not None else None


def apply_precision(module: torch.nn.Module, precision: str, device: torch.device) -> None:
    """Make ``module``'s forward run in ``precision`` on ``device`` (no-op for ``"32"``)."""
    if precision == "32":
        return
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16
    hooks = AutocastHooks(device.type, dtype)
    module.register_forward_pre_hook(hooks.pre, prepend=True)
    module.register_forward_hook(hooks.post, always_call=True)


class PrecisionPlugin(WorkerPlugin):
    """Precision as a worker plug-in (:mod:`ringtrain.worker.hooks`, the ``before_wrap`` hook): one
    per worker session, found or registered by :func:`precision_plugin`, so that what it holds goes
    with the session (no module-level state).

    ``prepare_model`` registers it (when a precision other than ``"32"`` is asked) and passes the
    precision in ``ModelSetup.precision`` to the ``before_wrap`` hooks: this one records it and
    puts the autocast hooks on the placed, unwrapped module.
    :func:`prepare_optimizer` reads :attr:`precision` as its default and records the optimizer
    that :func:`backward` scales the loss for.

    Attributes:
        precision: the precision of the last ``prepare_model`` of this worker (``"32"`` before).
        optimizer: the most recent :class:`PreparedOptimizer`, or ``None``.
    """

    def __init__(self) -> None:
        self.precision = "32"
        self.optimizer: PreparedOptimizer | None = None

    def before_wrap(self, setup: ModelSetup) -> None:
        self.precision = setup.precision
        apply_precision(setup.module, setup.precision, setup.device)


def precision_plugin() -> PrecisionPlugin:
    """This worker session's :class:`PrecisionPlugin` (registered on first use)."""
    from ringtrain.worker.session import current_hooks

    hooks = current_hooks()
    plugin = hooks.find(PrecisionPlugin)
    if plugin is None:
        plugin = PrecisionPlugin()
        hooks.register(plugin)
    return plugin


class PreparedOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step()`` applies loss scaling under ``precision="16-mixed"`` and then
    runs the worker's ``on_optimizer_step`` hooks (:mod:`ringtrain.worker.hooks`: DiLoCo's outer
    sync, :mod:`ringtrain.parallel.diloco`).

    With a GradScaler, ``step()`` unscales the gradients, skips the update when any is inf/NaN
    (and then lowers the scale), and updates the scale; ``param_groups``, ``state``,
    ``state_dict()`` and ``zero_grad()`` are the wrapped optimizer's, so LR schedulers and
    checkpoints see the original. Without one it is a pass-through.

    Attributes:
        optimizer: the wrapped ``torch.optim.Optimizer``.
        grad_scaler: the ``torch.amp.GradScaler``, or ``None`` outside ``"16-mixed"``.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, grad_scaler: torch.amp.GradScaler | None
    ) -> None:
        # No super().__init__: the wrapped optimizer owns the parameters and the step hooks.
        self.optimizer = optimizer
        self.grad_scaler = grad_scaler
        self._scaled = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step (with ``grad_scaler``: unscale, skip on inf/NaN, update).

        Raises:
            RuntimeError: under ``"16-mixed"``, if no ``rt.backward(loss)`` ran since the last
                step (a bare ``loss.backward()`` leaves the gradients unscaled, and the step
                would divide them by the scale).
            ValueError: a ``closure`` under ``"16-mixed"`` (GradScaler does not support one).
        """
        result = self._step(closure)
        from ringtrain.worker.session import current_hooks

        current_hooks().on_optimizer_step(self)  # DiLoCo's outer sync (ringtrain.parallel)
        return result

    def _step(self, closure: Callable[[], Any] | None) -> Any:
        scaler = self.grad_scaler
        if scaler is None:
            return self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        if closure is not None:
            raise ValueError(
                "optimizer.step(closure) is not supported with precision='16-mixed' "
                "(GradScaler cannot re-evaluate a closure; use precision='bf16-mixed')"
            )
        if not self._scaled:
            raise RuntimeError(
                "precision='16-mixed': call rt.backward(loss) instead of loss.backward() so that "
                "the loss is scaled before optimizer.step()"
            )
        self._scaled = False
        result = scaler.step(self.optimizer)
        scaler.update()
        return result

    def unscale_(self) -> None:
        """Divide the gradients by the current scale now (before clipping them, e.g.
        ``torch.nn.utils.clip_grad_norm_``); ``step()`` then does not unscale again. A no-op
        without a GradScaler."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (the GradScaler's is saved by TrainState as
        ``grad_scaler``)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        scaler = "GradScaler" if self.grad_scaler is not None else "no scaler"
        return f"PreparedOptimizer({self.optimizer!r}, {scaler})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def prepare_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    precision: str | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
) -> PreparedOptimizer:
    """Wrap ``optimizer`` for the precision of the prepared model (loss scaling for fp16).

    Call it after :func:`ringtrain.prepare_model`, and call :func:`backward` instead of
    ``loss.backward()``: it scales the loss with the GradScaler of the most recently prepared
    optimizer of this worker. One prepared optimizer per loop under ``"16-mixed"``; with several
    optimizers, drive one ``torch.amp.GradScaler`` by hand (``scale``, ``step`` each, ``update``
    once). Pass the result to ``TrainState(optimizer=...)``: its GradScaler is
    saved and restored with it (exact resume).

    Args:
        optimizer: a ``torch.optim.Optimizer`` over the prepared model's parameters.
        precision: default: the precision given to the last ``prepare_model`` of this worker
            (``"32"`` if none).
        grad_scaler: a ``torch.amp.GradScaler`` you built (its ``init_scale``,
            ``growth_interval``...); default ``torch.amp.GradScaler(device)`` under
            ``"16-mixed"``.

    Returns:
        A :class:`PreparedOptimizer` (a ``torch.optim.Optimizer``).

    Raises:
        ValueError: an unknown precision, or ``grad_scaler`` outside ``"16-mixed"``.
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``.
    """
    from ringtrain.worker.session import get_context

    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"prepare_optimizer expects a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, PreparedOptimizer):
        return optimizer
    plugin = precision_plugin()
    resolved = normalize_precision(precision if precision is not None else plugin.precision)
    if grad_scaler is not None and resolved != "16-mixed":
        raise ValueError(
            f"prepare_optimizer(grad_scaler=...) only applies to precision='16-mixed', got "
            f"{resolved!r} (bf16 and fp32 need no loss scaling; drop grad_scaler)"
        )
    scaler = None
    if resolved == "16-mixed":
        scaler = grad_scaler or torch.amp.GradScaler(get_context().device.type)
    prepared = PreparedOptimizer(optimizer, scaler)
    plugin.optimizer = prepared  # rt.backward scales for the latest prepared optimizer
    from ringtrain.worker.session import current_hooks

    current_hooks().on_prepare_optimizer(prepared)  # DiLoCo adopts its inner optimizer
    return prepared


def backward(loss: torch.Tensor, **kwargs: Any) -> None:
    """``loss.backward(**kwargs)``, with the loss scaled first under ``precision="16-mixed"``.

    Args:
        loss: a scalar tensor (shape ``()``).
        **kwargs: passed to ``Tensor.backward`` (``retain_graph``...).
    """
    prepared = precision_plugin().optimizer
    if prepared is None or prepared.grad_scaler is None:
        loss.backward(**kwargs)
        return
    prepared.grad_scaler.scale(loss).backward(**kwargs)
    prepared._scaled = True
