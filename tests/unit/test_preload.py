"""Which modules a run's warm pool preloads (``ringtrain.launch.pool.with_auto_preload``): the
user's ``ScalingConfig.preload_modules``, and Lightning for a train function that uses it. (That
a zygote imports them and its workers inherit them: tests/multiprocess/test_pool.py.)"""

from __future__ import annotations

import sys
import types

import pytest

import ringtrain as rt
from ringtrain.launch.pool import with_auto_preload


def _train_fn_with_globals(**namespace: object) -> types.FunctionType:
    """A train function whose module's globals are ``namespace``."""
    code = compile("def train_fn(config):\n    return config\n", "user_module", "exec")
    scope: dict[str, object] = {"__name__": "user_module", **namespace}
    exec(code, scope)
    fn = scope["train_fn"]
    assert isinstance(fn, types.FunctionType)
    return fn


class _Defined:
    """An object whose class says it was defined in ``module``."""

    def __init__(self, module: str) -> None:
        self.__module__ = module


@pytest.fixture
def lightning_imported(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("lightning.pytorch")
    monkeypatch.setitem(sys.modules, "lightning.pytorch", module)
    return module


@pytest.mark.parametrize(
    "name",
    ["pl", "prepare_trainer", "trainer_cls"],
)
def test_a_train_function_that_uses_lightning_gets_it_preloaded(lightning_imported, name):
    uses = {
        "pl": lightning_imported,  # import lightning.pytorch as pl
        "prepare_trainer": _Defined("ringtrain.integrations.lightning"),
        "trainer_cls": _Defined("lightning.pytorch.trainer.trainer"),
    }
    fn = _train_fn_with_globals(json=sys.modules["json"], **{name: uses[name]})
    scaling = rt.ScalingConfig(num_workers=2, preload_modules=("json",))
    preloaded = with_auto_preload(scaling, fn)
    assert preloaded.preload_modules == ("json", "lightning.pytorch")
    assert preloaded.num_workers == 2
    # Already asked for: not twice.
    again = with_auto_preload(preloaded, fn)
    assert again.preload_modules == ("json", "lightning.pytorch")


def test_a_train_function_that_does_not_use_lightning_is_left_alone(lightning_imported):
    fn = _train_fn_with_globals(np=types.ModuleType("lightningish"), rt=rt)
    scaling = rt.ScalingConfig(preload_modules=("json",))
    assert with_auto_preload(scaling, fn) is scaling
    assert with_auto_preload(scaling, len) is scaling  # a builtin: no module globals


def test_lightning_not_imported_by_the_driver_is_not_preloaded(monkeypatch):
    monkeypatch.delitem(sys.modules, "lightning.pytorch", raising=False)
    fn = _train_fn_with_globals(trainer_cls=_Defined("lightning.pytorch.trainer"))
    scaling = rt.ScalingConfig()
    assert with_auto_preload(scaling, fn) is scaling


def test_a_global_whose_attributes_raise_is_skipped(lightning_imported):
    class Hostile:
        def __getattribute__(self, name: str) -> object:
            raise RuntimeError(f"no {name}")

    fn = _train_fn_with_globals(hostile=Hostile(), pl=lightning_imported)
    assert with_auto_preload(rt.ScalingConfig(), fn).preload_modules == ("lightning.pytorch",)


def test_the_zygotes_imports_and_checks_never_ask_cuda_for_its_devices(monkeypatch):
    """``torch.cuda.is_available()`` and ``device_count()`` may initialise the CUDA driver
    (``cuInit``), after which no forked worker can use CUDA: the zygote's preload and its
    fork check call neither (the check asks torch's bad-fork state in a probe instead)."""
    import threading

    import torch

    from ringtrain.launch import zygote

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the zygote asked CUDA for its devices")

    monkeypatch.setattr(torch.cuda, "is_available", refuse)
    monkeypatch.setattr(torch.cuda, "device_count", refuse)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # pytest-xdist runs threads
    # A CUDA build of torch forks a probe to ask torch's bad-fork state (tests/multiprocess/
    # test_pool.py runs it for real); here the probe is replaced, and must get torch's own check.
    probed: list = []
    monkeypatch.setattr(zygote, "_child_cuda_ok", lambda check: probed.append(check) or True)
    zygote._preload()
    assert zygote._fork_blocker() == 0
    assert probed == [getattr(torch._C, "_cuda_isInBadFork", None)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert zygote._fork_blocker() == zygote._CUDA
