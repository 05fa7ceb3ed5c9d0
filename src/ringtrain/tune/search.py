"""Search spaces, mapped onto Optuna distributions, and the samplers that search them.

``param_space`` is a (nested) dict whose leaves are domains (``uniform``, ``loguniform``,
``quniform``, ``randint``, ``choice``, ``grid_search``) or constants. :func:`build_space`
flattens it (nested keys joined with ``/``) into a :class:`SearchSpace`: Optuna distributions
for the sampled dimensions, grid axes, and constants. Each trial's nested ``config`` is rebuilt
from the Optuna trial's parameters (:meth:`SearchSpace.config`).

``choice`` accepts any values. Optuna's ``CategoricalDistribution`` stores only ``None``, bool,
int, float and str, so other values (lists, dicts, tuples) are stored as their index and decoded
back.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

SEARCH_ALGS = ("tpe", "random", "grid", "cmaes", "qmc")
_PRIMITIVE = (type(None), bool, int, float, str)


class Domain:
    """A sampled dimension of a search space (made by the helpers below)."""

    def distribution(self) -> BaseDistribution:  # pragma: no cover - overridden
        raise NotImplementedError

    def decode(self, value: Any) -> Any:
        """The config value of a stored Optuna parameter value."""
        return value


@dataclass(frozen=True)
class _Float(Domain):
    low: float
    high: float
    log: bool = False
    step: float | None = None

    def distribution(self) -> BaseDistribution:
        return FloatDistribution(self.low, self.high, log=self.log, step=self.step)


@dataclass(frozen=True)
class _Int(Domain):
    low: int
    high: int  # inclusive (the helpers convert Ray Tune's exclusive bound)
    log: bool = False
    step: int = 1

    def distribution(self) -> BaseDistribution:
        return IntDistribution(self.low, self.high, log=self.log, step=self.step)


@dataclass(frozen=True)
class _Choice(Domain):
    categories: tuple[Any, ...]
    encoded: bool = field(default=False)

    def distribution(self) -> BaseDistribution:
        if self.encoded:
            return CategoricalDistribution(tuple(range(len(self.categories))))
        return CategoricalDistribution(self.categories)

    def encode(self, value: Any) -> Any:
        if not self.encoded:
            return value
        for i, c in enumerate(self.categories):
            if c == value:
                return i
        raise ValueError(f"{value!r} is not one of {list(self.categories)}")

    def decode(self, value: Any) -> Any:
        return self.categories[int(value)] if self.encoded else value


@dataclass(frozen=True)
class _Grid(_Choice):
    """``grid_search``: every value is visited."""


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise TypeError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _integer(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an int, got {v!r}")
    return v


def _bounds(fn: str, low: float, high: float) -> None:
    if not low < high:
        raise ValueError(f"{fn}(low={low!r}, high={high!r}): low must be < high")


def uniform(low: float, high: float) -> Domain:
    """A float drawn uniformly from ``[low, high]``."""
    lo, hi = _number("uniform low", low), _number("uniform high", high)
    _bounds("uniform", lo, hi)
    return _Float(lo, hi)


def loguniform(low: float, high: float) -> Domain:
    """A float drawn uniformly in log space from ``[low, high]`` (``low > 0``), for learning rates
    and weight decays."""
    lo, hi = _number("loguniform low", low), _number("loguniform high", high)
    if lo <= 0:
        raise ValueError(f"loguniform(low={low!r}, ...): low must be > 0 (log scale)")
    _bounds("loguniform", lo, hi)
    return _Float(lo, hi, log=True)


def quniform(low: float, high: float, q: float) -> Domain:
    """A float from ``[low, high]`` on the grid ``low + k*q``."""
    lo, hi, step = _number("quniform low", low), _number("quniform high", high), _number("q", q)
    _bounds("quniform", lo, hi)
    if step <= 0:
        raise ValueError(f"quniform(q={q!r}): q must be > 0")
    return _Float(lo, hi, step=step)


def randint(low: int, high: int) -> Domain:
    """An int from ``low`` to ``high - 1`` (``high`` exclusive, as Ray Tune's ``randint`` and
    Python's ``range``)."""
    lo, hi = _integer("randint low", low), _integer("randint high", high)
    _bounds("randint", lo, hi)
    return _Int(lo, hi - 1)


def lograndint(low: int, high: int) -> Domain:
    """An int from ``low`` to ``high - 1`` drawn in log space (``low >= 1``)."""
    lo, hi = _integer("lograndint low", low), _integer("lograndint high", high)
    if lo < 1:
        raise ValueError(f"lograndint(low={low!r}, ...): low must be >= 1 (log scale)")
    _bounds("lograndint", lo, hi)
    return _Int(lo, hi - 1, log=True)


def qrandint(low: int, high: int, q: int = 1) -> Domain:
    """An int from ``low`` to ``high`` (inclusive, as Ray Tune's ``qrandint``) in steps of ``q``."""
    lo, hi, step = _integer("qrandint low", low), _integer("qrandint high", high), _integer("q", q)
    _bounds("qrandint", lo, hi)
    if step < 1:
        raise ValueError(f"qrandint(q={q!r}): q must be >= 1")
    return _Int(lo, hi, step=step)


def _categories(fn: str, values: Any) -> tuple[tuple[Any, ...], bool]:
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise TypeError(f"{fn}() takes a list of values, got {values!r}")
    cats = tuple(values)
    if not cats:
        raise ValueError(f"{fn}([]) needs at least one value")
    encoded = not all(isinstance(c, _PRIMITIVE) for c in cats) or len(set(map(repr, cats))) != len(
        cats
    )
    return cats, encoded


def choice(categories: Sequence[Any]) -> Domain:
    """One of ``categories``, chosen by the sampler (any values: numbers, strings, lists, dicts)."""
    cats, encoded = _categories("choice", categories)
    return _Choice(cats, encoded)


def grid_search(values: Sequence[Any]) -> Domain:
    """Every one of ``values`` is run (``num_samples`` times each, crossed with the other grid
    axes), as Ray Tune's ``grid_search``."""
    cats, encoded = _categories("grid_search", values)
    return _Grid(cats, encoded)


@dataclass(frozen=True)
class SearchSpace:
    """A flattened search space.

    Attributes:
        domains: flat key (``"model/width"``) -> its sampled :class:`Domain` (grid axes included).
        grid: flat keys of the grid axes, in order.
        constants: flat key -> constant value.
    """

    domains: dict[str, Domain]
    grid: tuple[str, ...]
    constants: dict[str, Any]

    @property
    def distributions(self) -> dict[str, BaseDistribution]:
        """The sampled (non-grid) dimensions as Optuna distributions."""
        return {k: d.distribution() for k, d in self.domains.items() if k not in self.grid}

    def all_distributions(self) -> dict[str, BaseDistribution]:
        """Every searched dimension (grid axes as categorical): what ``study.ask`` is given."""
        return {k: d.distribution() for k, d in self.domains.items()}

    def grid_points(self) -> list[dict[str, Any]]:
        """The cartesian product of the grid axes, first axis slowest (``[{}]`` without one)."""
        axes = [(k, self.domains[k]) for k in self.grid]
        values = [list(d.categories) for _, d in axes]  # type: ignore[attr-defined]
        return [dict(zip(self.grid, combo, strict=True)) for combo in itertools.product(*values)]

    def encode(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """A grid point's values as Optuna stores them (for ``study.enqueue_trial``)."""
        return {k: self.domains[k].encode(v) for k, v in point.items()}  # type: ignore[attr-defined]

    def config(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The nested ``train_loop_config`` of an Optuna trial's ``params`` plus the constants."""
        flat = dict(self.constants)
        for k, v in params.items():
            domain = self.domains.get(k)
            flat[k] = domain.decode(v) if domain is not None else v
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            parts = key.split("/")
            cur = nested
            for p in parts[:-1]:
                cur = cur.setdefault(p, {})
            cur[parts[-1]] = value
        return nested

    def param_columns(self) -> list[str]:
        """Flat keys of the searched dimensions, for tables."""
        return list(self.domains)

    def to_json(self) -> dict[str, Any]:
        """A readable description: flat key -> ``repr`` of its domain or constant."""
        out: dict[str, Any] = {k: repr(d) for k, d in self.domains.items()}
        for k, v in self.constants.items():
            out[k] = v if isinstance(v, _PRIMITIVE) else repr(v)
        return out


def build_space(param_space: Mapping[str, Any], search_alg: Any = "tpe") -> SearchSpace:
    """Flatten and check ``param_space``.

    Args:
        param_space: nested dict of domains and constants.
        search_alg: with ``"grid"``, every ``choice`` becomes a grid axis, and continuous domains
            are refused.

    Raises:
        TypeError: a key is not a string, or contains ``/``.
        ValueError: ``search_alg="grid"`` with a domain that has no finite set of values.
    """
    domains: dict[str, Domain] = {}
    grid: list[str] = []
    constants: dict[str, Any] = {}
    as_grid = search_alg == "grid"

    def walk(prefix: str, node: Mapping[str, Any], where: str) -> None:
        for key, value in node.items():
            if not isinstance(key, str) or not key or "/" in key:
                raise TypeError(
                    f"param_space{where}: keys must be non-empty strings without '/', got {key!r}"
                )
            flat = f"{prefix}{key}"
            here = f"{where}[{key!r}]"
            if isinstance(value, Mapping):
                walk(f"{flat}/", value, here)
            elif isinstance(value, _Grid) or (as_grid and isinstance(value, _Choice)):
                domains[flat] = value
                grid.append(flat)
            elif isinstance(value, Domain):
                if as_grid:
                    raise ValueError(
                        f"param_space{here}: search_alg='grid' needs grid_search() or choice() "
                        f"values, got {value!r}; use search_alg='random' or 'tpe' (grid_search "
                        "values are still all visited)"
                    )
                domains[flat] = value
            else:
                constants[flat] = value

    walk("", param_space, "")
    return SearchSpace(domains, tuple(grid), constants)


def make_sampler(search_alg: Any, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """The Optuna sampler ``search_alg`` names.

    ``"tpe"``: ``TPESampler(multivariate=True)`` (models the dimensions jointly: lr and width
    interact; Falkner et al. 2018 found the multivariate kernel better on such spaces).
    ``"random"`` and ``"grid"``: ``RandomSampler`` (grid points are enqueued in the study by the
    Tuner, the sampler draws only the remaining dimensions). ``"cmaes"``, ``"qmc"``: Optuna's
    CMA-ES and quasi-Monte-Carlo samplers. An ``optuna.samplers.BaseSampler`` is used as is.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TypeError: neither a name nor a sampler.
    """
    if isinstance(search_alg, optuna.samplers.BaseSampler):
        return search_alg
    if not isinstance(search_alg, str):
        raise TypeError(
            "TuneConfig.search_alg must be one of "
            f"{', '.join(map(repr, SEARCH_ALGS))} or an optuna.samplers.BaseSampler, got "
            f"{type(search_alg).__name__}"
        )
    name = search_alg.lower()
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True)
    if name in ("random", "grid"):
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    if name == "qmc":
        return optuna.samplers.QMCSampler(seed=seed)
    raise ValueError(
        f"TuneConfig.search_alg={search_alg!r} is not known: use one of "
        f"{', '.join(map(repr, SEARCH_ALGS))} or pass an optuna.samplers.BaseSampler"
    )
