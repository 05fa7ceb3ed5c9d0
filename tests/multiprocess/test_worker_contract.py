"""The driver -> worker contract in real workers: each rank reads the typed WorkerConfig that came
in its Start, and its environment holds no RINGTRAIN_* configuration variable (only the channel's
bootstrap, env.BOOTSTRAP_ENV, and what the driver's own environment already had); a CPU worker
(use_gpu=False) sees no GPU, even on a machine that has some."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import ringtrain as rt
from ringtrain.cluster.env import BOOTSTRAP_ENV
from ringtrain.trainer import run_workers
from ringtrain.wire.payload import pickle_payload


def contract_fn(config):
    """Reports what this rank was told (its WorkerConfig, as a dict) and the RINGTRAIN_*
    variables of its environment."""
    from ringtrain.worker import session

    ctx = rt.get_context()
    worker_config = session.current_session().worker_config
    assert worker_config is ctx.config
    rt.report(
        {
            "config": dataclasses.asdict(worker_config),
            "ctx": [ctx.world_rank, ctx.world_size, ctx.attempt, ctx.run_dir, ctx.use_gpu],
            "env": sorted(name for name in os.environ if name.startswith("RINGTRAIN_")),
            # A CPU worker sees none of the machine's GPUs (worker_env.cpu_worker_devices).
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "cuda_available": torch.cuda.is_available(),
        }
    )


@pytest.mark.timeout(300)
def test_workers_read_the_typed_config_and_no_configuration_variables(tmp_path):
    """One elastic launch at W=3 (num_workers=(2, 3)): the timeouts, timing, step limit, checkpoint
    mode and elastic settings the driver built arrive typed in every rank."""
    result = run_workers(
        name="contract",
        entrypoint="contract_fn",
        scaling_config=rt.ScalingConfig(num_workers=(2, 3), elastic_batch_policy="accumulate"),
        run_config=rt.RunConfig(
            storage_path=str(tmp_path),
            progress="off",
            failure_config=rt.FailureConfig(worker_timeout_s=97.5, snapshot_interval_steps=4),
            checkpoint_config=rt.CheckpointConfig(async_save=True),
            monitor_config=rt.MonitorConfig(
                timing=True, timing_interval_s=0.75, comm_timing="wait"
            ),
        ),
        payload=pickle_payload(contract_fn, {}),
        max_steps=1000,
    )
    assert result.error is None, result.error
    assert sorted(result.metrics_per_rank) == [0, 1, 2]
    driver_has = {name for name in os.environ if name.startswith("RINGTRAIN_")}
    for rank, metrics in result.metrics_per_rank.items():
        config = metrics["config"]
        assert config["worker_timeout_s"] == 97.5, (rank, config)
        assert config["timing_interval_s"] == 0.75 and config["comm_timing"] == "wait"
        assert config["max_steps"] == 1000 and config["async_checkpoint"] is True
        assert (config["attempt"], config["start_round"], config["use_gpu"]) == (0, 0, False)
        assert config["elastic"] == {
            "min_workers": 2,
            "max_workers": 3,
            "snapshot_interval_steps": 4,
            "grow": True,
            "joining": False,
            "carry_rng": False,  # no hot spares
        }
        assert config["elastic_batch_policy"] == "accumulate"
        assert config["run_dir"] == result.path
        assert metrics["ctx"] == [rank, 3, 0, result.path, False]
        assert metrics["cuda_visible_devices"] == "" and metrics["cuda_available"] is False
        extra = set(metrics["env"]) - BOOTSTRAP_ENV - driver_has
        assert not extra, f"rank {rank}: configuration variables in the environment: {extra}"
