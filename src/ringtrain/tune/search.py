"""Search spaces, mapped onto Optuna distributions, and the samplers that search them.

``param_space`` is a (nested) dict whose leaves are domains (``uniform``, ``loguniform``,
``quniform``, ``randint``, ``qrandint``, ``lograndint``, ``choice``, ``grid_search``), raw Optuna
distributions, or constants. :func:`build_space` flattens it (nested keys joined with ``/``: the
key ``"model/width"`` is ``param_space["model"]["width"]``) into a :class:`SearchSpace`: Optuna
distributions for the sampled dimensions, grid axes, and constants. The Tuner enqueues every grid
point (:meth:`SearchSpace.grid_points`, :meth:`SearchSpace.encode`), asks the study for a trial
over :meth:`SearchSpace.all_distributions` and rebuilds the trial's nested ``config`` with
:meth:`SearchSpace.config`.

The helpers follow Ray Tune's semantics (``randint`` excludes ``high``, ``qrandint`` includes it),
and check their arguments when called, so a bad domain fails at the line that makes it.
``choice`` and ``grid_search`` accept any values: Optuna's ``CategoricalDistribution`` stores only
``None``, bool, int, float and str, so other values (lists, dicts, objects), and categories that
compare equal (``[1, 1.0, True]``), are stored as their index and decoded back.
"""

from __future__ import annotations

import abc
import importlib.util
import itertools
import json
import math
import random
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)

_PRIMITIVE = (type(None), bool, int, float, str)
_GRID_FIX = "use search_alg='random' or 'tpe', or grid_search([...]) with the values to visit"


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
class _Float(Domain):
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
class _Int(Domain):
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
class _Choice(Domain):
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
class _Grid(_Choice):
    """``grid_search``: every value is visited."""

    kind: str = field(default="grid_search", compare=False)


@dataclass(frozen=True)
class _Raw(Domain):
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
    return _Float(low, high, kind="uniform")


def loguniform(low: float, high: float) -> Domain:
    """A float drawn uniformly in log space from ``[low, high]``, for learning rates and weight
    decays (``FloatDistribution(low, high, log=True)``).

    Raises:
        TypeError: a bound is not a finite number.
        ValueError: ``low <= 0`` or ``low >= high``.
    """
    return _Float(low, high, log=True, kind="loguniform")


def quniform(low: float, high: float, q: float) -> Domain:
    """A float from ``{low, low + q, low + 2q, ...} <= high`` (``FloatDistribution(low, high,
    step=q)``; Optuna lowers ``high`` to the last multiple, with a warning, when ``high - low``
    is not one). Values are rounded to ``q``'s decimals (``0.3``, not ``0.30000000000000004``).

    Raises:
        TypeError: an argument is not a finite number.
        ValueError: ``low >= high`` or ``q <= 0``.
    """
    return _Float(low, high, step=q, kind="quniform")


def randint(low: int, high: int) -> Domain:
    """An int from ``low`` to ``high - 1`` (``high`` exclusive, as Ray Tune's ``randint`` and
    Python's ``range``; ``IntDistribution(low, high - 1)``).

    Raises:
        TypeError: a bound is not an int.
        ValueError: ``low >= high``.
    """
    return _Int(low, _integer("randint", "high", high) - 1, kind="randint")


def lograndint(low: int, high: int) -> Domain:
    """An int from ``low`` to ``high - 1`` drawn in log space (``low >= 1``; ``high`` exclusive,
    as Ray Tune; ``IntDistribution(low, high - 1, log=True)``).

    Raises:
        TypeError: a bound is not an int.
        ValueError: ``low < 1`` or ``low >= high``.
    """
    return _Int(low, _integer("lograndint", "high", high) - 1, log=True, kind="lograndint")


def qrandint(low: int, high: int, q: int = 1) -> Domain:
    """An int from ``{low, low + q, ...} <= high`` (``high`` inclusive, as Ray Tune's
    ``qrandint``; ``IntDistribution(low, high, step=q)``).

    Raises:
        TypeError: an argument is not an int.
        ValueError: ``low > high`` or ``q < 1``.
    """
    return _Int(low, high, step=q, kind="qrandint")


def choice(categories: Sequence[Any]) -> Domain:
    """One of ``categories``, chosen by the sampler (``CategoricalDistribution``). Values may be
    anything (numbers, strings, lists, dicts, objects); repeating a value makes it likelier.

    Raises:
        TypeError: ``categories`` is not a list or tuple.
        ValueError: it is empty.
    """
    return _Choice(categories, kind="choice")  # type: ignore[arg-type]


def grid_search(values: Sequence[Any]) -> Domain:
    """Every one of ``values`` is run, ``num_samples`` times each and crossed with the other grid
    axes, as Ray Tune's ``grid_search``.

    Raises:
        TypeError: ``values`` is not a list or tuple.
        ValueError: it is empty.
    """
    return _Grid(values, kind="grid_search")  # type: ignore[arg-type]


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
    return value


@dataclass(frozen=True)
class SearchSpace:
    """A flattened search space (flat keys join nested ones with ``/``: ``"model/width"``).

    Attributes:
        distributions: the sampled dimensions (not the grid axes) as Optuna distributions.
        grid: grid axis -> the values it visits (real values, not encoded), in order.
        constants: flat key -> the value passed through unchanged.
        domains: every searched flat key (sampled and grid) -> its :class:`Domain`, in
            ``param_space`` order; filled from ``distributions`` and ``grid`` when left out.
    """

    distributions: dict[str, BaseDistribution]
    grid: dict[str, list[Any]]
    constants: dict[str, Any]
    domains: dict[str, Domain] = field(default_factory=dict)

    def __post_init__(self) -> None:
        overlap = (set(self.distributions) | set(self.grid)) & set(self.constants)
        if set(self.distributions) & set(self.grid) or overlap:
            raise ValueError(
                "SearchSpace: a key is both searched and constant, or both sampled and a grid "
                f"axis: {sorted((set(self.distributions) & set(self.grid)) | overlap)}"
            )
        domains = dict(self.domains)
        for k, d in self.distributions.items():
            domains.setdefault(k, _Raw(d))
        for k, values in self.grid.items():
            domains.setdefault(k, _Grid(tuple(values)))
        object.__setattr__(self, "domains", domains)

    def param_columns(self) -> list[str]:
        """Flat keys of the searched (non-constant) parameters, sampled and grid, for tables."""
        return list(self.domains)

    def all_distributions(self) -> dict[str, BaseDistribution]:
        """Every searched dimension, grid axes as (encoded) ``CategoricalDistribution``: what
        ``study.ask`` is given so that a trial's ``params`` hold every parameter."""
        return {
            k: self.distributions[k] if k in self.distributions else d.distribution()
            for k, d in self.domains.items()
        }

    def grid_points(self) -> list[dict[str, Any]]:
        """The cartesian product of the grid axes (flat key -> real value), first axis slowest;
        ``[{}]`` without a grid axis."""
        keys = list(self.grid)
        return [
            dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*(self.grid[k] for k in keys))
        ]

    def encode(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """``point``'s values as Optuna stores them, for ``study.enqueue_trial(params)``.

        Raises:
            ValueError: a key is not searched in this space, or a value is not one of its
                axis' values.
        """
        out: dict[str, Any] = {}
        for k, v in point.items():
            if k not in self.domains:
                raise ValueError(
                    f"{k!r} is not a searched key of this space (searched: {self.param_columns()})"
                )
            out[k] = self.domains[k].encode(v)
        return out

    def config(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The nested ``train_loop_config`` of a trial: its Optuna ``params`` (flat keys, encoded
        values, as ``trial.params``) decoded, plus the constants.

        Raises:
            ValueError: an encoded category index is out of range (the space changed).
        """
        flat = dict(self.constants)
        for k, v in params.items():
            domain = self.domains.get(k)
            flat[k] = domain.decode(v) if domain is not None else v
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            *parents, leaf = key.split("/")
            cur = nested
            for p in parents:
                cur = cur.setdefault(p, {})
            cur[leaf] = value
        return nested

    def to_json(self) -> dict[str, Any]:
        """A JSON-able description for ``tuner.json``: flat key -> ``"loguniform(0.0001, 0.1)"``
        for a searched key, the value (or its ``repr``) for a constant."""
        out: dict[str, Any] = {k: repr(d) for k, d in self.domains.items()}
        out.update({k: _jsonable(v) for k, v in self.constants.items()})
        return out

    def describe(self) -> str:
        """A few aligned lines for humans: one per key, and the number of grid points."""
        rows = [(k, repr(d)) for k, d in self.domains.items()]
        rows += [(k, f"{v!r}  (constant)") for k, v in self.constants.items()]
        width = max((len(k) for k, _ in rows), default=0)
        lines = [f"{k.ljust(width)}  {text}" for k, text in rows]
        if self.grid:
            lines.append(f"grid: {len(self.grid_points())} points")
        return "\n".join(lines)


def _where(path: tuple[str, ...]) -> str:
    return "param_space" + "".join(f"[{p!r}]" for p in path)


def _contains_domain(value: Any) -> bool:
    if isinstance(value, Domain | BaseDistribution):
        return True
    if isinstance(value, Mapping):
        return any(_contains_domain(v) for v in value.values())
    if isinstance(value, list | tuple | set | frozenset):
        return any(_contains_domain(v) for v in value)
    return False


def build_space(param_space: Mapping[str, Any], search_alg: Any = "tpe") -> SearchSpace:
    """Flatten and check ``param_space``.

    Args:
        param_space: a nested dict (str keys without ``/``) of domains, Optuna distributions and
            constants; an empty nested dict is a constant ``{}``.
        search_alg: ``TuneConfig.search_alg``. With ``"grid"``, every ``choice`` becomes a grid
            axis too, and a domain without a finite list of values is refused.

    Raises:
        TypeError: ``param_space`` is not a dict; a key is not a non-empty string or contains
            ``/``; a leaf is a Ray Tune domain; a domain sits inside a list (not searched).
        ValueError: ``search_alg="grid"`` with a continuous or integer-range domain.
        All name the key path, as ``param_space['model']['lr']``. The domains' own errors
        (``loguniform(0, 1)``) are raised where they are made.
    """
    if not isinstance(param_space, Mapping):
        raise TypeError(f"param_space must be a dict, got {type(param_space).__name__}")
    as_grid = isinstance(search_alg, str) and search_alg.lower() == "grid"
    distributions: dict[str, BaseDistribution] = {}
    grid: dict[str, list[Any]] = {}
    constants: dict[str, Any] = {}
    domains: dict[str, Domain] = {}

    def walk(path: tuple[str, ...], node: Mapping[Any, Any]) -> None:
        for key, value in node.items():
            if not isinstance(key, str) or not key or "/" in key:
                raise TypeError(
                    f"{_where(path)}: keys must be non-empty strings without '/' ('/' joins "
                    f"nested keys), got {key!r}; nest a dict instead"
                )
            here = (*path, key)
            flat = "/".join(here)
            if isinstance(value, Mapping) and value:
                walk(here, value)
                continue
            if isinstance(value, BaseDistribution):
                value = _Raw(value)
            if type(value).__module__.startswith("ray.tune"):
                raise TypeError(
                    f"{_where(here)}: {type(value).__name__} is a Ray Tune domain; use "
                    "ringtrain.tune.uniform/loguniform/randint/choice/grid_search"
                )
            if not isinstance(value, Domain):
                if _contains_domain(value):
                    raise TypeError(
                        f"{_where(here)}: a search domain inside a {type(value).__name__} is not "
                        "searched; put it in a dict, or choice() between whole lists"
                    )
                constants[flat] = value
                continue
            if isinstance(value, _Raw) and as_grid:
                dist = value.dist
                if isinstance(dist, CategoricalDistribution):
                    value = _Choice(dist.choices)
            domains[flat] = value
            if isinstance(value, _Grid) or (as_grid and isinstance(value, _Choice)):
                grid[flat] = list(value.categories)
            elif as_grid:
                raise ValueError(
                    f"{_where(here)}: search_alg='grid' needs grid_search() or choice() values, "
                    f"got {value!r}; {_GRID_FIX}"
                )
            else:
                distributions[flat] = value.distribution()

    walk((), param_space)
    return SearchSpace(distributions, grid, constants, domains)


def _samplers() -> tuple[str, ...]:
    names = ["tpe", "random", "grid", "cmaes", "qmc"]
    if hasattr(optuna.samplers, "GPSampler"):
        names.insert(3, "gp")
    return tuple(names)


SEARCH_ALGS = _samplers()


def _need(name: str, *modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(
            f"TuneConfig.search_alg={name!r} needs {', '.join(missing)}, which is not installed: "
            f"pip install {' '.join(missing)} (or use search_alg='tpe')"
        )


def make_sampler(search_alg: Any, seed: int | None = None) -> optuna.samplers.BaseSampler:
    """The Optuna sampler ``TuneConfig.search_alg`` names.

    - ``"tpe"``: ``TPESampler(multivariate=True, constant_liar=True)`` (Bergstra et al. 2011).
      Multivariate: models the dimensions jointly (learning rate and width interact; Falkner et
      al., BOHB, ICML 2018, found the joint kernel better); constant liar: trials run in
      parallel, and without it concurrent trials are drawn from the same model into the same
      region (Optuna's advice for parallel optimization). Both are the defaults of Optuna >= 5
      and are set explicitly for older versions. The first 10 trials are random.
    - ``"random"``: ``RandomSampler``.
    - ``"grid"``: ``RandomSampler``. The Tuner enqueues every grid point with
      ``study.enqueue_trial`` (so Optuna's ``GridSampler`` is not used); the sampler only draws
      the dimensions a point does not fix.
    - ``"gp"`` (Optuna >= 4.2, needs scipy and torch), ``"cmaes"`` (needs ``cmaes``), ``"qmc"``
      (scrambled Sobol, needs scipy; give ``seed`` to keep one sequence across a resumed sweep):
      Optuna's Gaussian-process, CMA-ES and quasi-Monte-Carlo samplers.
    - any ``optuna.samplers.BaseSampler`` instance is used as is (``seed`` does not apply).

    Args:
        search_alg: a name above (case-insensitive) or a sampler.
        seed: seeds the sampler's random draws, for reproducible sweeps.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
        TypeError: neither a name nor a sampler instance.
        ImportError: the named sampler's package is not installed.
    """
    if isinstance(search_alg, optuna.samplers.BaseSampler):
        return search_alg
    known = ", ".join(map(repr, SEARCH_ALGS))
    if isinstance(search_alg, type) and issubclass(search_alg, optuna.samplers.BaseSampler):
        raise TypeError(
            f"TuneConfig.search_alg must be a sampler instance: {search_alg.__name__}(), not the "
            "class"
        )
    if not isinstance(search_alg, str):
        raise TypeError(
            f"TuneConfig.search_alg must be one of {known} or an optuna.samplers.BaseSampler, "
            f"got {type(search_alg).__name__}"
        )
    name = search_alg.lower()
    if name not in SEARCH_ALGS:
        raise ValueError(
            f"TuneConfig.search_alg={search_alg!r} is not known: use one of {known} or pass an "
            "optuna.samplers.BaseSampler"
        )
    with warnings.catch_warnings():  # experimental in older Optuna versions; stable choices here
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True)
        if name in ("random", "grid"):
            return optuna.samplers.RandomSampler(seed=seed)
        if name == "gp":
            _need(name, "scipy", "torch")
            return optuna.samplers.GPSampler(seed=seed)
        if name == "cmaes":
            _need(name, "cmaes")
            return optuna.samplers.CmaEsSampler(seed=seed)
        _need(name, "scipy")
        # Optuna warns when it picks the seed itself (for several samplers sharing a study);
        # here one driver samples. A resumed sweep keeps its sequence only with TuneConfig.seed.
        qmc_seed = seed if seed is not None else random.SystemRandom().randrange(2**31)
        return optuna.samplers.QMCSampler(seed=qmc_seed, scramble=True)
