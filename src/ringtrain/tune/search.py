"""Search spaces, mapped onto Optuna distributions, and the samplers that search them.

``param_space`` is a (nested) dict whose leaves are domains (``uniform``, ``loguniform``,
``quniform``, ``randint``, ``qrandint``, ``lograndint``, ``choice``, ``grid_search``), raw Optuna
distributions, or constants. :func:`build_space` flattens it (nested keys joined with ``/``: the
key ``"model/width"`` is ``param_space["model"]["width"]``) into a :class:`SearchSpace`: Optuna
distributions for the sampled dimensions, grid axes, and constants. The Tuner enqueues every grid
point (:meth:`SearchSpace.grid_points`, :meth:`SearchSpace.encode`), asks the study for a trial
over :meth:`SearchSpace.all_distributions` and rebuilds the trial's nested ``config`` with
:meth:`SearchSpace.config`.

The domains themselves (``uniform``... and the :class:`Domain` classes) are in
:mod:`ringtrain.tune.domains`, re-exported here.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
)

from ringtrain.tune.domains import (
    GRID_FIX,
    ChoiceDomain,
    Domain,
    FloatDomain,
    GridDomain,
    IntDomain,
    RawDomain,
    choice,
    grid_search,
    lograndint,
    loguniform,
    qrandint,
    quniform,
    randint,
    uniform,
)

# The classes' names before they moved to ringtrain.tune.domains: pickled sweeps (the signed
# tuner payload) made before then refer to them here.
_Float, _Int, _Choice, _Grid, _Raw = FloatDomain, IntDomain, ChoiceDomain, GridDomain, RawDomain

__all__ = [
    "SEARCH_ALGS",
    "Domain",
    "SearchSpace",
    "build_space",
    "choice",
    "grid_search",
    "lograndint",
    "loguniform",
    "make_sampler",
    "qrandint",
    "quniform",
    "randint",
    "uniform",
]


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
            domains.setdefault(k, RawDomain(d))
        for k, values in self.grid.items():
            domains.setdefault(k, GridDomain(tuple(values)))
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
                value = RawDomain(value)
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
            if isinstance(value, RawDomain) and as_grid:
                dist = value.dist
                if isinstance(dist, CategoricalDistribution):
                    value = ChoiceDomain(dist.choices)
            domains[flat] = value
            if isinstance(value, GridDomain) or (as_grid and isinstance(value, ChoiceDomain)):
                grid[flat] = list(value.categories)
            elif as_grid:
                raise ValueError(
                    f"{_where(here)}: search_alg='grid' needs grid_search() or choice() values, "
                    f"got {value!r}; {GRID_FIX}"
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
