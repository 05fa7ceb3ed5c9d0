"""Formatting values for people: durations, bytes, timestamps, metrics fitted to a width.
Shared by ``ringtrain ls``/``show`` (:mod:`ringtrain.monitor.render`) and the live progress
display; re-exported from :mod:`ringtrain.monitor.render`."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rich.text import Text

__all__ = [
    "fit_metrics",
    "format_bytes",
    "format_duration",
    "format_metrics",
    "format_timestamp",
    "format_value",
    "status_text",
    "truncate_middle",
]

_STATUS_STYLES = {
    "RUNNING": "bold cyan",
    "FINISHED": "green",
    "ERRORED": "bold red",
    "ABORTED": "yellow",
    "STOPPED": "magenta",
    "PREEMPTED": "bold blue",
    "UNKNOWN": "dim",
}

# --------------------------------------------------------------------------------------------
# Formatting
# --------------------------------------------------------------------------------------------


def format_duration(seconds: float | None) -> str:
    """Formats a duration for people.

    Args:
        seconds: The duration in seconds, or None.

    Returns:
        ``"-"`` for None or a non-finite value, ``"12.3s"`` under a minute, then ``"1m 32s"``,
        ``"2h 05m"`` and ``"3d 04h"``.
    """
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = max(0.0, float(seconds))
    if seconds < 59.95:  # what rounds to 60.0 is shown as "1m 00s"
        return f"{seconds:.1f}s"
    total = round(seconds)
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m {secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"


def format_value(value: Any, max_len: int = 40) -> str:
    """Formats one metric value: floats with 4 significant digits, other values as text.

    Args:
        value: The value.
        max_len: Longest result in characters; longer text is cut with an ellipsis.

    Returns:
        The formatted value, e.g. ``"0.1235"`` for ``0.123456`` and ``"3"`` for ``3``.
    """
    if isinstance(value, bool) or value is None:
        text = str(value)
    elif isinstance(value, float):
        text = f"{value:.4g}"
    elif isinstance(value, int):
        text = str(value)
    else:
        text = str(value)
    if len(text) > max_len:
        text = text[: max(1, max_len - 1)] + "…"
    return text


def format_metrics(
    metrics: Mapping[str, Any], max_items: int | None = None, first: Sequence[str] = ()
) -> str:
    """Formats metrics as ``key=value`` pairs separated by spaces.

    Args:
        metrics: The metrics.
        max_items: Show at most this many pairs, then ``(+N more)``; None shows all.
        first: Keys to put first when present (e.g. ``("epoch",)``); the rest keep their order.

    Returns:
        The formatted metrics, e.g. ``"epoch=2 loss=0.1234"``; empty for no metrics.
    """
    keys = [k for k in first if k in metrics]
    keys += [k for k in metrics if k not in keys]
    shown = keys if max_items is None else keys[:max_items]
    text = " ".join(f"{k}={format_value(metrics[k])}" for k in shown)
    if len(shown) < len(keys):
        text += f" (+{len(keys) - len(shown)} more)"
    return text


def format_bytes(size: int | None) -> str:
    """Formats a size in bytes with binary units, e.g. ``"1.5 KiB"``.

    Args:
        size: The size in bytes, or None.

    Returns:
        The formatted size; ``"-"`` for None.
    """
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - loop always returns


def format_timestamp(t: float | None, seconds: bool = True) -> str:
    """Formats a Unix time as local time, ``YYYY-mm-dd HH:MM:SS``.

    Args:
        t: The time, Unix time in seconds, or None.
        seconds: Whether to show the seconds.

    Returns:
        The formatted time; ``"-"`` for None.
    """
    if t is None or not math.isfinite(t):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M", time.localtime(t))


# --------------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------------


def status_text(status: str) -> Text:
    """``status`` styled; ``PREEMPTED`` says it is resumable (running it again continues it)."""
    shown = "PREEMPTED (resumable)" if status == "PREEMPTED" else status
    return Text(shown, style=_STATUS_STYLES.get(status, ""))


def truncate_middle(text: str, width: int) -> str:
    """Cuts ``text`` to ``width`` characters by replacing its middle with ``…``.

    The end is kept longer than the start: a default run name ends in its timestamp
    (``train_fn_2026-11-24_03-14-53``), which is what tells runs apart.

    Args:
        text: The text (one line).
        width: The most characters of the result; at least 1.

    Returns:
        ``text`` itself when it fits, else e.g. ``"train…4_03-14-53"``.
    """
    width = max(1, width)
    if len(text) <= width:
        return text
    if width < 4:
        return text[: width - 1] + "…"
    head = (width - 1) // 3
    tail = width - 1 - head
    return text[:head] + "…" + text[len(text) - tail :]


#: Metrics ``ls`` shows first, when present: progress, then the usual quality measures.
_USEFUL_FIRST = ("epoch", "step")
_USEFUL_WORDS = ("acc", "loss", "f1", "auc", "score", "ppl", "perplexity", "error")


def _useful_order(metrics: Mapping[str, Any]) -> list[str]:
    """The keys of ``metrics`` with progress and quality metrics first, timings last."""

    def rank(item: tuple[int, str]) -> tuple[int, int]:
        i, key = item
        low = key.lower()
        if key in _USEFUL_FIRST:
            return (0, _USEFUL_FIRST.index(key))
        if low.startswith(("val", "test", "eval")) and any(w in low for w in _USEFUL_WORDS):
            return (1, i)
        if any(w in low for w in _USEFUL_WORDS):
            return (2, i)
        if low.endswith(("_s", "_ms", "time", "per_s")):
            return (4, i)
        return (3, i)

    return [k for _, k in sorted(enumerate(metrics), key=rank)]


def fit_metrics(metrics: Mapping[str, Any], width: int) -> str:
    """As many whole ``key=value`` pairs as fit in ``width`` characters, most useful first.

    Args:
        metrics: The metrics.
        width: The room in characters.

    Returns:
        E.g. ``"epoch=9 val_acc=0.982 loss=0.05 +3"``: the pairs that fit, then ``+N`` for those
        left out (when that fits too); empty for no metrics.
    """
    keys = _useful_order(metrics)
    pairs = [f"{k}={format_value(metrics[k], 16)}" for k in keys]
    text = ""
    for i, pair in enumerate(pairs):
        candidate = f"{text} {pair}" if text else pair
        more = len(pairs) - i - 1
        room = width - (len(f" +{more}") if more else 0)
        if len(candidate) > room:
            rest = f"+{len(pairs) - i}"
            if not text:
                return truncate_middle(pair, width) if width >= len(pair) // 2 else rest
            return f"{text} {rest}" if len(text) + 1 + len(rest) <= width else text
        text = candidate
    return text
