"""prepare_model's strategies (ringtrain.parallel): which object the keywords select, how each
validates its options (before any process group), and the strategy= seam. No processes: the
wrapping itself runs at world size 1 in this process (DDP is then a no-op) or with a custom
strategy; the multiprocess tests (test_comm_ddp.py, test_fsdp.py, test_amp.py) cover DDP and FSDP
across ranks."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

import ringtrain as rt
from ringtrain.parallel import (
    DDPStrategy,
    FSDPStrategy,
    LocalStrategy,
    ModelStrategy,
    WrapContext,
    strategy_from_kwargs,
)
from ringtrain.worker.precision import PrecisionPlugin, precision_plugin
from ringtrain.worker.session import current_hooks


def test_the_keywords_select_one_strategy_object():
    assert strategy_from_kwargs() == DDPStrategy()
    assert strategy_from_kwargs(None) == LocalStrategy()
    assert strategy_from_kwargs("fsdp") == FSDPStrategy(rt.FSDPConfig())
    cfg = rt.FSDPConfig(mixed_precision="bf16", min_num_params=10)
    assert strategy_from_kwargs("fsdp", cfg) == FSDPStrategy(cfg)
    chosen = strategy_from_kwargs(
        "ddp",
        comm_hook="powersgd",
        comm_hook_options={"matrix_approximation_rank": 2},
        bucket_cap_mb=5,
        static_graph=True,
        find_unused_parameters=None,
        bucket_order="rebuild",
        ddp_kwargs={"gradient_as_bucket_view": True},
    )
    assert chosen == DDPStrategy(
        comm_hook="powersgd",
        comm_hook_options={"matrix_approximation_rank": 2},
        bucket_cap_mb=5,
        static_graph=True,
        bucket_order="rebuild",
        ddp_kwargs={"gradient_as_bucket_view": True},
    )
    # The fields that are set, merged into DDP's own arguments once.
    assert chosen.ddp_arguments() == {
        "gradient_as_bucket_view": True,
        "bucket_cap_mb": 5,
        "static_graph": True,
    }
    # parallel_strategy=None: DDP options are still validated, and have no effect.
    assert strategy_from_kwargs(None, comm_hook="bf16") == LocalStrategy()
    with pytest.raises(ValueError, match=r"prepare_model\(comm_hook='int8'\)"):
        strategy_from_kwargs(None, comm_hook="int8")
    for s in (DDPStrategy(), FSDPStrategy(), LocalStrategy()):
        assert isinstance(s, ModelStrategy)
    assert [s.name for s in (DDPStrategy(), FSDPStrategy(), LocalStrategy())] == [
        "ddp",
        "fsdp",
        "none",
    ]


KEYWORD_ERRORS: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"parallel_strategy": "zero"}, ValueError, "parallel_strategy='zero') is not supported"),
    ({"fsdp_config": rt.FSDPConfig()}, ValueError, "needs parallel_strategy='fsdp'"),
    (
        {"parallel_strategy": "fsdp", "bucket_cap_mb": 10, "comm_hook": "bf16"},
        ValueError,
        "comm_hook, bucket_cap_mb only apply to DDP",
    ),
    (
        {"parallel_strategy": "fsdp", "bucket_order": "rebuild"},
        ValueError,
        "bucket_order only apply to DDP",
    ),
    ({"parallel_strategy": "fsdp", "fsdp_config": {}}, TypeError, "must be a ringtrain.FSDPConfig"),
    ({"bucket_order": "sorted"}, ValueError, "prepare_model(bucket_order='sorted')"),
    ({"comm_hook": "int8"}, ValueError, "prepare_model(comm_hook='int8') is not supported"),
    ({"bucket_cap_mb": 0}, ValueError, "prepare_model(bucket_cap_mb=0)"),
    ({"static_graph": "yes"}, ValueError, "static_graph='yes') must be True or False"),
    (
        {"find_unused_parameters": True, "ddp_kwargs": {"find_unused_parameters": False}},
        ValueError,
        "contradicts ddp_kwargs['find_unused_parameters']",
    ),
    ({"ddp_kwargs": {"device_ids": [0]}}, ValueError, "ringtrain sets device_ids"),
    (
        {"ddp_kwargs": {"bucket_order": "fixed"}},
        ValueError,
        "pass prepare_model(bucket_order=...)",
    ),
    (
        {"comm_hook": "powersgd", "comm_hook_options": {"rank": 2}},
        ValueError,
        "unknown PowerSGD option(s) ['rank']",
    ),
    (
        {"comm_hook": "bf16", "comm_hook_options": {"matrix_approximation_rank": 2}},
        ValueError,
        "only applies to comm_hook='powersgd'",
    ),
    ({"precision": "fp8"}, ValueError, "precision='fp8' is not supported"),
    (
        {"parallel_strategy": "fsdp", "precision": "bf16-mixed"},
        ValueError,
        "fsdp_config=FSDPConfig(mixed_precision='bf16')",
    ),
]


@pytest.mark.parametrize(("kwargs", "error", "message"), KEYWORD_ERRORS)
def test_keyword_errors_keep_their_messages_and_come_before_any_process_group(
    kwargs, error, message
):
    with pytest.raises(error) as info:
        rt.prepare_model(nn.Linear(2, 2), **kwargs)
    assert message in str(info.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: DDPStrategy(comm_hook="int8"), "DDPStrategy(comm_hook='int8') is not supported"),
        (lambda: DDPStrategy(bucket_cap_mb=-1), "DDPStrategy(bucket_cap_mb=-1) must be"),
        (lambda: DDPStrategy(bucket_order="x"), "DDPStrategy(bucket_order='x') is not supported"),
        (
            lambda: DDPStrategy(ddp_kwargs={"bucket_order": "fixed"}),
            "pass DDPStrategy(bucket_order=...)",
        ),
        (
            lambda: DDPStrategy(comm_hook="powersgd", comm_hook_options={"start_powerSGD_iter": 1}),
            "start_powerSGD_iter=1 must be >= 2",
        ),
    ],
)
def test_a_strategy_object_validates_its_own_fields(build, message):
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value)


def test_fsdp_strategy_owns_its_precision():
    with pytest.raises(TypeError, match=r"FSDPStrategy.config must be a ringtrain.FSDPConfig"):
        FSDPStrategy({"mixed_precision": "bf16"})  # type: ignore[arg-type]
    for ok in ("32", "32-true", "fp32", 32):
        assert FSDPStrategy().check(ok) == "32"
    with pytest.raises(ValueError, match="mixed_precision='bf16'"):
        FSDPStrategy().check("16-mixed")
    assert DDPStrategy().check("32-true") == "32"
    assert LocalStrategy().check("bf16-mixed") == "bf16-mixed"


def test_a_strategy_is_frozen_and_copies_the_dicts_it_is_given():
    options = {"matrix_approximation_rank": 2}
    s = DDPStrategy(comm_hook="powersgd", comm_hook_options=options)
    options["matrix_approximation_rank"] = 0  # would be invalid; the strategy kept its copy
    assert s.comm_hook_options == {"matrix_approximation_rank": 2}
    with pytest.raises(AttributeError):
        s.comm_hook = "bf16"  # type: ignore[misc]


def test_strategy_and_its_keywords_are_not_mixed():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"drop comm_hook, fsdp_config"):
        rt.prepare_model(
            model, strategy=rt.DDPStrategy(), comm_hook="bf16", fsdp_config=rt.FSDPConfig()
        )
    with pytest.raises(ValueError, match=r"drop parallel_strategy"):
        rt.prepare_model(model, strategy=rt.FSDPStrategy(), parallel_strategy="fsdp")
    with pytest.raises(TypeError, match=r"must be a strategy object"):
        rt.prepare_model(model, strategy="ddp")  # type: ignore[arg-type]
    # Not strategy options: allowed with strategy=.
    out = rt.prepare_model(model, strategy=LocalStrategy(), precision="bf16-mixed")
    assert out is model
    assert not dist.is_initialized()


def test_at_world_size_one_ddp_returns_the_placed_module_and_records_the_precision():
    model = nn.Linear(3, 1)
    out = rt.prepare_model(model, strategy=rt.DDPStrategy(comm_hook="bf16"), precision="bf16-mixed")
    assert out is model and not dist.is_initialized()
    assert out(torch.ones(2, 3)).dtype == torch.float32  # autocast inside, fp32 outside
    # Precision is a plug-in of this worker's session, registered once.
    plugins = [p for p in current_hooks().plugins() if isinstance(p, PrecisionPlugin)]
    assert plugins == [precision_plugin()] and plugins[0].precision == "bf16-mixed"
    optimizer = rt.prepare_optimizer(torch.optim.SGD(out.parameters(), lr=0.1))
    assert optimizer.grad_scaler is None and precision_plugin().optimizer is optimizer
    rt.prepare_model(nn.Linear(3, 1), precision="16-mixed")
    assert precision_plugin().precision == "16-mixed"
    assert len([p for p in current_hooks().plugins() if isinstance(p, PrecisionPlugin)]) == 1


class _Doubling(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * self.module(x)


class DoublingStrategy:
    """A strategy that is none of ringtrain's: what issue 22's mesh strategies plug into."""

    name: ClassVar[str] = "doubling"

    def __init__(self) -> None:
        self.seen: list[WrapContext] = []

    def check(self, precision: object) -> str:
        if precision != "32":
            raise ValueError("DoublingStrategy runs in float32 only")
        return "32"

    def place(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        return model.to(ctx.device)

    def wrap(self, model: nn.Module, ctx: WrapContext) -> nn.Module:
        self.seen.append(ctx)
        return _Doubling(model)


def test_any_object_with_the_three_methods_is_a_strategy():
    strategy = DoublingStrategy()
    assert isinstance(strategy, ModelStrategy)
    model = nn.Linear(2, 1)
    wrapped = rt.prepare_model(model, strategy=strategy)
    assert isinstance(wrapped, _Doubling) and wrapped.module is model
    x = torch.ones(1, 2)
    torch.testing.assert_close(wrapped(x), 2 * model(x))
    (ctx,) = strategy.seen
    assert ctx.world_size == 1 and ctx.device == torch.device("cpu") and ctx.precision == "32"
    with pytest.raises(ValueError, match="float32 only"):
        rt.prepare_model(model, strategy=strategy, precision="bf16-mixed")
