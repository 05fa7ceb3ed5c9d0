"""Typed JSON records for the run directory: :class:`Record`, a frozen dataclass that writes the
same keys in field order (:meth:`Record.to_json`) and reads leniently (:meth:`Record.from_json`:
a field missing or of the wrong type in an older file takes its default). The record kinds
themselves are in :mod:`ringtrain.rundir.schema`.

No torch here.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, Union

__all__ = ["MISSING", "Record", "coerce"]

R = TypeVar("R", bound="Record")
MISSING = object()
"""What :func:`coerce` returns for a value that does not fit the type."""


def _key(f: dataclasses.Field[Any]) -> str:
    """A field's JSON key: its name, or ``metadata["key"]`` (``from`` is a Python keyword)."""
    return str(f.metadata.get("key", f.name))


Coerce = Callable[[Any], Any]
"""Turns a parsed JSON value into a field's type, or returns ``MISSING`` when it is not one."""


def _to_int(value: Any) -> Any:
    """Ints, integral floats and digit strings; never a bool."""
    if type(value) is int:
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return MISSING


def _to_float(value: Any) -> Any:
    """Finite ints and floats; never a bool."""
    if type(value) in (int, float) and math.isfinite(value):
        return float(value)
    return MISSING


def _to_bool(value: Any) -> Any:
    return value if value is True or value is False else MISSING


def _any(value: Any) -> Any:
    return value


def _instance_of(base: type) -> Coerce:
    def coerce(value: Any) -> Any:
        return base(value) if isinstance(value, base) else MISSING

    return coerce


def _optional(inner: list[Coerce], nullable: bool) -> Coerce:
    def coerce(value: Any) -> Any:
        if value is None:
            return None if nullable else MISSING
        for one in inner:
            found = one(value)
            if found is not MISSING:
                return found
        return MISSING

    return coerce


def _coercer(tp: Any) -> Coerce:
    """The :data:`Coerce` of a field annotation (``int``, ``float | None``, ``dict[str, Any]``,
    ``list[int]``, ``Any``, ...); elements of containers are not checked."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        return _optional([_coercer(a) for a in args if a is not type(None)], type(None) in args)
    simple: dict[Any, Coerce] = {int: _to_int, float: _to_float, bool: _to_bool, Any: _any}
    if tp in simple:
        return simple[tp]
    base = origin or tp
    if base in (dict, list, str):
        return _instance_of(base)
    raise TypeError(f"run directory records cannot hold a {tp!r} field")


def coerce(tp: Any, value: Any) -> Any:
    """``value`` as type ``tp``, or ``MISSING`` when it is not one."""
    return _coercer(tp)(value)


@dataclass(frozen=True)
class _FieldPlan:
    """How one field is read: its name, JSON key, coercion and whether it may be left out."""

    name: str
    key: str
    coerce: Coerce
    required: bool


_PLANS: dict[type, tuple[_FieldPlan, ...]] = {}


def _plan(cls: type) -> tuple[_FieldPlan, ...]:
    found = _PLANS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = _PLANS[cls] = tuple(
            _FieldPlan(
                f.name,
                _key(f),
                _coercer(hints[f.name]),
                f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
            )
            for f in dataclasses.fields(cls)
            if f.init
        )
    return found


@dataclass(frozen=True, kw_only=True)
class Record:
    """A JSON object of the run directory, typed. Subclasses are frozen dataclasses; a field's
    ``metadata`` may hold ``key`` (its JSON key when not its name) and ``omit_none`` (left out of
    the JSON when None: keys that only some writers add)."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to the run directory (keys in field order)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_none"):
                continue
            out[_key(f)] = value
        return out

    @classmethod
    def from_json(cls: type[R], obj: Mapping[str, Any]) -> R | None:
        """The record in ``obj`` (as parsed from the file), or None when a field without a
        default is missing or of the wrong type. Unknown keys are ignored."""
        values = cls._values(obj)
        return None if values is None else cls(**values)

    @classmethod
    def _values(cls, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The constructor's arguments read from ``obj`` (see :meth:`from_json`)."""
        values: dict[str, Any] = {}
        for field_ in _plan(cls):
            raw = obj.get(field_.key, MISSING)
            value = MISSING if raw is MISSING else field_.coerce(raw)
            if value is not MISSING:
                values[field_.name] = value
            elif field_.required:
                return None
            elif field_.name == "time":
                values["time"] = None  # an event's time is never made up when reading
        return values
