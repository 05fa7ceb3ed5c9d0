"""The elastic in-memory snapshot (``ringtrain.elastic.snapshot.take``) in one process: a copy of
the TrainState at the step it was taken, into reused buffers, with the RNG states kept as
``capture_rng`` returned them (not staged), and no ring replication (issue 19's step overhead).

Restoring a snapshot and training on must give bit-identical parameters and random draws to
training on from the step it was taken (the promise a resize in place rests on).
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ringtrain as rt
from ringtrain.elastic import snapshot as snapshots

SEED = 1234


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, rt.TrainState]:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = TensorDataset(torch.randn(128, 8), torch.randn(128, 2))  # 16 batches, one epoch
    loader = rt.prepare_data_loader(DataLoader(data, batch_size=8, shuffle=True))
    return model, optimizer, rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)


def _train(model, optimizer, state, batches, steps: int) -> list[float]:
    """``steps`` steps (batches from the iterator ``batches``) with dropout-like randomness
    from every RNG; returns the draws."""
    draws = []
    for _ in range(steps):
        x, y = next(batches)
        noise = torch.rand(1).item() + random.random() + float(np.random.rand())
        draws.append(noise)
        loss = torch.nn.functional.mse_loss(model(x) * noise, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step += 1
    return draws


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(60)
def test_snapshot_restores_bit_identical_and_reuses_its_buffers():
    print(f"seed {SEED}")
    random.seed(SEED)
    np.random.seed(SEED)
    model, optimizer, state = _state()
    batches = iter(state.data_loader)
    _train(model, optimizer, state, batches, 2)
    first = snapshots.take(state, None)
    assert first.step == 2
    assert not hasattr(first, "neighbour"), "snapshots are not replicated to a peer"
    buffers = {k: v.data_ptr() for k, v in first.shared["objects"]["model"].items()}
    live = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert not set(buffers.values()) & set(live.values()), "a snapshot owns its tensors"

    _train(model, optimizer, state, batches, 3)
    second = snapshots.take(state, first)  # replaces `first`: its buffers are reused
    assert second.step == 5
    assert {k: v.data_ptr() for k, v in second.shared["objects"]["model"].items()} == buffers
    rng = second.rank["rng"]
    assert torch.equal(rng["torch"], torch.get_rng_state())
    assert rng["python"] == random.getstate()

    expected_draws = _train(model, optimizer, state, batches, 4)
    expected = _params(model)

    # Training goes on after the snapshot (the live state moves); restoring it and training the
    # same steps again gives the same draws and bit-identical parameters.
    _train(model, optimizer, state, batches, 2)
    model2, optimizer2, state2 = _state()
    state2.load_payload(
        {**second.files(0), "train_state.pt": {**second.shared, "elastic": True}},
        source="snapshot",
    )
    assert state2.step == 5
    assert _train(model2, optimizer2, state2, iter(state2.data_loader), 4) == expected_draws
    for got, want in zip(_params(model2), expected, strict=True):
        assert torch.equal(got, want)


@pytest.mark.timeout(60)
def test_snapshot_rng_is_not_aliased_to_a_later_capture():
    """The RNG states a snapshot keeps unstaged are its own: a later snapshot (which reuses the
    earlier one's tensor buffers) does not change them."""
    _, _, state = _state()
    first = snapshots.take(state, None)
    kept = dataclasses.replace(first, rank=dict(first.rank))
    torch_state = kept.rank["rng"]["torch"].clone()
    torch.rand(100)
    random.random()
    snapshots.take(state, first)
    assert torch.equal(kept.rank["rng"]["torch"], torch_state)
