"""The domains of a search space: what ``uniform``, ``randint``, ``choice``, ``grid_search``...
return, each mapped onto an Optuna distribution.

The helpers follow Ray Tune's semantics (``randint`` excludes ``high``, ``qrandint`` includes it)
and check their arguments when called, so a bad domain fails at the line that makes it.
``choice`` and ``grid_search`` accept any values: Optuna's ``CategoricalDistribution`` stores only
``None``, bool, int, float and str, so other values (lists, dicts, objects), and categories that
compare equal (``[1, 1.0, True]``), are stored as their index and decoded back.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

_PRIMITIVE = (type(None), bool, int, float, str)
GRID_FIX = "use search_alg='random' or 'tpe', or grid_search([...]) with the values to visit"


class Domain(abc.ABC):
    """A searched dimension of a space, made by :func:`uniform`, :func:`choice`, ... ."""

    @abc.abstractmethod
    def distribution(self) -> BaseDistribution:
        """The Optuna distribution the sampler draws from (categories encoded)."""

    def encode(self, value: Any) -> Any:
        """``value`` as Optuna stores it (the index of a non-primitive category)."""
        return value

    def decode(self, value: Any) -> Any:
        """The config value of an Optuna parameter value."""
        return value


def _number(fn: str, name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TypeError(f"{fn}(): {name} must be a finite number, got {v!r}")
    return float(v)


def _integer(fn: str, name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{fn}(): {name} must be an int, got {v!r} (use uniform() for floats)")
    return v


def _decimals(x: float) -> int:
    exponent = Decimal(repr(x)).as_tuple().exponent
    return max(0, -exponent) if isinstance(exponent, int) else 0


@dataclass(frozen=True)
class FloatDomain(Domain):
    low: float
    high: float
    log: bool = False
    step: float | None = None
    kind: str = field(default="uniform", compare=False)

    def __post_init__(self) -> None:
        lo = _number(self.kind, "low", self.low)
        hi = _number(self.kind, "high", self.high)
        if not lo < hi:
            raise ValueError(
                f"{self.kind}(low={self.low!r}, high={self.high!r}): low must be < high "
                "(for a fixed value, use a constant)"
            )
        if self.log and lo <= 0:
            raise ValueError(
                f"{self.kind}(low={self.low!r}, ...): low must be > 0 on a log scale, got "
                f"{self.low!r} (use uniform() for a range that includes 0)"
            )
        if self.step is not None and _number(self.kind, "q", self.step) <= 0:
            raise ValueError(f"{self.kind}(q={self.step!r}): q must be > 0")

    def distribution(self) -> BaseDistribution:
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)

    def decode(self, value: Any) -> Any:
        if self.step is None:
            return value
        # low + k*q in binary floating point (0.30000000000000004): round to q's decimals.
        return round(float(value), max(_decimals(self.step), _decimals(self.low)))

    def __repr__(self) -> str:
        q = f", {self.step!r}" if self.step is not None else ""
        return f"{self.kind}({self.low!r}, {self.high!r}{q})"


@dataclass(frozen=True)
class IntDomain(Domain):
    low: int
    high: int  # inclusive (randint/lograndint convert Ray Tune's exclusive bound)
    log: bool = False
    step: int = 1
    kind: str = field(default="randint", compare=False)

    def __post_init__(self) -> None:
        _integer(self.kind, "low", self.low)
        _integer(self.kind, "high", self.high)
        _integer(self.kind, "q", self.step)
        if self.low > self.high:
            shown = self.high + 1 if self.kind != "qrandint" else self.high
            extra = " (high is exclusive)" if self.kind != "qrandint" else ""
            raise ValueError(
                f"{self.kind}(low={self.low!r}, high={shown!r}): low must be < high{extra}"
            )
        if self.log and self.low < 1:
            raise ValueError(f"{self.kind}(low={self.low!r}, ...): low must be >= 1 (log scale)")
        if self.step < 1:
            raise ValueError(f"{self.kind}(q={self.step!r}): q must be >= 1")

    def distribution(self) -> BaseDistribution:
        return IntDistribution(self.low, self.high, log=self.log, step=self.step)

    def decode(self, value: Any) -> Any:
        return int(value)

    def __repr__(self) -> str:
        if self.kind == "qrandint":
            return f"qrandint({self.low}, {self.high}, {self.step})"
        return f"{self.kind}({self.low}, {self.high + 1})"


@dataclass(frozen=True)
class ChoiceDomain(Domain):
    categories: tuple[Any, ...]
    kind: str = field(default="choice", compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.categories, str | bytes) or not isinstance(self.categories, Sequence):
            raise TypeError(f"{self.kind}() takes a list of values, got {self.categories!r}")
        object.__setattr__(self, "categories", tuple(self.categories))
        if not self.categories:
            raise ValueError(
                f"{self.kind}([]) needs at least one value (for a fixed value, use a constant)"
            )

    @property
    def encoded(self) -> bool:
        """Whether Optuna stores the categories' indices instead of the values."""
        cats = self.categories
        return not all(isinstance(c, _PRIMITIVE) for c in cats) or len(set(cats)) != len(cats)

    def distribution(self) -> BaseDistribution:
        if self.encoded:
            return CategoricalDistribution(tuple(range(len(self.categories))))
        return CategoricalDistribution(self.categories)

    def encode(self, value: Any) -> Any:
        if not self.encoded:
            return value
        for i, c in enumerate(self.categories):  # identity first: [1, True] are == but distinct
            if c is value:
                return i
        for i, c in enumerate(self.categories):
            try:
                if bool(c == value):
                    return i
            except (TypeError, ValueError):  # arrays and other values without a bool ==
                continue
        raise ValueError(f"{value!r} is not one of {self!r}")

    def decode(self, value: Any) -> Any:
        if not self.encoded:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{value!r} is not an index of {self!r}")
        i = int(value)
        if not 0 <= i < len(self.categories) or i != value:
            raise ValueError(
                f"{value!r} is not an index of {self!r}: was param_space changed since the "
                "study was created? Use a new RunConfig.name for a different space"
            )
        return self.categories[i]

    def __repr__(self) -> str:
        return f"{self.kind}({list(self.categories)!r})"


@dataclass(frozen=True, repr=False)
class GridDomain(ChoiceDomain):
    """``grid_search``: every value is visited."""

    kind: str = field(default="grid_search", compare=False)


@dataclass(frozen=True)
class RawDomain(Domain):
    """An Optuna distribution given as a ``param_space`` leaf."""

    dist: BaseDistribution

    def distribution(self) -> BaseDistribution:
        return self.dist

    def __repr__(self) -> str:
        return repr(self.dist)


def uniform(low: float, high: float) -> Domain:
    """A float drawn uniformly from ``[low, high]`` (``FloatDistribution(low, high)``).

    Raises:
        TypeError: a bound is not a finite number.
        ValueError: ``low >= high``.
    """
    return FloatDomain(low, high, kind="uniform")


def loguniform(low: float, high: float) -> Domain:
    """A float drawn uniformly in log space from ``[low, high]``, for learning rates and weight
    decays (``FloatDistribution(low, high, log=True)``).

    Raises:
        TypeError: a bound is not a finite number.
        ValueError: ``low <= 0`` or ``low >= high``.
    """
    return FloatDomain(low, high, log=True, kind="loguniform")


def quniform(low: float, high: float, q: float) -> Domain:
    """A float from ``{low, low + q, low + 2q, ...} <= high`` (``FloatDistribution(low, high,
    step=q)``; Optuna lowers ``high`` to the last multiple, with a warning, when ``high - low``
    is not one). Values are rounded to ``q``'s decimals (``0.3``, not ``0.30000000000000004``).

    Raises:
        TypeError: an argument is not a finite number.
        ValueError: ``low >= high`` or ``q <= 0``.
    """
    return FloatDomain(low, high, step=q, kind="quniform")


def randint(low: int, high: int) -> Domain:
    """An int from ``low`` to ``high - 1`` (``high`` exclusive, as Ray Tune's ``randint`` and
    Python's ``range``; ``IntDistribution(low, high - 1)``).

    Raises:
        TypeError: a bound is not an int.
        ValueError: ``low >= high``.
    """
    return IntDomain(low, _integer("randint", "high", high) - 1, kind="randint")


def lograndint(low: int, high: int) -> Domain:
    """An int from ``low`` to ``high - 1`` drawn in log space (``low >= 1``; ``high`` exclusive,
    as Ray Tune; ``IntDistribution(low, high - 1, log=True)``).

    Raises:
        TypeError: a bound is not an int.
        ValueError: ``low < 1`` or ``low >= high``.
    """
    return IntDomain(low, _integer("lograndint", "high", high) - 1, log=True, kind="lograndint")


def qrandint(low: int, high: int, q: int = 1) -> Domain:
    """An int from ``{low, low + q, ...} <= high`` (``high`` inclusive, as Ray Tune's
    ``qrandint``; ``IntDistribution(low, high, step=q)``).

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``low > high`` or ``q < 1``.
    """
    return IntDomain(low, high, step=q, kind="qrandint")


def choice(categories: Sequence[Any]) -> Domain:
    """One of ``categories``, chosen by the sampler (``CategoricalDistribution``). Values may be
    anything (numbers, strings, lists, dicts, objects); repeating a value makes it likelier.

    Raises:
        TypeError: ``categories`` is not a list or tuple.
        ValueError: it is empty.
    """
    return ChoiceDomain(categories, kind="choice")  # type: ignore[arg-type]


def grid_search(values: Sequence[Any]) -> Domain:
    """Every one of ``values`` is run, ``num_samples`` times each and crossed with the other grid
    axes, as Ray Tune's ``grid_search``.

    Raises:
        TypeError: ``values`` is not a list or tuple.
        ValueError: it is empty.
    """
    return GridDomain(values, kind="grid_search")  # type: ignore[arg-type]
