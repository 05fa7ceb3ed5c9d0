"""The backend-specific fields of :class:`~ringtrain.config.ScalingConfig`, as pure rules.

``ScalingConfig(backend="local" | "ray")`` names a backend; the fields that only make sense for
one of them (``placement_strategy``, ``ray_address``, ``placement_timeout_s``, custom
``resources_per_worker`` keys) are checked here when the config is built, before any process
starts. The backends themselves (launching, the host check, capacity) are objects in
:mod:`ringtrain.launch.backends`, one class per name in :data:`BACKENDS`; this module imports
no launcher (the config layer sits below it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringtrain.config.run import ScalingConfig

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray placement group strategies (``backend="ray"``), as Ray names them."""

_BUILTIN_RESOURCES = ("CPU", "GPU")


def _unknown_resource(key: Any) -> ValueError:
    return ValueError(
        f"ScalingConfig.resources_per_worker has unknown resource {key!r} "
        "(use 'CPU' for threads per worker, 'GPU' for devices per worker; "
        "custom Ray resources need backend='ray')"
    )


def _check_ray_values(scaling: ScalingConfig) -> None:
    """The Ray fields' values, whichever backend (a typo is named even where they do not
    apply)."""
    if scaling.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(
            "ScalingConfig.placement_strategy must be one of "
            f"{', '.join(map(repr, PLACEMENT_STRATEGIES))}, got {scaling.placement_strategy!r} "
            "(PACK fills as few nodes as possible, SPREAD as many)"
        )
    address = scaling.ray_address
    if address is not None:
        if not isinstance(address, str) or not address:
            raise ValueError(
                f"ScalingConfig.ray_address must be 'auto', 'HOST:PORT' or None, got {address!r}"
            )
        if address.startswith("ray://"):
            raise ValueError(
                f"ScalingConfig.ray_address={address!r}: Ray Client (ray://) is not "
                "supported, because every worker connects back to the driver; run the "
                "driver on a node of the cluster with ray_address='auto'"
            )
    t = scaling.placement_timeout_s
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t != t:
        raise ValueError(
            f"ScalingConfig.placement_timeout_s must be a positive number of seconds, got {t!r}"
        )


def _check_local(s: ScalingConfig) -> None:
    """``backend="local"``: only ``CPU`` and ``GPU`` resources; the Ray-only fields at their
    defaults."""
    for key in s.resources_per_worker or {}:
        if key not in _BUILTIN_RESOURCES:
            raise _unknown_resource(key)
    _check_ray_values(s)
    if s.ray_address is not None:
        raise ValueError(
            f"ScalingConfig.ray_address={s.ray_address!r} needs backend='ray', got "
            f"backend={s.backend!r}"
        )
    if s.placement_strategy != "PACK":
        raise ValueError(
            f"ScalingConfig.placement_strategy={s.placement_strategy!r} needs "
            f"backend='ray', got backend={s.backend!r}"
        )


def _check_ray(s: ScalingConfig) -> None:
    """``backend="ray"``: custom resources are non-empty names; the Ray fields are valid
    values."""
    for key in s.resources_per_worker or {}:
        if key not in _BUILTIN_RESOURCES and (not isinstance(key, str) or not key):
            raise _unknown_resource(key)
    _check_ray_values(s)
    spares = s.spares
    if isinstance(spares, int) and not isinstance(spares, bool) and spares > 0:
        raise ValueError(
            f"ScalingConfig(spares={spares}) with backend='ray': hot spares are built for the "
            "local backend only (on Ray a spare needs its own placement bundle and actor "
            "hand-over: not built yet); use backend='local' for spares, or on Ray spares=0 "
            "with num_workers=(min, max), which shrinks in place and grows back to max"
        )


FIELD_RULES: Mapping[str, Callable[[ScalingConfig], None]] = {
    "local": _check_local,
    "ray": _check_ray,
}
"""``ScalingConfig.backend`` value -> the check of its backend-specific fields."""

BACKENDS = tuple(FIELD_RULES)
"""Launcher backends known to this version (:mod:`ringtrain.launch.backends` has one class
each)."""


def check_backend_name(scaling: ScalingConfig) -> None:
    """Raises:
    ValueError: ``scaling.backend`` is not a known backend, naming the known ones."""
    if not isinstance(scaling.backend, str) or scaling.backend not in FIELD_RULES:
        raise ValueError(
            f"ScalingConfig.backend must be one of {', '.join(map(repr, BACKENDS))}, "
            f"got {scaling.backend!r} (use backend='local' to run on this machine)"
        )


def check_backend_fields(scaling: ScalingConfig) -> None:
    """Reject the config's backend-specific fields (pure; no process, no Ray).

    Raises:
        ValueError: naming the field and the fix.
    """
    FIELD_RULES[scaling.backend](scaling)
