"""The package's lazy public names survive the import of a submodule of the same name."""

from __future__ import annotations

import importlib
import types

import ringtrain as rt


def test_importing_the_accumulate_module_leaves_rt_accumulate_the_function():
    module = importlib.import_module(
        "ringtrain.worker.accumulate"
    )  # e.g. elastic/batch.py's import
    # What the import system does on a submodule's first import (before rt.accumulate was
    # ever looked up), which used to turn rt.accumulate into the module:
    rt.__dict__.pop("accumulate", None)
    setattr(rt, "accumulate", module)  # noqa: B010
    assert not isinstance(rt.accumulate, types.ModuleType)
    assert rt.accumulate is module.accumulate
    from ringtrain import accumulate

    assert accumulate is module.accumulate


def test_the_package_pickles_by_reference():
    """A train function defined in ``__main__`` (a script, a notebook) is pickled by value and
    names ``rt``: the package object must pickle as a module does, by name (it is a module
    subclass, which neither pickle's nor cloudpickle's module table matches)."""
    import pickle

    import cloudpickle

    assert pickle.loads(pickle.dumps(rt)) is rt
    namespace = {"__name__": "__main__", "rt": rt}
    exec("def train_fn(config):\n    return rt.get_context\n", namespace)
    train_fn = cloudpickle.loads(cloudpickle.dumps(namespace["train_fn"]))
    assert train_fn({}) is rt.get_context


def test_no_valid_checkpoint_error_is_public():
    """``fit()`` raises it when no checkpoint verifies: users catch it as
    ``rt.NoValidCheckpointError`` (docs/security.md)."""
    from ringtrain.checkpoint.manager import NoValidCheckpointError

    assert "NoValidCheckpointError" in rt.__all__
    assert rt.NoValidCheckpointError is NoValidCheckpointError
