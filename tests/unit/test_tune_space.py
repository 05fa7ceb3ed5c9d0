"""Search spaces, samplers and schedulers of ringtrain.tune against real in-memory Optuna studies.

The studies are driven as the Tuner drives them: grid points enqueued (x num_samples), trials asked
over ``space.all_distributions()``, configs rebuilt with ``space.config(trial.params)``; the metric
of report round r (0-based) reported as step r + 1, ``should_prune()`` called after every report.
"""

from __future__ import annotations

import importlib.util
import json
import random

import pytest

optuna = pytest.importorskip("optuna")

from optuna.distributions import (  # noqa: E402
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.trial import TrialState  # noqa: E402

from ringtrain.tune.schedulers import (  # noqa: E402
    ASHAScheduler,
    FIFOScheduler,
    HyperbandScheduler,
    MedianStoppingRule,
    make_pruner,
)
from ringtrain.tune.search import (  # noqa: E402
    SEARCH_ALGS,
    SearchSpace,
    build_space,
    choice,
    grid_search,
    lograndint,
    loguniform,
    make_sampler,
    qrandint,
    quniform,
    randint,
    uniform,
)

optuna.logging.set_verbosity(optuna.logging.WARNING)

DIRECTION = {"max": "maximize", "min": "minimize"}


def _study(sampler="random", scheduler=None, mode="max", seed=0):
    return optuna.create_study(
        sampler=make_sampler(sampler, seed),
        pruner=make_pruner(scheduler),
        direction=DIRECTION[mode],
    )


def _enqueue(study, space, num_samples):
    """What the Tuner does before asking for trials."""
    for _ in range(num_samples):
        for point in space.grid_points():
            if point:
                study.enqueue_trial(space.encode(point), skip_if_exists=False)


# ------------------------------------------------------------------------------------ search space
@pytest.mark.parametrize("alg", ["random", "tpe"])
def test_every_grid_point_comes_back_in_order_num_samples_times(alg):
    act = [{"name": "gelu", "approx": True}, ["relu"]]  # not storable by Optuna: encoded
    space = build_space(
        {
            "model": {"act": grid_search(act), "depth": grid_search([2, 4])},
            "lr": loguniform(1e-4, 1e-1),
            "epochs": 3,
            "tags": ["a", "b"],
        },
        alg,
    )
    assert space.grid == {"model/act": act, "model/depth": [2, 4]}
    assert space.constants == {"epochs": 3, "tags": ["a", "b"]}
    assert list(space.distributions) == ["lr"]
    assert space.param_columns() == ["model/act", "model/depth", "lr"]
    points = space.grid_points()
    assert points == [
        {"model/act": act[0], "model/depth": 2},
        {"model/act": act[0], "model/depth": 4},
        {"model/act": act[1], "model/depth": 2},
        {"model/act": act[1], "model/depth": 4},
    ]
    study = _study(alg)
    _enqueue(study, space, num_samples=2)
    seen = []
    for _ in range(8):
        trial = study.ask(space.all_distributions())
        assert set(trial.params) == {"model/act", "model/depth", "lr"}
        config = space.config(trial.params)
        seen.append({"model/act": config["model"]["act"], "model/depth": config["model"]["depth"]})
        assert 1e-4 <= config["lr"] <= 1e-1
        assert config["epochs"] == 3 and config["tags"] == ["a", "b"]
        study.tell(trial, config["lr"])
    assert seen == points + points  # num_samples x grid, in the enqueued order
    assert seen[0]["model/act"] == {"name": "gelu", "approx": True}  # decoded, not an index


@pytest.mark.parametrize("alg", ["random", "tpe", "qmc"])
def test_samplers_draw_every_dimension_within_its_bounds(alg):
    if alg == "qmc" and importlib.util.find_spec("scipy") is None:
        pytest.skip("QMCSampler needs scipy")
    space = build_space(
        {
            "lr": loguniform(1e-4, 1e-1),
            "mom": uniform(0.5, 0.99),
            "drop": quniform(0.0, 0.5, 0.1),
            "model": {"width": randint(0, 3), "heads": qrandint(2, 8, 2), "ff": lograndint(1, 5)},
            "act": choice([["relu"], {"k": 1}, "tanh"]),
            "flag": choice([1, True, 1.0]),  # equal under ==: encoded, types kept
        }
    )
    assert space.distributions["model/width"] == IntDistribution(0, 2)  # randint: high exclusive
    assert space.distributions["model/heads"] == IntDistribution(2, 8, step=2)  # inclusive
    assert space.distributions["lr"] == FloatDistribution(1e-4, 1e-1, log=True)
    assert space.distributions["act"] == CategoricalDistribution((0, 1, 2))
    study = _study(alg, seed=1)
    widths, heads, drops, acts, flags = set(), set(), set(), [], []
    for _ in range(40):
        trial = study.ask(space.all_distributions())
        c = space.config(trial.params)
        assert 1e-4 <= c["lr"] <= 1e-1 and 0.5 <= c["mom"] <= 0.99
        assert 1 <= c["model"]["ff"] <= 4
        widths.add(c["model"]["width"])
        heads.add(c["model"]["heads"])
        drops.add(c["drop"])
        acts.append(c["act"])
        flags.append(type(c["flag"]))
        study.tell(trial, -abs(c["lr"] - 0.01))
    assert widths == {0, 1, 2}  # never 3
    assert heads <= {2, 4, 6, 8} and 8 in heads
    assert drops <= {0.0, 0.1, 0.2, 0.3, 0.4, 0.5}  # rounded: 0.3, not 0.30000000000000004
    assert {json.dumps(a) for a in acts} == {'["relu"]', '{"k": 1}', '"tanh"'}
    assert set(flags) == {int, bool, float}


def test_grid_alg_makes_choices_axes_and_refuses_ranges():
    space = build_space(
        {
            "w": choice([64, 128, 256]),
            "opt": {"name": grid_search(["sgd", "adam"])},
            "b": CategoricalDistribution([1, 2]),  # a raw Optuna distribution is accepted
            "seed": 0,
        },
        "grid",
    )
    assert space.distributions == {}
    assert len(space.grid_points()) == 12
    study = _study("grid")
    _enqueue(study, space, num_samples=1)
    configs = [space.config(study.ask(space.all_distributions()).params) for _ in range(12)]
    assert len({json.dumps(c, sort_keys=True) for c in configs}) == 12
    for dom in (uniform(0, 1), randint(0, 4)):
        with pytest.raises(ValueError, match=r"param_space\['m'\]\['lr'\]: search_alg='grid'") as e:
            build_space({"m": {"lr": dom}}, "grid")
        assert "grid_search([...])" in str(e.value) and "'random' or 'tpe'" in str(e.value)
    # Without "grid", a choice is sampled, not an axis.
    assert build_space({"w": choice([1, 2])}, "random").grid == {}


def test_space_describes_itself_and_handles_edge_shapes():
    space = build_space(
        {
            "lr": loguniform(1e-4, 0.1),
            "m": {"w": randint(16, 20), "o": {}},
            "g": grid_search([1, 2]),
            "fn": len,
        }
    )
    doc = space.to_json()
    json.dumps(doc)
    assert doc["lr"] == "loguniform(0.0001, 0.1)" and doc["m/w"] == "randint(16, 20)"
    assert doc["g"] == "grid_search([1, 2])" and doc["m/o"] == {}
    text = space.describe()
    assert "m/w  randint(16, 20)" in text and "(constant)" in text and "grid: 2 points" in text
    assert space.config({"lr": 0.01, "m/w": 17, "g": 2}) == {
        "lr": 0.01,
        "m": {"w": 17, "o": {}},
        "g": 2,
        "fn": len,
    }
    empty = build_space({})
    assert empty.grid_points() == [{}] and empty.config({}) == {}
    assert empty.all_distributions() == {}


def test_a_hand_built_space_and_stale_indices():
    space = SearchSpace(
        distributions={"x": FloatDistribution(0, 1)},
        grid={"g": [[1], [2]]},  # lists: encoded as indices
        constants={"c": 1},
    )
    assert space.all_distributions()["g"] == CategoricalDistribution((0, 1))
    assert space.encode({"g": [2]}) == {"g": 1}
    flags = SearchSpace({}, {"b": [1, True, 1.0]}, {})  # equal under ==, kept apart
    assert [flags.encode(p) for p in flags.grid_points()] == [{"b": 0}, {"b": 1}, {"b": 2}]
    assert [type(flags.config({"b": i})["b"]) for i in range(3)] == [int, bool, float]
    assert space.config({"x": 0.5, "g": 1}) == {"x": 0.5, "g": [2], "c": 1}
    with pytest.raises(ValueError, match="param_space changed"):
        space.config({"g": 5})
    with pytest.raises(ValueError, match="not a searched key"):
        space.encode({"c": 1})
    with pytest.raises(ValueError, match="both searched and constant"):
        SearchSpace({"c": FloatDistribution(0, 1)}, {}, {"c": 1})


def test_bad_domains_and_spaces_name_the_problem_and_the_fix():
    cases = [
        (lambda: loguniform(0, 1), ValueError, r"loguniform\(low=0.*must be > 0.*use uniform"),
        (lambda: uniform(1, 1), ValueError, r"uniform\(low=1, high=1\): low must be < high"),
        (lambda: uniform(0, float("nan")), TypeError, "high must be a finite number"),
        (lambda: quniform(0, 1, 0), ValueError, "q must be > 0"),
        (lambda: randint(3, 3), ValueError, r"randint\(low=3, high=3\).*high is exclusive"),
        (lambda: randint(0, 2.5), TypeError, "high must be an int"),
        (lambda: lograndint(0, 4), ValueError, "low must be >= 1"),
        (lambda: qrandint(0, 8, 0), ValueError, "q must be >= 1"),
        (lambda: choice([]), ValueError, "at least one value"),
        (lambda: grid_search("abc"), TypeError, "list of values"),
        (lambda: build_space([1]), TypeError, "param_space must be a dict"),
        (lambda: build_space({"m": {"a/b": 1}}), TypeError, r"param_space\['m'\]: keys.*'/'"),
        (lambda: build_space({"m": {3: 1}}), TypeError, r"param_space\['m'\]: keys"),
        (
            lambda: build_space({"m": {"layers": [choice([1, 2]), 3]}}),
            TypeError,
            r"param_space\['m'\]\['layers'\]: a search domain inside a list",
        ),
    ]
    for make, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            make()


def test_make_sampler_names_seeds_and_errors():
    assert isinstance(make_sampler("tpe"), optuna.samplers.TPESampler)
    assert isinstance(make_sampler("GRID"), optuna.samplers.RandomSampler)
    assert isinstance(make_sampler("random"), optuna.samplers.RandomSampler)
    if "gp" in SEARCH_ALGS and importlib.util.find_spec("scipy"):
        assert isinstance(make_sampler("gp"), optuna.samplers.GPSampler)
    if importlib.util.find_spec("cmaes") is None:
        with pytest.raises(ImportError, match="pip install cmaes"):
            make_sampler("cmaes")
    sampler = optuna.samplers.RandomSampler()
    assert make_sampler(sampler, seed=3) is sampler
    space = build_space({"x": uniform(0, 1), "n": randint(0, 100)})
    for alg in ("random", "tpe"):
        draws = []
        for _ in range(2):
            study = _study(alg, seed=7)
            draws.append([study.ask(space.all_distributions()).params for _ in range(3)])
        assert draws[0] == draws[1]  # the seed makes a sweep reproducible
    with pytest.raises(ValueError, match=r"search_alg='bogus' is not known.*'tpe'.*'random'"):
        make_sampler("bogus")
    with pytest.raises(TypeError, match=r"TPESampler\(\), not the class"):
        make_sampler(optuna.samplers.TPESampler)
    with pytest.raises(TypeError, match=r"TuneConfig\.search_alg"):
        make_sampler(3)


# -------------------------------------------------------------------------------------- schedulers
def _run(study, quality, steps, sign=1.0):
    """A trial whose value at step s is quality * s; returns the step it was pruned at, or None."""
    trial = study.ask()
    for step in range(1, steps + 1):  # report round r -> step r + 1
        trial.report(sign * quality * step, step)
        if trial.should_prune():
            study.tell(trial, state=TrialState.PRUNED)
            return step
    study.tell(trial, sign * quality * steps)
    return None


@pytest.mark.parametrize("mode", ["max", "min"])
@pytest.mark.parametrize("grace", [1, 2])
def test_asha_prunes_a_bad_trial_at_its_first_rung_and_keeps_a_good_one(mode, grace):
    sign = 1.0 if mode == "max" else -1.0
    study = _study(scheduler=ASHAScheduler(grace_period=grace, reduction_factor=3), mode=mode)
    for q in [0.1 * i for i in range(1, 10)]:  # each better than the last: all 9 complete
        assert _run(study, q, 9 * grace, sign) is None
    # Rung 0 holds 0.1..0.9 (x grace); the top third of 10 values starts at 0.7.
    assert _run(study, 0.05, 9 * grace, sign) == grace  # not before the grace period, not after
    assert _run(study, 0.85, 9 * grace, sign) is None
    # Optuna's rungs are at grace * 3**k: a trial good at rung 0 but bad later stops at rung 1.
    late = study.ask()
    for step in range(1, 9 * grace + 1):
        late.report(sign * (0.95 * step if step < 3 * grace else 0.0), step)
        if late.should_prune():
            break
    assert step == 3 * grace


def test_asha_fields_map_onto_optunas_pruner():
    pruner = ASHAScheduler(grace_period=2, reduction_factor=4.0, max_t=32).to_pruner()
    assert isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner)
    assert (pruner._min_resource, pruner._reduction_factor, pruner._min_early_stopping_rate) == (
        2,
        4,
        0,
    )


def test_hyperband_prunes_only_at_its_rungs_and_keeps_the_best():
    study = _study(scheduler=HyperbandScheduler(grace_period=2, max_t=18, reduction_factor=3))
    rng = random.Random(0)
    qualities = [rng.random() for _ in range(40)]
    pruned_at = {q: _run(study, q, 18) for q in qualities}
    steps = {s for s in pruned_at.values() if s is not None}
    # Brackets' rungs are at 2 * 3**k up to max_t; Optuna's top bracket has its only rung at
    # max_t itself (Ray's runs to max_t unpruned).
    assert steps and steps <= {2, 6, 18} and 2 in steps
    assert pruned_at[max(qualities)] is None


def test_hyperband_auto_waits_for_a_finished_trial():
    study = _study(scheduler=HyperbandScheduler(max_t="auto"))
    good, bad = study.ask(), study.ask()
    for step in range(1, 10):
        good.report(1.0, step)
        bad.report(0.0, step)
        assert not good.should_prune() and not bad.should_prune()


@pytest.mark.parametrize("mode", ["max", "min"])
def test_median_rule_waits_for_grace_period_and_min_samples(mode):
    sign = 1.0 if mode == "max" else -1.0
    study = _study(scheduler=MedianStoppingRule(grace_period=3, min_samples_required=2), mode=mode)
    assert _run(study, 1.0, 5, sign) is None
    assert _run(study, 0.1, 5, sign) is None  # one finished trial: fewer than min_samples
    assert _run(study, 1.0, 5, sign) is None
    assert _run(study, 0.1, 5, sign) == 3  # median of (1, 0.1, 1) beats it; not before step 3
    assert _run(study, 2.0, 5, sign) is None
    study = _study(scheduler=MedianStoppingRule(grace_period=1, min_samples_required=0), mode=mode)
    assert _run(study, 1.0, 3, sign) is None
    assert _run(study, 0.1, 3, sign) == 1  # grace_period=1: stopped after the first report
    # min_samples_required counts the finished trials that reached the step, not all of them.
    study = _study(scheduler=MedianStoppingRule(grace_period=1, min_samples_required=2), mode=mode)
    assert _run(study, 1.0, 5, sign) is None
    assert _run(study, 1.0, 1, sign) is None  # finished after one report
    late = study.ask()
    for step in range(1, 6):
        late.report(sign * (1.0 if step == 1 else 0.0), step)
        assert not late.should_prune()  # from step 2 on, one finished trial has a value


def test_scheduler_fields_are_checked_and_make_pruner_accepts_only_pruners():
    cases = [
        (lambda: ASHAScheduler(grace_period=0), r"ASHAScheduler\.grace_period.*>= 1, got 0"),
        (lambda: ASHAScheduler(reduction_factor=1), r"ASHAScheduler\.reduction_factor.*>= 2"),
        (lambda: ASHAScheduler(reduction_factor=2.5), r"reduction_factor.*whole.*int reduction"),
        (lambda: ASHAScheduler(grace_period=4, max_t=2), r"ASHAScheduler\.max_t.*>= 4"),
        (lambda: ASHAScheduler(grace_period=True), r"ASHAScheduler\.grace_period"),
        (lambda: HyperbandScheduler(max_t="big"), r"HyperbandScheduler\.max_t.*or 'auto'"),
        (lambda: HyperbandScheduler(grace_period=0), r"HyperbandScheduler\.grace_period"),
        (lambda: MedianStoppingRule(grace_period=0), r"MedianStoppingRule\.grace_period"),
        (lambda: MedianStoppingRule(min_samples_required=-1), r"min_samples_required"),
    ]
    for make, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            make()
    assert isinstance(make_pruner(None), optuna.pruners.NopPruner)
    assert isinstance(make_pruner(FIFOScheduler()), optuna.pruners.NopPruner)
    assert isinstance(make_pruner(HyperbandScheduler()), optuna.pruners.HyperbandPruner)
    assert isinstance(make_pruner(MedianStoppingRule()), optuna.pruners.MedianPruner)
    pruner = optuna.pruners.PercentilePruner(25.0)
    assert make_pruner(pruner) is pruner
    with pytest.raises(TypeError, match=r"tune\.ASHAScheduler\(\), not the class"):
        make_pruner(ASHAScheduler)
    with pytest.raises(TypeError, match=r"TuneConfig\.scheduler must be None"):
        make_pruner("asha")
