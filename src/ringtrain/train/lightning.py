"""``ray.train.lightning``'s names on ringtrain: a Ray Train script's Lightning lines run
unchanged::

    from ringtrain.train.lightning import (          # was: from ray.train.lightning import (
        RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer)

    trainer = pl.Trainer(devices="auto", accelerator="auto", strategy=RayDDPStrategy(),
                         plugins=[RayLightningEnvironment()], callbacks=[RayTrainReportCallback()])
    trainer = prepare_trainer(trainer)

``lightning.pytorch`` and ``pytorch_lightning`` are two packages with distinct classes, and a
Trainer of one refuses the other's plugins ("invalid type for plugin"). So each name here makes
an object of the package *your code* uses: the one of the two that is imported (when both are,
the one the calling module's globals hold, such as ``pl``; ``lightning.pytorch`` if that does
not tell). The objects come from :mod:`ringtrain.integrations.lightning_ray` or its twin
:mod:`ringtrain.integrations.pytorch_lightning_ray` (subclass those, not these names), and
``isinstance`` against these names holds for either. :func:`prepare_trainer` follows the
Trainer's package.

Importing this module needs one of the packages: ``pip install 'ringtrain[lightning]'``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any, ClassVar

if (
    importlib.util.find_spec("lightning") is None
    and importlib.util.find_spec("pytorch_lightning") is None
):
    raise ImportError(
        "ringtrain.train.lightning needs PyTorch Lightning 2.x (`lightning` or "
        "`pytorch_lightning`), which is not installed: pip install 'ringtrain[lightning]'"
    )

# Lightning package -> the bridge module built for it.
_BRIDGES = {
    "lightning.pytorch": "ringtrain.integrations.lightning_ray",
    "pytorch_lightning": "ringtrain.integrations.pytorch_lightning_ray",
}

__all__ = [
    "RayDDPStrategy",
    "RayDeepSpeedStrategy",
    "RayFSDPStrategy",
    "RayLightningEnvironment",
    "RayTrainReportCallback",
    "prepare_trainer",
]


def package_in_use(namespace: Mapping[str, Any] | None = None) -> str:
    """The Lightning package (``"lightning.pytorch"`` or ``"pytorch_lightning"``) that code
    with globals ``namespace`` uses: the only one imported; when both are, the one whose
    modules, classes or functions ``namespace`` holds; else ``lightning.pytorch`` (when
    installed)."""
    loaded = [name for name in _BRIDGES if name in sys.modules]
    if len(loaded) == 2 and namespace is not None:
        used = {name for value in namespace.values() for name in loaded if _belongs(value, name)}
        if len(used) == 1:
            return used.pop()
    if len(loaded) == 1:
        return loaded[0]
    if loaded or importlib.util.find_spec("lightning") is not None:
        return "lightning.pytorch"
    return "pytorch_lightning"


def _belongs(value: Any, package: str) -> bool:
    name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
    return isinstance(name, str) and (name == package or name.startswith(package + "."))


def bridge(package: str) -> ModuleType:
    """The Ray-named bridge module of Lightning package ``package``."""
    return importlib.import_module(_BRIDGES[package])


class _FollowsYourLightning(type):
    """The metaclass of the Ray names: calling one builds the object of the package in use."""

    _name: str

    def __new__(mcs, name: str, bases: tuple[type, ...], ns: dict[str, Any]) -> Any:
        if any(isinstance(b, _FollowsYourLightning) for b in bases):
            raise TypeError(
                f"class {name}({bases[0].__name__}): subclass the class of your Lightning "
                f"package instead, ringtrain.integrations.lightning_ray.{bases[0].__name__} "
                f"(lightning.pytorch) or ringtrain.integrations.pytorch_lightning_ray."
                f"{bases[0].__name__} (pytorch_lightning)"
            )
        cls = super().__new__(mcs, name, bases, ns)
        cls._name = name
        return cls

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        caller = sys._getframe(1).f_globals
        return getattr(bridge(package_in_use(caller)), cls._name)(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        return any(
            isinstance(obj, getattr(sys.modules[module], cls._name))
            for module in _BRIDGES.values()
            if module in sys.modules
        )

    def __getattr__(cls, attr: str) -> Any:  # class attributes: CHECKPOINT_NAME
        if attr.startswith("__"):
            raise AttributeError(attr)
        return getattr(getattr(bridge(package_in_use()), cls._name), attr)


class RayDDPStrategy(metaclass=_FollowsYourLightning):
    """Ray Train's ``RayDDPStrategy``: Lightning's ``DDPStrategy``, whose devices and node count
    :func:`prepare_trainer` sets from ringtrain's worker group."""


class RayFSDPStrategy(metaclass=_FollowsYourLightning):
    """Ray Train's ``RayFSDPStrategy``: Lightning's ``FSDPStrategy`` as ringtrain's
    ``RingtrainFSDPStrategy`` (which also runs on CPU workers)."""


class RayDeepSpeedStrategy(metaclass=_FollowsYourLightning):
    """Ray Train's ``RayDeepSpeedStrategy``: Lightning's ``DeepSpeedStrategy`` as ringtrain's
    ``RingtrainDeepSpeedStrategy`` (which also runs on CPU workers)."""


class RayLightningEnvironment(metaclass=_FollowsYourLightning):
    """Ray Train's ``RayLightningEnvironment``: ringtrain's ``RingtrainEnvironment`` (rank,
    world size and rendezvous address from ``ringtrain.get_context()``)."""


class RayTrainReportCallback(metaclass=_FollowsYourLightning):
    """Ray Train's ``RayTrainReportCallback``: ringtrain's ``RingtrainCallback`` (metrics and a
    checkpoint at the end of every training epoch). ``CHECKPOINT_NAME`` is the Lightning
    checkpoint's file name in it, for Ray's resume snippet."""

    CHECKPOINT_NAME: ClassVar[str] = "lightning.ckpt"


def prepare_trainer(trainer: Any) -> Any:
    """Ray Train's ``prepare_trainer``: ringtrain's ``prepare_trainer`` for the Trainer's
    Lightning package (checks the Trainer against the worker group, reconciles devices and
    nodes, and on a restart points it at the latest checkpoint; see docs/lightning.md).

    Raises:
        TypeError: ``trainer`` is not a Lightning ``Trainer``.
        ValueError: as ``ringtrain.integrations.lightning.prepare_trainer``.
    """
    module = type(trainer).__module__
    package = next((p for p in _BRIDGES if module == p or module.startswith(p + ".")), None)
    if package is None:
        raise TypeError(
            "prepare_trainer(trainer) takes a Lightning Trainer (lightning.pytorch or "
            f"pytorch_lightning), got {module}.{type(trainer).__name__}"
        )
    return bridge(package).prepare_trainer(trainer)
