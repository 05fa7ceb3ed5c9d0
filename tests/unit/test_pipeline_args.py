"""``rt.prepare_pipeline``'s argument checks and model splitting, without processes (issue 22):
the errors name the argument and the fix; stages keep the model's parameter names."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

import ringtrain as rt
from ringtrain.parallel.pipeline import chain_units, check_arguments, split_model
from ringtrain.parallel.pipeline_model import StageModule


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        OrderedDict(
            embed=nn.Linear(4, 8),
            blocks=nn.Sequential(*(nn.Linear(8, 8) for _ in range(4))),
            head=nn.Linear(8, 2),
        )
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"schedule": "ZeroBubble"}, r"schedule='ZeroBubble'.*'GPipe', '1F1B', 'Interleaved1F1B'"),
        ({"microbatches": 0}, r"microbatches=0\) must be an int >= 1"),
        ({"microbatches": 2.0}, r"microbatches=2.0\)"),
        ({"data_parallel": "zero"}, r"data_parallel='zero'\): use 'ddp' or 'fsdp'"),
        ({"stages_per_rank": 2}, r"stages_per_rank=2\) needs schedule='Interleaved1F1B'"),
        ({"split_points": ["blocks.9"]}, r"'blocks.9' matches no module.*embed, blocks.0"),
        ({"split_points": ["head", "blocks.1"]}, r"distinct, in the chain's order"),
        ({"split_points": ["embed"]}, r"not its first unit"),
        ({"split_points": "blocks.2"}, r"must be a list of module names"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_group(kwargs, match):
    args = {"split_points": ["blocks.2"], "microbatches": 2, "schedule": "1F1B", **kwargs}
    with pytest.raises((ValueError, TypeError), match=match):
        rt.prepare_pipeline(_model(), **args)


def test_interleaved_defaults_to_two_stages_per_rank():
    assert check_arguments("Interleaved1F1B", 4, None, "ddp") == 2
    assert check_arguments("1F1B", 4, None, "ddp") == 1
    assert check_arguments("Interleaved1F1B", 4, 3, "fsdp") == 3


def test_containers_expand_only_where_a_split_point_lies():
    model = _model()
    assert [n for n, _ in chain_units(model, [])] == ["embed", "blocks", "head"]
    names = [n for n, _ in chain_units(model, ["blocks.2"])]
    assert names == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]


def test_stages_run_the_chain_and_keep_the_model_names():
    model = _model()
    stages = [StageModule(units) for units in split_model(model, ["blocks.2"])]
    assert list(stages[0].state_dict()) == [
        "embed.weight",
        "embed.bias",
        "blocks.0.weight",
        "blocks.0.bias",
        "blocks.1.weight",
        "blocks.1.bias",
    ]
    merged = {**stages[0].state_dict(), **stages[1].state_dict()}
    assert merged.keys() == model.state_dict().keys()
    x = torch.randn(3, 4)
    torch.testing.assert_close(stages[1](stages[0](x)), model(x), rtol=0, atol=0)


def test_a_batch_that_microbatches_do_not_divide_is_refused_at_step():
    from ringtrain.parallel.pipeline_model import PipelineModel

    first = StageModule(split_model(_model(), ["blocks.2"])[0])
    model = PipelineModel([(0, first, first)], 2, 3, "1F1B", None, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"batch size 4 of the inputs is not a multiple of micro"):
        model.step(torch.zeros(4, 4), loss_fn=nn.functional.mse_loss)
    model._check_batch([torch.zeros(3, 4)], None)  # the first batch sets the shape
    with pytest.raises(ValueError, match=r"shape \[\(6, 4\)\], but the stages were set up for"):
        model.step(torch.zeros(6, 4), loss_fn=nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"first stage needs the inputs"):
        model.step(loss_fn=nn.functional.mse_loss)
    with pytest.raises(TypeError, match=r"model.step\(x, target=y, loss_fn=...\)"):
        model(torch.zeros(3, 4))
