"""``TrainState`` in-process (rank 0 of 1): validation, bit-exact save/restore, safe loading."""

from __future__ import annotations

import collections
import enum
import io
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt
from ringtrain.checkpoint import signing, storage
from ringtrain.checkpoint.checkpoint import CheckpointLoadError
from ringtrain.worker import session as session_mod
from ringtrain.worker.state import STATE_FILE, TrainState, capture_rng, rank_file, restore_rng
from support import Poisoned

# ---------------------------------------------------------------- helpers


def _cpu_scaler() -> torch.amp.GradScaler | None:
    """A CPU GradScaler whose scale changes quickly, or None where torch has none."""
    try:
        return torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=2)
    except (TypeError, RuntimeError, AttributeError, ValueError):
        return None


def _dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(23, 4, generator=g)
    y = torch.randn(23, 1, generator=g)
    return TensorDataset(torch.arange(23), x, y)


class _Setup:
    """A tiny model with dropout, Adam, StepLR, a CPU GradScaler and a prepared loader."""

    def __init__(self, init_seed: int) -> None:
        torch.manual_seed(init_seed)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=3, gamma=0.5)
        self.scaler = _cpu_scaler()
        self.loader = rt.prepare_data_loader(
            DataLoader(_dataset(), batch_size=4, shuffle=True), seed=11
        )
        self.state = TrainState(
            self.model,
            self.opt,
            self.sched,
            self.scaler,
            self.loader,
            best=float("inf"),
            seen=[],
        )
        self.ids: list[list[int]] = []

    def steps(self):
        """One optimizer step per ``next()``; uses Python, NumPy and torch randomness."""
        state = self.state
        for _epoch in state.epochs(1000):
            for ids, x, y in self.loader:
                self.ids.append(ids.tolist())
                noise = torch.from_numpy(np.random.normal(size=tuple(x.shape))).float()
                weight = 1.0 + 0.1 * random.random()
                loss = weight * torch.nn.functional.mse_loss(self.model(x + 0.01 * noise), y)
                self.opt.zero_grad()
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                    self.scaler.step(self.opt)
                    self.scaler.update()
                else:
                    loss.backward()
                    self.opt.step()
                self.sched.step()
                state["best"] = min(state["best"], loss.item())
                state.step += 1
                yield


def _advance(gen, n: int) -> None:
    for _ in range(n):
        next(gen)


def _write(state: TrainState, directory: Path, stage: bool) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, write in state._checkpoint_writers(stage).items():
        with open(directory / name, "wb") as f:
            write(f)
    return _sign(directory)


def _sign(directory: Path) -> Path:
    """Write a signed manifest of every file in ``directory``, as the driver does on publishing
    (loading reads only files a signed manifest lists)."""
    fs = fsspec.filesystem("file")
    files = {
        p.name: storage.file_digest(fs, str(p))
        for p in sorted(directory.iterdir())
        if p.name != storage.MANIFEST
    }
    storage.write_manifest(fs, str(directory), files, signing.resolve(), run="t", round_=0)
    return directory


def _assert_same_training_state(a: _Setup, b: _Setup) -> None:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name
    sa, sb = a.opt.state_dict()["state"], b.opt.state_dict()["state"]
    for i in sa:
        for key in sa[i]:
            assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (i, key)
    assert a.sched.state_dict() == b.sched.state_dict()
    if a.scaler is not None and b.scaler is not None:
        assert a.scaler.state_dict() == b.scaler.state_dict()
    assert a.loader.state_dict() == b.loader.state_dict()
    assert (a.state.step, a.state.epoch, a.state["best"]) == (
        b.state.step,
        b.state.epoch,
        b.state["best"],
    )


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- validation


class _Stateful:
    def __init__(self, payload=None) -> None:
        self.payload = {"n": 1} if payload is None else payload

    def state_dict(self):
        return self.payload

    def load_state_dict(self, state):
        self.payload = state


class _NoStateDict:
    """Looks like an optimizer (it steps) but cannot be saved."""

    def step(self):
        pass

    def zero_grad(self):
        pass


def _offenders(message: str) -> set[str]:
    return {line.strip().split(":", 1)[0] for line in message.splitlines()[1:]}


def test_rejects_every_unsavable_object_by_name():
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError) as info:
        TrainState(
            model,
            _NoStateDict(),
            data_loader=DataLoader(TensorDataset(torch.zeros(4, 2)), batch_size=2),
            hook=lambda: 0,
            ema=_Stateful({"decay": 0.9, "fn": lambda x: x}),
            fine=3,
        )
    message = str(info.value)
    assert _offenders(message) == {"optimizer", "data_loader", "hook", "ema"}
    assert "prepare_data_loader" in message  # tells how to fix the plain loader
    assert "ema.state_dict()['fn']" in message  # points into the state dict


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"data_loader": DataLoader(TensorDataset(torch.zeros(4)), batch_size=2)}, "data_loader"),
        ({"callback": print}, "callback"),
        ({"fn": lambda: 1}, "fn"),
        ({"nested": {"ok": [1, 2], "bad": [3, (lambda: 0)]}}, "nested"),
        ({"optimizer": _NoStateDict()}, "optimizer"),
        ({"lr_scheduler": object()}, "lr_scheduler"),
        ({"extra": _Stateful({"inner": {"f": len}})}, "extra"),
        ({"arr": np.zeros(3)}, "arr"),
    ],
)
def test_rejects_one_offender(kwargs, name):
    with pytest.raises(TypeError, match=name) as info:
        TrainState(torch.nn.Linear(2, 2), **kwargs)
    assert _offenders(str(info.value)) == {name}


def test_accepts_the_usual_objects_and_plain_extras():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = _cpu_scaler()
    loader = rt.prepare_data_loader(DataLoader(TensorDataset(torch.zeros(6, 3)), batch_size=2))
    state = TrainState(
        model,
        opt,
        sched,
        scaler,
        loader,
        step=4,
        epoch=2,
        name="run",
        lr=0.1,
        count=3,
        flag=True,
        nothing=None,
        t=torch.ones(2),
        dtype=torch.float16,
        shape=torch.Size([2, 3]),
        nested={"a": [1, 2.5, (3, "b")], 7: {"t": torch.zeros(1)}},
        ema=_Stateful(),
    )
    assert state.step == 4 and state.epoch == 2
    assert state["name"] == "run" and state["ema"].payload == {"n": 1}
    assert state.data_loader is loader
    state["more"] = [1, 2]
    with pytest.raises(TypeError, match="more2"):
        state["more2"] = [1, lambda: 0]
    with pytest.raises(KeyError, match="ema"):
        state["ema"] = 1


# ---------------------------------------------------------------- round trip


@pytest.mark.parametrize("stage", [False, True])
def test_restore_continues_bit_exactly(tmp_path, stage):
    _seed_all(0)
    original = _Setup(init_seed=1)
    run = original.steps()
    _advance(run, 8)  # epoch 1, batch 2 of 6: mid-epoch
    assert (original.state.epoch, original.loader.batch) == (1, 2)
    ckpt_dir = _write(original.state, tmp_path / "ckpt", stage)
    assert sorted(os.listdir(ckpt_dir)) == [storage.MANIFEST, rank_file(0), STATE_FILE]
    _advance(run, 10)  # into epoch 2: crosses an epoch boundary after the resume
    assert (original.state.epoch, original.loader.batch) == (2, 6)

    restored = _Setup(init_seed=2)  # different initial weights: the restore must overwrite them
    assert not torch.equal(
        restored.model.get_parameter("0.weight"), original.model.get_parameter("0.weight")
    )
    _seed_all(999)  # and every RNG is elsewhere
    assert restored.state.restore(rt.Checkpoint(str(ckpt_dir))) is True
    assert restored.state.step == 8 and restored.state.epoch == 1
    assert restored.state.restored_from == rt.Checkpoint(str(ckpt_dir))
    _advance(restored.steps(), 10)
    _assert_same_training_state(original, restored)
    assert restored.ids == original.ids[8:]  # the same samples, in the same order


@pytest.mark.parametrize("scrambled", ["python", "numpy", "torch"])
def test_each_rng_matters_for_the_round_trip(tmp_path, scrambled):
    """Control for the test above: continuing from the same checkpoint with one RNG not restored
    ends elsewhere, so the equality there is earned by restoring all three."""
    _seed_all(0)
    original = _Setup(init_seed=1)
    run = original.steps()
    _advance(run, 8)
    ckpt_dir = _write(original.state, tmp_path / "ckpt", stage=False)
    _advance(run, 4)

    restored = _Setup(init_seed=1)
    restored.state.restore(rt.Checkpoint(str(ckpt_dir)))
    seeders: dict[str, Callable[[int], object]] = {
        "python": random.seed,
        "numpy": np.random.seed,
        "torch": torch.manual_seed,
    }
    seeders[scrambled](123)
    _advance(restored.steps(), 4)
    assert restored.ids == original.ids[8:]  # the data order does not depend on the global RNGs
    assert not all(
        torch.equal(a, b)
        for a, b in zip(original.model.parameters(), restored.model.parameters(), strict=True)
    )


def test_staged_copies_are_independent_of_training(tmp_path):
    _seed_all(0)
    setup = _Setup(init_seed=1)
    run = setup.steps()
    _advance(run, 3)
    before = {k: v.clone() for k, v in setup.model.state_dict().items()}
    moments = {k: v.clone() for k, v in setup.opt.state_dict()["state"][0].items()}

    staged = setup.state._checkpoint_writers(True)
    live = setup.state._checkpoint_writers(False)
    with torch.no_grad():
        for p in setup.model.parameters():
            p.add_(1.0)
    _advance(run, 2)  # the optimizer moments change in place too

    def load(writers):
        buf = io.BytesIO()
        writers[STATE_FILE](buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    saved = load(staged)
    for k, v in before.items():
        assert torch.equal(saved["objects"]["model"][k], v), k
    for k, v in moments.items():
        assert torch.equal(torch.as_tensor(saved["objects"]["optimizer"]["state"][0][k]), v), k
    assert saved["step"] == 3
    # Without staging the writers see the mutation: staging is what protects the copy.
    unstaged = load(live)
    assert not torch.equal(unstaged["objects"]["model"]["0.weight"], before["0.weight"])


def test_staged_model_state_keeps_module_versions(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = TrainState(model)
    buf = io.BytesIO()
    state._checkpoint_writers(True)[STATE_FILE](buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)["objects"]["model"]
    assert getattr(saved, "_metadata", None) == getattr(model.state_dict(), "_metadata", None)


# ---------------------------------------------------------------- restore errors


def test_restore_without_a_checkpoint_is_a_no_op():
    model = torch.nn.Linear(2, 2)
    weight = model.weight.detach().clone()
    state = TrainState(model)
    assert rt.get_checkpoint() is None
    assert state.restore() is False
    assert state.restored_from is None and state.step == 0
    assert torch.equal(model.weight, weight)


def test_restore_defaults_to_the_runs_latest_checkpoint(tmp_path):
    model = torch.nn.Linear(2, 2)
    src = TrainState(model, step=5, epoch=1)
    _write(src, tmp_path / "ckpt", stage=False)
    session_mod.current_session().latest_checkpoint = rt.Checkpoint(str(tmp_path / "ckpt"))
    fresh = torch.nn.Linear(2, 2)
    target = TrainState(fresh)
    assert target.restore() is True
    assert target.step == 5 and target.epoch == 1
    assert torch.equal(fresh.weight, model.weight)


def test_restore_of_a_directory_without_train_state_raises(tmp_path):
    (tmp_path / "model.pt").write_bytes(b"not a train state")
    _sign(tmp_path)
    with pytest.raises(ValueError, match=STATE_FILE):
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(tmp_path)))


def test_restore_names_registered_objects_the_checkpoint_lacks(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _write(TrainState(model, opt), tmp_path / "ckpt", stage=False)

    fresh = torch.nn.Linear(2, 2)
    weight = fresh.weight.detach().clone()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1)
    state = TrainState(fresh, fresh_opt, sched, ema=_Stateful())
    with pytest.raises(ValueError, match="lr_scheduler, ema"):
        state.restore(rt.Checkpoint(str(tmp_path / "ckpt")))
    assert torch.equal(fresh.weight, weight)  # nothing was half-restored
    assert state.restored_from is None


def test_restore_without_this_ranks_file_raises(tmp_path):
    _write(TrainState(torch.nn.Linear(2, 2)), tmp_path / "ckpt", stage=False)
    (tmp_path / "ckpt" / rank_file(0)).unlink()
    _sign(tmp_path / "ckpt")  # a manifest without it (a missing listed file is refused)
    with pytest.raises(ValueError, match=rank_file(0)):
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(tmp_path / "ckpt")))


@pytest.mark.parametrize("evil_file", [STATE_FILE, rank_file(0)])
def test_checkpoint_files_are_loaded_weights_only(tmp_path, evil_file):
    ckpt = _write(TrainState(torch.nn.Linear(2, 2)), tmp_path / "ckpt", stage=False)
    marker = tmp_path / "marker"
    torch.save({"format": 1, "objects": {"model": Poisoned(str(marker))}}, ckpt / evil_file)
    assert not marker.exists()

    with pytest.raises(CheckpointLoadError, match=r"SHA-256|bytes"):  # not what was signed
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(ckpt)))
    _sign(ckpt)  # even signed (a leaked key), weights_only refuses to run code
    with pytest.raises(CheckpointLoadError) as refused:
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(ckpt)))
    assert isinstance(refused.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()

    # Control: the crafted file really does run code when loaded without weights_only.
    torch.load(ckpt / evil_file, weights_only=False)
    assert marker.read_text() == "code ran"


class _Color(enum.IntEnum):
    RED = 1


_Pair = collections.namedtuple("_Pair", "a b")


@pytest.mark.parametrize(
    "value",
    [
        np.float64(0.5),
        _Color.RED,
        _Pair(1, 2),
        collections.defaultdict(list, a=[1]),
    ],
    ids=["np.float64", "IntEnum", "namedtuple", "defaultdict"],
)
def test_subclasses_of_plain_types_are_rejected_up_front(value):
    """They pickle as their own class, which a weights_only load refuses: accepting them would
    write checkpoints that no restore can read."""
    with pytest.raises(TypeError, match="best"):
        TrainState(torch.nn.Linear(2, 2), best=value)
    state = TrainState(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="best"):
        state["best"] = value


# ---------------------------------------------------------------- epochs and RNG


def test_epochs_resume_after_a_checkpoint_at_the_epoch_boundary(tmp_path):
    def make():
        loader = rt.prepare_data_loader(DataLoader(_dataset(), batch_size=5, shuffle=True), seed=3)
        return loader, TrainState(torch.nn.Linear(2, 2), data_loader=loader)

    loader, state = make()
    seen: dict[int, list[int]] = {}
    ckpt = None
    for epoch in state.epochs(4):
        seen[epoch] = [i for ids, _x, _y in loader for i in ids.tolist()]
        if epoch == 1:
            # The loader ran off the end of epoch 1; the epoch loop has not advanced yet.
            assert (state.epoch, loader.epoch, loader.batch) == (1, 2, 0)
            ckpt = _write(state, tmp_path / "ckpt", stage=False)
    assert sorted(seen) == [0, 1, 2, 3] and seen[2] != seen[3]

    loader2, state2 = make()
    assert state2.restore(rt.Checkpoint(str(ckpt)))
    resumed: dict[int, list[int]] = {}
    for epoch in state2.epochs(4):
        resumed[epoch] = [i for ids, _x, _y in loader2 for i in ids.tolist()]
    assert resumed == {2: seen[2], 3: seen[3]}  # epoch 1 is not replayed


def test_epochs_resume_mid_epoch_keeps_the_position(tmp_path):
    loader = rt.prepare_data_loader(DataLoader(_dataset(), batch_size=5, shuffle=True), seed=3)
    state = TrainState(data_loader=loader, epoch=2)
    loader.set_epoch(2)
    it = iter(loader)
    first = [next(it)[0].tolist() for _ in range(2)]
    ckpt = _write(state, tmp_path / "ckpt", stage=False)
    rest = [ids.tolist() for ids, _x, _y in it]

    loader2 = rt.prepare_data_loader(DataLoader(_dataset(), batch_size=5, shuffle=True), seed=3)
    state2 = TrainState(data_loader=loader2)
    state2.restore(rt.Checkpoint(str(ckpt)))
    epochs = state2.epochs(3)
    assert next(epochs) == 2
    assert [ids.tolist() for ids, _x, _y in loader2] == rest
    assert len(first) == 2 and len(rest) == 3


def test_capture_and_restore_rng_round_trip():
    _seed_all(42)
    random.gauss(0, 1)  # leaves a cached Gaussian in Python's state
    np.random.standard_normal()  # and in NumPy's legacy state (has_gauss)
    saved = capture_rng()
    assert saved["numpy"]["has_gauss"] == 1

    def draw():
        return (
            [random.random(), random.gauss(0, 1)],
            np.random.standard_normal(3).tolist() + np.random.rand(2).tolist(),
            torch.rand(4),
        )

    expected = draw()
    _seed_all(7)
    assert draw()[0] != expected[0]

    # Through the same serialisation a checkpoint uses.
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    restore_rng(torch.load(buf, weights_only=True))
    got = draw()
    assert got[0] == expected[0]
    assert got[1] == expected[1]
    assert torch.equal(got[2], expected[2])


def test_report_outside_a_ringtrain_run_warns_that_the_state_is_not_saved(caplog):
    state = TrainState(torch.nn.Linear(2, 2))
    with caplog.at_level("WARNING", logger="ringtrain"):
        rt.report({"loss": 1.0}, checkpoint=state)
        rt.report({"loss": 0.5}, checkpoint=state)
    warnings = [r for r in caplog.records if "the state is not saved" in r.getMessage()]
    assert len(warnings) == 1  # once per process, not per report
    assert [r.metrics for r in session_mod.current_session().reports] == [
        {"loss": 1.0},
        {"loss": 0.5},
    ]


def test_async_staging_reuses_the_previous_copys_buffers():
    """The second save copies into the first save's host buffers (its write is finished by then)
    instead of allocating: same storage, new values."""
    model = torch.nn.Linear(4, 3)
    state = TrainState(model)
    state._checkpoint_writers(True)
    staged_1 = state._staged[STATE_FILE]["objects"]["model"]["weight"]
    ptr = staged_1.data_ptr()
    with torch.no_grad():
        model.weight.add_(1.0)
    state._checkpoint_writers(True)
    staged_2 = state._staged[STATE_FILE]["objects"]["model"]["weight"]
    assert staged_2.data_ptr() == ptr
    assert torch.equal(staged_2, model.weight.detach())
    assert staged_2.data_ptr() != model.weight.data_ptr()  # still a copy, not the live tensor
