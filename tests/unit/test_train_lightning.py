"""``ringtrain.train.lightning``: Ray Train's Lightning names, for ``import lightning.pytorch as
pl`` and for ``import pytorch_lightning as pl`` (issue 40, seeds 003 and 004), without processes.
The seeds themselves run in tests/e2e/test_ray_seeds.py."""

from __future__ import annotations

import re
import sys
import types

import pytest

pytest.importorskip("lightning.pytorch")
pytest.importorskip("pytorch_lightning")

import lightning.pytorch as lpl
import pytorch_lightning as ppl

from ringtrain.integrations import _flavor
from ringtrain.train import lightning as ray_lightning
from ringtrain.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    package_in_use,
    prepare_trainer,
)


def _built_by(namespace: dict) -> tuple:
    """The three objects a train function whose module globals are ``namespace`` builds."""
    code = "objs = (RayDDPStrategy(), RayLightningEnvironment(), RayTrainReportCallback())"
    exec(
        code,
        {
            **namespace,
            "RayDDPStrategy": RayDDPStrategy,
            "RayLightningEnvironment": RayLightningEnvironment,
            "RayTrainReportCallback": RayTrainReportCallback,
        },
        scope := {},
    )
    return scope["objs"]


@pytest.mark.parametrize("pl", [lpl, ppl], ids=["lightning.pytorch", "pytorch_lightning"])
def test_the_ray_names_follow_the_package_the_code_imported(pl):
    strategy, env, callback = _built_by({"pl": pl})
    assert isinstance(strategy, pl.strategies.DDPStrategy)
    assert isinstance(env, pl.plugins.environments.ClusterEnvironment)
    assert isinstance(callback, pl.Callback)
    assert isinstance(strategy, RayDDPStrategy) and isinstance(callback, RayTrainReportCallback)
    # The Trainer takes them (it refused the other package's: "invalid type for plugin").
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        plugins=[env],
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    assert trainer.strategy is strategy and trainer.strategy.cluster_environment is env
    assert RayTrainReportCallback.CHECKPOINT_NAME == type(callback).CHECKPOINT_NAME
    assert type(callback).CHECKPOINT_NAME == "lightning.ckpt"  # what the callback writes


def test_which_package_when_one_or_both_are_imported(monkeypatch):
    assert package_in_use({"pl": ppl}) == "pytorch_lightning"
    assert package_in_use({"Trainer": ppl.Trainer}) == "pytorch_lightning"
    assert package_in_use({"pl": lpl}) == "lightning.pytorch"
    assert package_in_use({"os": sys}) == "lightning.pytorch"  # both imported, no hint
    monkeypatch.delitem(sys.modules, "lightning.pytorch")
    assert package_in_use({}) == "pytorch_lightning"  # the only one imported


def test_prepare_trainer_follows_the_trainers_package_and_subclassing_names_the_fix():
    with pytest.raises(TypeError, match=r"takes a Lightning Trainer .* got builtins\.object"):
        prepare_trainer(object())
    with pytest.raises(TypeError, match=r"integrations\.pytorch_lightning_ray\.RayTrainReport"):

        class Mine(RayTrainReportCallback):  # type: ignore[misc]
            pass

    assert ray_lightning.bridge("pytorch_lightning").prepare_trainer.__module__ == (
        "ringtrain.integrations.pytorch_lightning"
    )


def test_the_pytorch_lightning_bridge_is_the_same_source_renamed():
    for twin in ("lightning", "lightning_callback", "lightning_strategies", "lightning_ray"):
        source, path = _flavor.twin_source(twin)
        assert path.endswith(f"integrations/{twin}.py")
        assert not re.search(r"\blightning\.(pytorch|fabric)\b", source), twin
        assert not re.search(r"^\s*(import|from) lightning\b", source, re.MULTILINE), twin
        module = sys.modules.get(f"ringtrain.integrations.pytorch_{twin}")
        assert module is None or isinstance(module, types.ModuleType)
