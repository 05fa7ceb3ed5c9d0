"""The train function of tests/multiprocess/test_hsdp_elastic.py: HSDP (FSDP2 on
``ParallelConfig(dp_replicate=-1, dp_shard=2)``) with a TrainState, under elastic resizing."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import torch
from torch.utils.data import DataLoader

import ringtrain as rt
from workloads import IndexedDataset, _elastic_grow_hooks, elastic_step


def hsdp_elastic_fn(config: dict[str, Any]) -> None:
    """Momentum SGD on a two-layer MLP sharded over ``dp_shard`` and replicated over
    ``dp_replicate``; a TrainState report with a checkpoint every ``every`` steps. Per step, every
    rank appends ``{pid, attempt, world, rank, step, epoch, ids, coords}`` to
    ``{config["log"]}/{pid}.jsonl``. On attempt 0 at world size ``first_world``, rank
    ``kill_rank`` SIGKILLs itself right after step ``kill_step``. The grow-back hooks of
    :func:`workloads._elastic_grow_hooks` apply. Rank 0 saves the full parameters to
    ``config["out"]``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    ctx = rt.get_context()
    first_world = ctx.attempt == 0 and ctx.world_size == config["first_world"]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = rt.prepare_model(net, parallel_strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = rt.prepare_data_loader(
        DataLoader(IndexedDataset(), batch_size=config["batch_size"], shuffle=True)
    )
    state = rt.TrainState(model=model, optimizer=optimizer, data_loader=loader)
    state.restore()
    mesh = ctx.mesh
    coords = {name: mesh[name].get_local_rank() for name in ("dp_replicate", "dp_shard")}
    log = os.path.join(config["log"], f"{os.getpid()}.jsonl")
    for epoch in state.epochs(config["epochs"]):
        for x, y, ids in loader:
            _, record = elastic_step(model, optimizer, state, x, y, ids, epoch)
            record.update(coords=coords, replicas=mesh["dp_replicate"].size())
            with open(log, "a") as f:
                f.write(json.dumps(record) + "\n")
            killed = first_world and record["rank"] == config["kill_rank"]
            if killed and state.step == config["kill_step"]:
                os.kill(os.getpid(), signal.SIGKILL)
            _elastic_grow_hooks(config, state.step)
            if state.step % config["every"] == 0:
                rt.report({"step": state.step}, checkpoint=state)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rt.get_context().world_rank == 0:
        torch.save({"model": full, "step": state.step}, config["out"])
