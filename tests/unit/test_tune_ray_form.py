"""Ray Tune's form of a sweep, without processes (issue 40, seed 001): a ``TorchTrainer`` as the
trainable, ``param_space={"train_loop_config": {...}}`` merged into the trainer's own
``train_loop_config``, and no ``TuneConfig(metric, mode)`` required. The sweep itself runs in
tests/e2e/test_ray_seeds.py."""

from __future__ import annotations

import pytest

pytest.importorskip("optuna")

import ringtrain as rt
from ringtrain import tune
from ringtrain.result import Result
from ringtrain.train import RunConfig, ScalingConfig
from ringtrain.train.torch import TorchTrainer
from ringtrain.tune.progress import TrialRow
from ringtrain.tune.result import ResultGrid
from ringtrain.tune.trials import TrialRun, judge


def train_func(config):
    pass


def _trainer(**kw):
    return TorchTrainer(
        train_func,
        train_loop_config={"epochs": 2, "lr": 1.0, "model": {"width": 8, "depth": 2}},
        scaling_config=ScalingConfig(num_workers=2),
        **kw,
    )


def test_a_torch_trainer_is_a_trainable_and_train_loop_config_is_merged_into_its_own():
    space = {"train_loop_config": {"lr": tune.grid_search([1e-3, 1e-4]), "model": {"width": 4}}}
    tuner = tune.Tuner(_trainer(run_config=RunConfig(name="seed001")), param_space=space)
    assert tuner.train_fn is train_func
    assert tuner.scaling_config.num_workers == 2  # the trainer's
    assert tuner.run_config.name == "seed001"  # the trainer's, as Ray does without Tuner's
    sampled = {"train_loop_config": {"lr": 1e-3, "model": {"width": 4}}}
    assert tuner.trial_loop_config(sampled) == {
        "epochs": 2,
        "lr": 1e-3,
        "model": {"width": 4, "depth": 2},  # nested dicts merge, as Ray's merge_dicts
    }
    assert tune.Tuner(trainable=_trainer(), param_space=space).train_fn is train_func
    ours = tune.Tuner(
        _trainer(run_config=RunConfig(name="seed001")),
        param_space=space,
        run_config=rt.RunConfig(name="tuner"),
        scaling_config=rt.ScalingConfig(num_workers=3),
    )
    assert (ours.run_config.name, ours.scaling_config.num_workers) == ("tuner", 3)
    # A plain function: the sampled config is the train function's config, as before.
    assert tune.Tuner(train_func, param_space={"lr": 0.1}).trial_loop_config({"lr": 0.1}) == {
        "lr": 0.1
    }


def test_what_a_trainer_sweep_cannot_search_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"param_space\['scaling_config'\].*train_loop_config"):
        tune.Tuner(_trainer(), param_space={"scaling_config": {"num_workers": 4}})
    with pytest.raises(TypeError, match="both train_fn and trainable"):
        tune.Tuner(train_func, trainable=train_func)
    with pytest.raises(TypeError, match=r"must be callable or a ringtrain\.Trainer"):
        tune.Tuner(42)  # type: ignore[arg-type]


def test_metric_and_mode_are_optional_as_in_ray():
    tuner = tune.Tuner(train_func, param_space={"lr": tune.grid_search([0.1, 0.2])})
    assert (tuner.metric, tuner.mode) == (None, None)
    with pytest.raises(ValueError, match=r"TuneConfig\(metric='loss'\) needs mode="):
        tune.Tuner(train_func, tune_config=tune.TuneConfig(metric="loss"))
    with pytest.raises(ValueError, match=r"scheduler.*needs TuneConfig\(metric=.*mode="):
        tune.Tuner(train_func, tune_config=tune.TuneConfig(scheduler=tune.ASHAScheduler()))


def test_a_sweep_without_a_metric_completes_its_trials_and_ranks_on_request():
    trial = TrialRun(0, None, {}, {}, [])
    trial.result = Result(metrics={"loss": 0.5}, path="t0")
    assert judge(trial, None, None).status == "COMPLETE"
    rows = [TrialRow(i, {"lr": lr}, status="COMPLETE") for i, lr in enumerate((0.1, 0.2))]
    results = [
        Result(metrics={"loss": loss}, path=f"trial_{i:04d}", metrics_history=[{"loss": loss}])
        for i, loss in enumerate((0.5, 0.25))
    ]
    grid = ResultGrid(results, rows, path="sweep", metric=None, mode=None, columns=["lr"])
    with pytest.raises(ValueError, match=r"get_best_result\(metric=\.\.\., mode=\.\.\.\)"):
        grid.get_best_result()
    assert grid.get_best_result(metric="loss", mode="min").path == "trial_0001"
    records = grid.get_dataframe()
    columns = records.columns if hasattr(records, "columns") else records[0].keys()
    assert None not in columns and "None" not in columns
