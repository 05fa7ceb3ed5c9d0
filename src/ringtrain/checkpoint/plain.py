"""What a checkpoint file may hold: tensors and plain data, which ``torch.load(weights_only=True)``
reads back without running code (every checkpoint ringtrain writes or loads is such a file)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
"""The leaf types a weights-only file holds, besides tensors (checked exactly, not by
``isinstance``)."""


def find_unsavable(value: Any, where: str, depth: int = 0) -> str | None:
    """The first place in ``value`` that ``torch.load(weights_only=True)`` could not read back.

    Types are checked exactly: a subclass of ``float`` (``np.float64``), of ``int`` (an
    ``IntEnum``), of ``tuple`` (a namedtuple) or of ``dict`` (``defaultdict``) pickles as its own
    class, which a weights-only load refuses.
    """
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in PLAIN:
        return None
    if depth > 64:
        return f"{where} is nested too deeply"
    if kind in (dict, OrderedDict):
        for k, v in value.items():
            if type(k) not in (str, int, float, bool, type(None)):
                return f"{where} has a key of type {type(k).__name__}"
            found = find_unsavable(v, f"{where}[{k!r}]", depth + 1)
            if found:
                return found
        return None
    if kind in (list, tuple, set):
        for i, v in enumerate(value):
            found = find_unsavable(v, f"{where}[{i}]", depth + 1)
            if found:
                return found
        return None
    # np.int64 / np.float32 scalars are not int/float subclasses, but convert the same way.
    scalar = kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0
    hint = " (convert it with float()/int())" if scalar or isinstance(value, (int, float)) else ""
    return f"{where} is a {kind.__module__}.{kind.__qualname__}{hint}"


def weights_only_refusal(exc: BaseException) -> str:
    """The line of a ``torch.load(weights_only=True)`` error that says what it refused (torch's
    message is a page of advice; the line naming the global is the one that matters)."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()] or [""]
    for i, line in enumerate(lines):
        if "WeightsUnpickler error" in line:
            why = line[line.index("WeightsUnpickler error") :]
            if why.rstrip(":").endswith("error") and i + 1 < len(lines):
                why = f"{why.rstrip(': ')}: {lines[i + 1]}"  # the reason is on the next line
            return f"{type(exc).__name__}: {why}"
    return f"{type(exc).__name__}: {lines[0]}"
