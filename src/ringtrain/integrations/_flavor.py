"""The Lightning bridge for the ``pytorch_lightning`` package, made from the bridge's own source.

``lightning.pytorch`` and ``pytorch_lightning`` are two copies of one code base with distinct
classes: a ``pytorch_lightning.Trainer`` refuses a ``lightning.pytorch`` plugin ("invalid type
for plugin"), strategy or callback. So the bridge exists once per package: the modules
``ringtrain.integrations.lightning*`` import ``lightning.pytorch`` / ``lightning.fabric``, and
each ``ringtrain.integrations.pytorch_lightning*`` module runs its twin's source with those
imports (and the bridge's own module names) read as ``pytorch_lightning`` / ``lightning_fabric``
(:func:`run_twin`). Nothing else differs; line numbers in tracebacks are the twin's.
"""

from __future__ import annotations

import importlib.util
import re
from typing import Any

# (pattern, replacement), applied in order to the twin's source.
_RENAMES = (
    (r"\blightning\.pytorch\b", "pytorch_lightning"),
    (r"\blightning\.fabric\b", "lightning_fabric"),
    (r"\bringtrain\.integrations\.lightning", "ringtrain.integrations.pytorch_lightning"),
)
_LEFT_OVER = re.compile(r"^\s*(?:import lightning\b|from lightning\b)", re.MULTILINE)


def twin_source(twin: str) -> tuple[str, str]:
    """``(rewritten source, path)`` of module ``ringtrain.integrations.<twin>``.

    Raises:
        ImportError: if an import of the ``lightning`` package is left after the renames (a
            new import form this module does not know).
    """
    spec = importlib.util.find_spec(f"ringtrain.integrations.{twin}")
    if spec is None or spec.origin is None:
        raise ImportError(f"ringtrain.integrations.{twin} is missing")
    with open(spec.origin, encoding="utf-8") as f:
        source = f.read()
    for pattern, replacement in _RENAMES:
        source = re.sub(pattern, replacement, source)
    left = _LEFT_OVER.search(source)
    if left:
        raise ImportError(
            f"ringtrain.integrations.{twin}: {left.group(0).strip()!r} has no pytorch_lightning "
            "form (ringtrain.integrations._flavor)"
        )
    return source, spec.origin


def run_twin(namespace: dict[str, Any], twin: str) -> None:
    """Run the rewritten source of ``ringtrain.integrations.<twin>`` in ``namespace`` (a
    module's ``globals()``): its classes and functions become that module's."""
    source, path = twin_source(twin)
    exec(compile(source, path, "exec", dont_inherit=True), namespace)
