"""DiLoCo without processes (issue 41): the config's validation, the fragments, the int8
encoding, the bad-input errors of ``prepare_model``, and the outer loop's arithmetic on one
replica against Algorithm 1 of the paper written out by hand."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import ringtrain as rt
from ringtrain.parallel.diloco import outer_sync
from ringtrain.parallel.diloco_exchange import (
    Exchange,
    Topology,
    _dequantize_mean,
    _quantize,
    check_outer_dtype,
    owners,
)
from ringtrain.parallel.diloco_fragments import model_layers, split_fragments


@pytest.mark.parametrize(
    ("kwargs", "error", "names"),
    [
        ({"sync_every": 0}, ValueError, "DiLoCoConfig.sync_every must be >= 1"),
        ({"sync_every": 2.5}, TypeError, "DiLoCoConfig.sync_every must be an int"),
        ({"fragments": 0}, ValueError, "DiLoCoConfig.fragments must be >= 1"),
        ({"sync_every": 4, "fragments": 5}, ValueError, "DiLoCoConfig.fragments=5 exceeds"),
        ({"sync_every": 10, "fragments": 2, "sync_delay": 5}, ValueError, "sync_delay=5"),
        ({"sync_delay": -1}, ValueError, "DiLoCoConfig.sync_delay must be >= 0"),
        ({"outer_lr": 0}, ValueError, "DiLoCoConfig.outer_lr must be > 0"),
        ({"outer_momentum": 1.0}, ValueError, "DiLoCoConfig.outer_momentum must be in [0, 1)"),
        ({"outer_lr": "fast"}, TypeError, "DiLoCoConfig.outer_lr must be a number"),
        ({"outer_dtype": "fp8"}, ValueError, "DiLoCoConfig.outer_dtype='fp8' is not supported"),
        ({"merge_alpha": 0.5}, ValueError, "DiLoCoConfig.merge_alpha=0.5 needs an overlapped"),
        ({"sync_delay": 1, "merge_alpha": 2}, ValueError, "merge_alpha must be in [0, 1]"),
        ({"outer_optimizer": 3}, TypeError, "DiLoCoConfig.outer_optimizer must be a factory"),
        (
            {"outer_optimizer": torch.optim.SGD, "outer_lr": 0.5},
            ValueError,
            "outer_lr only configure the default",
        ),
        ({"preempt_at_sync": 1}, TypeError, "DiLoCoConfig.preempt_at_sync must be True"),
    ],
)
def test_bad_configs_name_the_field(kwargs, error, names):
    with pytest.raises(error) as info:
        rt.DiLoCoConfig(**kwargs)
    assert names in str(info.value)


def test_defaults_and_their_sources():
    config = rt.DiLoCoConfig()
    assert config.sync_every == 500  # DiLoCo section 3
    assert (config.resolved_outer_lr, config.resolved_outer_momentum) == (0.7, 0.9)
    assert config.resolved_merge_alpha == 0.0
    assert rt.DiLoCoConfig(sync_every=10, sync_delay=1).resolved_merge_alpha == 0.5
    staggered = rt.DiLoCoConfig(sync_every=12, fragments=3)
    assert [staggered.offset(f) for f in range(3)] == [4, 8, 0]  # fragment 2 ends the period


def _gpt_like() -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.ModuleList(
        nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)) for _ in range(6)
    )
    return nn.ModuleDict({"embed": nn.Embedding(10, 8), "blocks": blocks, "head": nn.Linear(8, 10)})


def test_fragments_are_strided_whole_layers_and_cover_every_parameter_once():
    model = _gpt_like()
    assert model_layers(model) == ("blocks", [f"blocks.{i}" for i in range(6)])
    names = [n for n, _ in model.named_parameters()]
    fragments = split_fragments(model, 3)
    assert sorted(i for f in fragments for i in f) == list(range(len(names)))
    layer_of = {
        f: {names[i].split(".")[1] for i in fr if names[i].startswith("blocks.")}
        for f, fr in enumerate(fragments)
    }
    assert layer_of == {0: {"0", "3"}, 1: {"1", "4"}, 2: {"2", "5"}}  # strided (section 2.2)
    sizes = [sum(dict(model.named_parameters())[names[i]].numel() for i in f) for f in fragments]
    assert max(sizes) < sum(sizes) / 3 * 1.5  # embedding and head spread to the lightest
    assert split_fragments(model, 1) == [list(range(len(names)))]


def test_fragments_that_do_not_divide_the_layers_are_refused_naming_the_field():
    with pytest.raises(
        ValueError,
        match=r"DiLoCoConfig.fragments=4 does not divide the model's 6 layers .*\[1, 2, 3, 6\]",
    ):
        split_fragments(_gpt_like(), 4)
    with pytest.raises(ValueError, match=r"DiLoCoConfig\.fragments=8: the model has 6 layers"):
        split_fragments(_gpt_like(), 8)


def test_int8_round_trip_and_the_mean_of_replicas():
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(5, 3, generator=g), torch.zeros(4), torch.randn(7, generator=g) * 1e-3]
    payload = _quantize(tensors)
    assert payload.dtype == torch.int8 and payload.numel() == 15 + 4 + 7 + 4 * (3 + 1)
    sizes = [t.numel() for t in tensors]
    (back,) = [torch.cat(_dequantize_mean([payload], sizes))]
    for t, b in zip(tensors, back.split(sizes), strict=True):
        assert (t.reshape(-1) - b).abs().max() <= t.abs().max() / 127 / 2 + 1e-12
    other = _quantize([2 * t for t in tensors])
    mean = torch.cat(_dequantize_mean([payload, other], sizes))
    assert torch.allclose(mean, 1.5 * torch.cat([t.reshape(-1) for t in tensors]), atol=2e-2)


def test_one_replica_exchanges_nothing_and_island_shares_are_balanced():
    deltas = [torch.ones(3), torch.full((2,), 2.0)]
    for dtype in ("fp32", "bf16", "int8"):
        exchange = Exchange(deltas, Topology(replicas=1), dtype)
        assert exchange.bytes_sent == 0
        assert all(torch.equal(a, b) for a, b in zip(exchange.wait(), deltas, strict=True))
    assert owners([100, 10, 60, 50], 2) == [0, 0, 1, 1]  # loads 110 and 110


def test_a_backend_that_cannot_reduce_the_outer_dtype_is_named():
    check_outer_dtype("bf16", "gloo")
    check_outer_dtype("int8", "mpi")  # gathered as bytes
    with pytest.raises(ValueError, match=r"DiLoCoConfig\.outer_dtype='bf16': the 'mpi' process"):
        check_outer_dtype("bf16", "mpi")


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"comm_hook": "bf16"}, "comm_hook configure a gradient all-reduce at every step"),
        ({"bucket_cap_mb": 1}, "bucket_cap_mb configure a gradient all-reduce"),
        ({"fsdp_config": rt.FSDPConfig()}, "FSDP over every rank all-reduces at every step"),
        ({"tp_plan": {"0": "colwise"}}, "drop tp_plan"),
        ({"diloco_config": {"sync_every": 5}}, "must be a ringtrain.DiLoCoConfig"),
    ],
)
def test_prepare_model_refuses_strategies_diloco_cannot_combine_with(kwargs, names):
    with pytest.raises((ValueError, TypeError), match=names):
        rt.prepare_model(nn.Linear(2, 2), parallel_strategy="diloco", **kwargs)
    with pytest.raises(
        ValueError, match=r"diloco_config=\.\.\.\) needs parallel_strategy='diloco'"
    ):
        rt.prepare_model(nn.Linear(2, 2), diloco_config=rt.DiLoCoConfig())


def test_a_loop_without_a_prepared_optimizer_is_refused_at_its_first_step():
    model = rt.prepare_model(nn.Linear(2, 2), parallel_strategy="diloco")
    state = rt.TrainState(model=model)
    with pytest.raises(RuntimeError, match=r"wrap it with rt.prepare_optimizer"):
        state.step += 1


def test_the_outer_loop_follows_algorithm_1_on_one_replica():
    """H=3, Nesterov (lr 0.7, momentum 0.9) outside, SGD inside, one replica: the global and
    local parameters after 7 inner steps equal Algorithm 1 computed by hand."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1, bias=False)
    hand = net.weight.detach().clone()
    config = rt.DiLoCoConfig(sync_every=3)
    model = rt.prepare_model(net, parallel_strategy="diloco", diloco_config=config)
    optimizer = rt.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    xs = [torch.randn(8, 4) for _ in range(7)]
    local, global_, momentum = hand.clone(), hand.clone(), torch.zeros_like(hand)
    for t, x in enumerate(xs, start=1):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        w = local.clone().requires_grad_()
        (x @ w.T).pow(2).mean().backward()
        local = local - 0.1 * w.grad
        if t % 3 == 0:
            delta = global_ - local
            momentum = 0.9 * momentum + delta
            global_ = global_ - 0.7 * (delta + 0.9 * momentum)  # Nesterov
            local = global_.clone()
    sync = outer_sync(model)
    assert (sync.inner_steps, sync.outer_steps) == (7, 2)
    assert torch.allclose(sync.global_params[0], global_, atol=1e-6)
    assert torch.allclose(model.weight, local, atol=1e-6)
    assert not torch.allclose(model.weight, sync.global_params[0])  # step 7 is past the sync


def test_any_torch_optimizer_factory_is_the_outer_optimizer():
    factory = functools.partial(torch.optim.Adam, lr=0.01)
    model = rt.prepare_model(
        nn.Linear(2, 1),
        parallel_strategy="diloco",
        diloco_config=rt.DiLoCoConfig(sync_every=1, outer_optimizer=factory),
    )
    optimizer = rt.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    model(torch.ones(3, 2)).sum().backward()
    optimizer.step()
    assert isinstance(outer_sync(model).outer, torch.optim.Adam)
    assert outer_sync(model).outer.state[outer_sync(model).global_params[0]]["step"] == 1


def test_an_overlapped_exchange_lands_sync_delay_steps_later_and_merges_with_alpha():
    """Streaming DiLoCo's overlap (arXiv:2501.18512 section 2.3) on one replica: H=3,
    ``sync_delay=1``, ``merge_alpha=0.5``: the outer gradient taken at step 3 is applied at
    step 4, where the local parameters become the mean of themselves and the new global ones."""
    torch.manual_seed(0)
    net = nn.Linear(4, 1, bias=False)
    hand = net.weight.detach().clone()
    config = rt.DiLoCoConfig(sync_every=3, sync_delay=1)
    model = rt.prepare_model(net, parallel_strategy="diloco", diloco_config=config)
    optimizer = rt.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sync = outer_sync(model)
    local, global_, momentum, sent = hand.clone(), hand.clone(), torch.zeros_like(hand), None
    in_flight = []
    for t in range(1, 8):
        x = torch.randn(8, 4)
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        in_flight.append(sync.in_flight)
        w = local.clone().requires_grad_()
        (x @ w.T).pow(2).mean().backward()
        local = local - 0.1 * w.grad
        if sent is not None:  # due: one step after it left
            momentum = 0.9 * momentum + sent
            global_ = global_ - 0.7 * (sent + 0.9 * momentum)
            local = 0.5 * local + 0.5 * global_
            sent = None
        if t % 3 == 0:
            sent = global_ - local
    assert in_flight == [None, None, 0, None, None, 0, None]
    assert sync.outer_steps == 2
    assert torch.allclose(sync.global_params[0], global_, atol=1e-6)
    assert torch.allclose(model.weight, local, atol=1e-6)


def test_fragments_leave_at_staggered_steps():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    config = rt.DiLoCoConfig(sync_every=6, fragments=3, sync_delay=1)
    model = rt.prepare_model(net, parallel_strategy="diloco", diloco_config=config)
    optimizer = rt.prepare_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sync = outer_sync(model)
    seen = []
    for _ in range(12):
        model(torch.ones(1, 2)).sum().backward()
        optimizer.step()
        seen.append(sync.in_flight)
    assert seen == [None, 0, None, 1, None, 2] * 2
    assert sync.outer_steps == 5  # fragment 2's second exchange (step 12) is still in flight
