"""Search spaces and schedulers of ringtrain.tune against real (in-memory) Optuna studies."""

from __future__ import annotations

import pytest

optuna = pytest.importorskip("optuna")

from optuna.distributions import CategoricalDistribution, IntDistribution  # noqa: E402

from ringtrain import tune  # noqa: E402
from ringtrain.tune.schedulers import make_pruner  # noqa: E402
from ringtrain.tune.search import build_space, make_sampler  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _study(space, sampler="random", pruner=None, direction="maximize", seed=0):
    return optuna.create_study(
        sampler=make_sampler(sampler, seed), pruner=make_pruner(pruner), direction=direction
    )


def test_space_maps_onto_optuna_distributions_and_rebuilds_nested_configs():
    space = build_space(
        {
            "lr": tune.loguniform(1e-4, 1e-1),
            "model": {"width": tune.randint(16, 20), "act": tune.choice([["relu"], {"a": 1}])},
            "drop": tune.quniform(0.0, 0.5, 0.1),
            "epochs": 3,
        }
    )
    dists = space.all_distributions()
    assert dists["model/width"] == IntDistribution(16, 19)  # randint: high exclusive
    assert dists["lr"].log and dists["drop"].step == 0.1
    assert isinstance(dists["model/act"], CategoricalDistribution)
    study = _study(space)
    seen_widths, seen_acts = set(), []
    for _ in range(30):
        trial = study.ask(dists)
        config = space.config(trial.params)
        assert 1e-4 <= config["lr"] <= 1e-1 and config["epochs"] == 3
        assert 16 <= config["model"]["width"] <= 19
        seen_widths.add(config["model"]["width"])
        seen_acts.append(config["model"]["act"])
        study.tell(trial, 0.0)
    assert seen_widths == {16, 17, 18, 19}
    assert {str(a) for a in seen_acts} == {"['relu']", "{'a': 1}"}  # decoded, not indices
    assert space.param_columns() == ["lr", "model/width", "model/act", "drop"]


def test_grid_points_are_enqueued_and_come_back_in_order():
    space = build_space(
        {"a": tune.grid_search([1, 2]), "b": tune.grid_search(["x", [3]]), "lr": tune.uniform(0, 1)}
    )
    points = space.grid_points()
    assert points == [
        {"a": 1, "b": "x"},
        {"a": 1, "b": [3]},
        {"a": 2, "b": "x"},
        {"a": 2, "b": [3]},
    ]
    study = _study(space)
    for p in points:
        study.enqueue_trial(space.encode(p))
    got = []
    for _ in points:
        trial = study.ask(space.all_distributions())
        config = space.config(trial.params)
        got.append({"a": config["a"], "b": config["b"]})
        assert 0 <= config["lr"] <= 1  # drawn by the sampler
        study.tell(trial, 1.0)
    assert got == points


def test_grid_alg_turns_choices_into_axes_and_refuses_continuous_domains():
    space = build_space({"w": tune.choice([1, 2, 3]), "o": {"k": tune.grid_search([0, 1])}}, "grid")
    assert len(space.grid_points()) == 6
    with pytest.raises(ValueError, match=r"param_space\['m'\]\['lr'\].*search_alg='grid'"):
        build_space({"m": {"lr": tune.uniform(0, 1)}}, "grid")


def test_bad_spaces_and_algorithms_name_the_problem():
    with pytest.raises(ValueError, match="low must be > 0"):
        tune.loguniform(0, 1)
    with pytest.raises(ValueError, match="low must be < high"):
        tune.uniform(1, 1)
    with pytest.raises(ValueError, match="at least one value"):
        tune.choice([])
    with pytest.raises(TypeError, match="list of values"):
        tune.grid_search("abc")
    with pytest.raises(TypeError, match="without '/'"):
        build_space({"a/b": 1})
    with pytest.raises(ValueError, match="search_alg='bogus' is not known"):
        make_sampler("bogus")
    sampler = optuna.samplers.RandomSampler()
    assert make_sampler(sampler) is sampler
    with pytest.raises(ValueError, match=r"ASHAScheduler\.reduction_factor"):
        tune.ASHAScheduler(reduction_factor=1)
    with pytest.raises(ValueError, match=r"MedianStoppingRule\.grace_period"):
        tune.MedianStoppingRule(grace_period=0)
    with pytest.raises(TypeError, match=r"TuneConfig\.scheduler"):
        make_pruner("asha")


@pytest.mark.parametrize("mode", ["max", "min"])
def test_asha_prunes_a_bad_trial_at_its_first_rung(mode):
    sign = 1.0 if mode == "max" else -1.0
    study = _study(
        None,
        pruner=tune.ASHAScheduler(grace_period=1, reduction_factor=3),
        direction="maximize" if mode == "max" else "minimize",
    )
    for quality in (0.9, 0.8, 0.85):  # three good trials reach the first rung (step 1)
        t = study.ask()
        t.report(sign * quality, 1)
        assert not t.should_prune() or quality < 0.9
        study.tell(t, sign * quality)
    bad = study.ask()
    bad.report(sign * 0.1, 1)
    assert bad.should_prune()  # not in the top third at rung 1
    good = study.ask()
    good.report(sign * 0.95, 1)
    assert not good.should_prune()


def test_median_rule_waits_for_the_grace_period():
    study = _study(None, pruner=tune.MedianStoppingRule(grace_period=3, min_samples_required=2))
    for _ in range(3):
        t = study.ask()
        for step in range(1, 5):
            t.report(1.0, step)
        study.tell(t, 1.0)
    bad = study.ask()
    for step in (1, 2):
        bad.report(0.0, step)
        assert not bad.should_prune()  # inside the grace period
    bad.report(0.0, 3)
    assert bad.should_prune()
