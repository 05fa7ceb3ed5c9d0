"""Helpers of the frozen, validated configs (:mod:`ringtrain.config`): errors that name the
field and the fix, raised from the user's own line."""

from __future__ import annotations

import functools
import os
from typing import Any, TypeVar

_Config = TypeVar("_Config", bound=type)


def short_errors(cls: _Config) -> _Config:
    """A config whose bad value raises from the user's own line: the ``TypeError`` /
    ``ValueError`` (its message names the field and the fix) loses the frames of the dataclass
    ``__init__``, ``__post_init__`` and the checks, so the user sees one ringtrain frame instead
    of four to six. ``RINGTRAIN_DEBUG=1`` keeps the whole traceback."""
    init = cls.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except (TypeError, ValueError) as exc:
            if os.environ.get("RINGTRAIN_DEBUG", "") not in ("", "0"):
                raise
            raise exc.with_traceback(None)  # noqa: B904 (the same exception, shorter)

    setattr(cls, "__init__", __init__)  # noqa: B010
    return cls


def check_int(owner: str, name: str, value: Any, minimum: int, fix: str) -> None:
    """Raise unless ``value`` is an int (not a bool) ``>= minimum``.

    Raises:
        TypeError: not an int, naming ``{owner}.{name}`` and ``fix``.
        ValueError: below ``minimum``, naming ``{owner}.{name}`` and ``fix``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(
            f"{owner}.{name} must be an int, got {type(value).__name__} {value!r} ({fix})"
        )
    if value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value} ({fix})")


def short_error(exc: BaseException) -> BaseException:
    """``exc`` without its traceback through ringtrain, for errors whose message is the whole
    story (configuration and usage errors): the user sees their own line and the fix. With
    ``RINGTRAIN_DEBUG=1`` the traceback is kept."""
    if os.environ.get("RINGTRAIN_DEBUG", "") not in ("", "0"):
        return exc
    return exc.with_traceback(None)
