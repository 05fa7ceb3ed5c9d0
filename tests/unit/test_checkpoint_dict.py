"""``Checkpoint.from_dict`` / ``to_dict`` (Ray AIR's names, seed 003's
``report(..., checkpoint=Checkpoint.from_dict({"model": ..., "optimizer": ..., "epoch": ...}))``):
the dict is saved and loaded without ever running code, as every other checkpoint (issue 40).
The multi-process round trip through ``report`` and a restart is in
tests/e2e/test_ray_seeds.py."""

from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch

import ringtrain as rt
from ringtrain.checkpoint import signing, storage
from ringtrain.checkpoint.checkpoint import Checkpoint, CheckpointLoadError
from ringtrain.train import Checkpoint as RayCheckpoint


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": 3}


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def test_from_dict_round_trips_a_model_and_optimizer_state():
    state = _state()
    ckpt = RayCheckpoint.from_dict(state)
    assert RayCheckpoint is Checkpoint and rt.Checkpoint is Checkpoint
    assert _equal(ckpt.to_dict(), state)
    with ckpt.as_directory() as d:  # an ordinary checkpoint directory of one .pt file
        assert os.listdir(d) == ["dict.pt"]
        assert _equal(torch.load(os.path.join(d, "dict.pt"), weights_only=True), state)


def test_from_dict_refuses_what_would_run_code_and_names_where():
    with pytest.raises(TypeError, match=r"data\['model'\] is a torch\.nn\.modules\.linear\.Linear"):
        Checkpoint.from_dict({"model": torch.nn.Linear(2, 2)})
    with pytest.raises(TypeError, match=r"data\['extra'\]\['step'\] is a numpy.*int\(\)"):
        Checkpoint.from_dict({"extra": {"step": np.int64(3)}})
    with pytest.raises(TypeError, match="a dict with str keys"):
        Checkpoint.from_dict([1, 2])  # type: ignore[arg-type]
    Checkpoint.from_dict(collections.OrderedDict(a=torch.ones(2), b=[1, "x", None, 2.5]))


class _Boom:
    def __reduce__(self):
        # What a hostile pickle runs on an unsafe load.
        return (eval, ("open('pwned', 'w').close()",))


def test_to_dict_of_a_published_checkpoint_reads_verified_bytes_and_runs_no_code(tmp_path):
    state = _state()
    local = fsspec.filesystem("file")
    staging = tmp_path / "run" / storage.staging_dirname(0)
    staging.mkdir(parents=True)
    torch.save(state, staging / "dict.pt")
    files = {"dict.pt": storage.file_digest(local, str(staging / "dict.pt"))}
    ckpt = Path(storage.publish(local, str(tmp_path / "run"), 0, files, {}))
    assert _equal(Checkpoint(str(ckpt)).to_dict(), state)

    with open(ckpt / "dict.pt", "wb") as f:  # swapped after the manifest was signed
        pickle.dump({"x": _Boom()}, f, protocol=2)
    with pytest.raises(CheckpointLoadError, match=r"dict\.pt has \d+ bytes, the manifest"):
        Checkpoint(str(ckpt)).to_dict()
    files = {"dict.pt": storage.file_digest(local, str(ckpt / "dict.pt"))}
    storage.write_manifest(local, str(ckpt), files, signing.resolve(), run="run", round_=0)
    with pytest.raises(
        CheckpointLoadError, match=r"dict\.pt: .*GLOBAL eval was not an allowed global"
    ):
        Checkpoint(str(ckpt)).to_dict()  # signed by the key holder, still never unpickled
    assert not (tmp_path / "pwned").exists() and not os.path.exists("pwned")


def test_to_dict_of_a_checkpoint_without_a_dict_says_what_to_use(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"not made by Checkpoint\.from_dict.*as_directory"):
        Checkpoint.from_directory(tmp_path).to_dict()
