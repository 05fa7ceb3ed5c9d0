"""rt.prepare_deepspeed's config checks and the weights_only loader of DeepSpeed's files, without
processes (issue 22; the training itself: tests/multiprocess/test_deepspeed.py)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from ringtrain.parallel.deepspeed import _check_config

deepspeed = pytest.importorskip(
    "deepspeed", reason="DeepSpeed is not installed (pip install 'ringtrain[deepspeed]')"
)


class Payload:
    """A class no allow-list names: unpickling it would run ``__reduce__``'s callable."""

    def __reduce__(self):
        return (print, ("executed",))


@pytest.mark.parametrize(
    ("config", "world", "names"),
    [
        ({"optimizer": {}}, 2, ["train_micro_batch_size_per_gpu"]),
        (
            {
                "train_batch_size": 16,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 1,
            },
            3,
            ["train_batch_size", "12"],
        ),
        ({"train_batch_size": 10}, 4, ["train_batch_size", "multiple of 4"]),
        ({"train_micro_batch_size_per_gpu": 0}, 2, ["train_micro_batch_size_per_gpu", ">= 1"]),
        (
            {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 4}},
            2,
            ["zero_optimization", "0, 1, 2 or 3"],
        ),
        (
            {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}},
            2,
            ["fp16", "bf16"],
        ),
    ],
)
def test_bad_config_is_refused_naming_field_and_fix(config, world, names) -> None:
    if "fp16" in config and torch.cuda.is_available():
        pytest.skip("fp16 is refused only without a GPU")
    with pytest.raises(ValueError) as info:
        _check_config(config, world)
    for name in names:
        assert name in str(info.value), str(info.value)


def test_consistent_configs_pass() -> None:
    _check_config({"train_micro_batch_size_per_gpu": 4}, 3)
    _check_config({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4}, 3)
    _check_config(
        {
            "train_batch_size": 24,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": 3},
        },
        3,
    )
    with pytest.raises(TypeError, match=r"json\.load"):
        _check_config("ds_config.json", 2)  # type: ignore[arg-type]


def test_deepspeed_files_load_weights_only_under_the_allow_list(tmp_path, capsys) -> None:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.utils.tensor_fragment import fragment_address

    from ringtrain.checkpoint.deepspeed_io import safe_load, weights_only_torch_load

    good = tmp_path / "good.pt"
    torch.save({"loss_scaler": LossScaler(1.0), "a": fragment_address(3, 4)}, good)
    loaded = safe_load(str(good), weights_only=False)  # the caller's False is overridden
    assert loaded["a"] == fragment_address(3, 4)
    hostile = tmp_path / "hostile.pt"
    torch.save({"x": Payload()}, hostile)
    with pytest.raises(pickle.UnpicklingError):
        safe_load(str(hostile))
    with weights_only_torch_load(), pytest.raises(pickle.UnpicklingError):
        torch.load(io.BytesIO(hostile.read_bytes()), weights_only=False)
    assert "executed" not in capsys.readouterr().out
    assert torch.load(good, weights_only=False)["a"].numel == 3  # restored after the block
