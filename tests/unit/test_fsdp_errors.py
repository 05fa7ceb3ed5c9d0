"""FSDP2's clear errors, without processes: bad FSDPConfig values, prepare_model's refusals
before any process group, the size policy with tied weights, export errors (the runs:
tests/multiprocess/test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsdp_workloads as fw
import ringtrain as rt
from ringtrain.cli import main as cli_main


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.block = fw.Block(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mixed_precision": "bf32"}, ValueError, "mixed_precision must be 'bf16'"),
        ({"shard_modules": [fw.Block()]}, TypeError, "pass the class itself"),
        ({"shard_modules": []}, TypeError, "non-empty list"),
        ({"min_num_params": 0}, ValueError, "min_num_params must be >= 1"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload must be True or False"),
        ({"init_fn": 3}, TypeError, "init_fn must be a function"),
    ],
)
def test_fsdp_config_rejects_bad_values(kwargs, error, match):
    with pytest.raises(error, match=match):
        rt.FSDPConfig(**kwargs)


def test_prepare_model_errors_before_any_process_group():
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"Embedding does not occur in the model"):
        rt.prepare_model(
            fw.TinyNet(),
            parallel_strategy="fsdp",
            fsdp_config=rt.FSDPConfig(shard_modules=[fw.Block, nn.Embedding]),
        )
    with torch.device("meta"):
        meta = fw.TinyNet()
    with pytest.raises(ValueError, match=r"meta device .* FSDPConfig\.init_fn is None"):
        rt.prepare_model(meta, parallel_strategy="fsdp")
    with pytest.raises(ValueError, match="tied weights"):
        rt.prepare_model(
            Tied(), parallel_strategy="fsdp", fsdp_config=rt.FSDPConfig(shard_modules=[nn.Linear])
        )
    with pytest.raises(ValueError, match="bucket_cap_mb only apply to DDP"):
        rt.prepare_model(fw.TinyNet(), parallel_strategy="fsdp", bucket_cap_mb=10)
    with pytest.raises(ValueError, match="mixed_precision='bf16'"):
        rt.prepare_model(fw.TinyNet(), parallel_strategy="fsdp", precision="bf16-mixed")
    with pytest.raises(ValueError, match="needs parallel_strategy='fsdp'"):
        rt.prepare_model(fw.TinyNet(), fsdp_config=rt.FSDPConfig())
    assert not dist.is_initialized()


def test_size_policy_keeps_tied_weights_in_one_unit():
    from ringtrain.parallel.fsdp import select_units

    units = select_units(Tied(), rt.FSDPConfig(min_num_params=40))
    names = [name for name, _ in units]
    # emb (40 parameters) is big enough, but shares its weight with head: both stay in the root
    assert names == ["block.up", "block.down"]


def test_export_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        rt.export_model(tmp_path / "nothing", tmp_path / "x.pt")
    (tmp_path / "empty_run").mkdir()
    assert cli_main(["export", str(tmp_path / "empty_run"), str(tmp_path / "x.pt")]) == 1
    with pytest.raises(ValueError, match="dtype='int8'"):
        rt.export_model(tmp_path, tmp_path / "x.pt", dtype="int8")
