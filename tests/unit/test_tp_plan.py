"""Tensor-parallel plans and the mesh strategy, without processes (issue 22): patterns expand to
module names, and a plan that cannot apply is refused with the pattern and the fix named."""

from __future__ import annotations

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import ringtrain as rt
from parallel_workloads import TP_PLAN, TinyGPT
from ringtrain.parallel.tensor import check_tp_plan, resolve_tp_plan
from ringtrain.prepare import mesh_strategy


def test_patterns_expand_to_every_matching_module_with_torch_styles() -> None:
    plan = resolve_tp_plan(TinyGPT(), {**TP_PLAN, "ln": "sequence"})
    assert sorted(plan) == [
        "blocks.0.attn.proj",
        "blocks.0.attn.qkv",
        "blocks.0.mlp.fc1",
        "blocks.0.mlp.fc2",
        "blocks.1.attn.proj",
        "blocks.1.attn.qkv",
        "blocks.1.mlp.fc1",
        "blocks.1.mlp.fc2",
        "ln",
    ]
    assert isinstance(plan["blocks.1.attn.qkv"], ColwiseParallel)
    assert isinstance(plan["blocks.0.mlp.fc2"], RowwiseParallel)
    assert isinstance(plan["ln"], SequenceParallel)
    style = ColwiseParallel(use_local_output=False)
    assert resolve_tp_plan(TinyGPT(), {"head": style})["head"] is style  # objects as given


def test_a_pattern_that_matches_nothing_is_named() -> None:
    with pytest.raises(ValueError, match=r"'blocks\.\*\.attn\.wq' matches no module .*blocks\.0"):
        resolve_tp_plan(TinyGPT(), {"blocks.*.attn.wq": "colwise"})
    with pytest.raises(ValueError, match=r"'blocks\.0\.mlp\.fc1' is matched by both"):
        resolve_tp_plan(TinyGPT(), {"blocks.*.mlp.fc1": "colwise", "blocks.0.*": "rowwise"})


@pytest.mark.parametrize(
    ("plan", "error", "match"),
    [
        (["blocks.*.attn.qkv"], TypeError, r"tp_plan must be a dict"),
        ({"blocks.*.attn.qkv": "column"}, ValueError, r"= 'column': use one of 'colwise'"),
        ({3: "colwise"}, TypeError, r"keys must be module-name patterns"),
    ],
)
def test_malformed_plans_are_refused_when_the_strategy_is_built(plan, error, match) -> None:
    with pytest.raises(error, match=match):
        check_tp_plan(plan)
    with pytest.raises(error, match=match):
        rt.ParallelStrategy(tp_plan=plan)


def test_the_mesh_strategy_refuses_ddp_options_and_other_strategies() -> None:
    strategy = mesh_strategy("ddp", None, TP_PLAN, {"bucket_order": "fixed", "comm_hook": None})
    assert isinstance(strategy, rt.ParallelStrategy) and strategy.fsdp == rt.FSDPConfig()
    with pytest.raises(ValueError, match=r"comm_hook only apply to DDP.*drop them"):
        mesh_strategy("ddp", None, TP_PLAN, {"comm_hook": "bf16"})
    with pytest.raises(ValueError, match=r"parallel_strategy=None\): tensor parallelism"):
        mesh_strategy(None, None, TP_PLAN, {})
    with pytest.raises(TypeError, match=r"ParallelStrategy\.fsdp must be a ringtrain\.FSDPConfig"):
        rt.ParallelStrategy(fsdp={"mixed_precision": "bf16"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"with FSDP use fsdp_config"):
        rt.ParallelStrategy().check("bf16-mixed")
