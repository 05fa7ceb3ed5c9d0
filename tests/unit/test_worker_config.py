"""The typed driver -> worker contract (``WorkerConfig`` inside ``Start``) and the cluster
environments of ``env.py``, one class each with ``detect()``: pure logic, no processes."""

from __future__ import annotations

import dataclasses
import pickle
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler

import pytest

import ringtrain as rt
from ringtrain.cluster.env import (
    BOOTSTRAP_ENV,
    ENVIRONMENTS,
    DistributedContext,
    RingtrainEnvironment,
    SingleProcessEnvironment,
    SlurmEnvironment,
    TorchrunEnvironment,
    context_from_env,
    detect_environment,
    worker_environment,
)
from ringtrain.launch.base import WorkerSpec
from ringtrain.launch.reaper import TOKEN_ENV
from ringtrain.wire.channel import Start
from ringtrain.wire.worker_config import ElasticSettings, WorkerConfig, build_worker_config

FULL = WorkerConfig(
    run_dir="/runs/r",
    attempt=2,
    start_round=7,
    use_gpu=False,
    worker_timeout_s=37.5,
    async_checkpoint=True,
    timing_interval_s=0.25,
    comm_timing="wait",
    max_steps=11,
    elastic=ElasticSettings(2, 4, 3, grow=True),
    elastic_batch_policy="scale_lr",
)


# ------------------------------------------------------------------ WorkerConfig and the channel


def test_worker_config_round_trips_through_the_channel_encoding():
    """The channel is a multiprocessing Connection (pickled frames after the HMAC handshake):
    Start arrives with an equal, typed config, nested elastic settings included."""
    start = Start(payload=b"fn", latest_checkpoint="/runs/r/checkpoint_000001", config=FULL)
    sender, receiver = Pipe()
    try:
        sender.send(start)
        got = receiver.recv()
    finally:
        sender.close()
        receiver.close()
    assert got == start and got.config == FULL
    assert isinstance(got.config, WorkerConfig) and isinstance(got.config.elastic, ElasticSettings)
    assert pickle.loads(bytes(ForkingPickler.dumps(FULL))) == FULL
    # A Start without a config (an old driver, or a test's bare WorkerSpec) means the defaults.
    assert Start().config == WorkerConfig()


def test_worker_config_is_frozen_and_validated_naming_the_field():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FULL.max_steps = 3  # type: ignore[misc]
    bad = [
        ({"worker_timeout_s": 0.0}, "worker_timeout_s"),
        ({"timing_interval_s": float("inf")}, "timing_interval_s"),
        ({"max_steps": 0}, "max_steps"),
        ({"comm_timing": "sometimes"}, "comm_timing"),
        ({"elastic_batch_policy": "bigger"}, "elastic_batch_policy"),
        ({"attempt": -1}, "attempt"),
    ]
    for kwargs, field in bad:
        with pytest.raises(ValueError, match=f"WorkerConfig.{field}"):
            WorkerConfig(**kwargs)
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        ElasticSettings(3, 2)
    with pytest.raises(ValueError, match="snapshot_interval_steps"):
        ElasticSettings(1, 2, 0)


def test_built_once_on_the_driver_from_the_user_configs():
    scaling = rt.ScalingConfig(num_workers=(2, 3), elastic_batch_policy="accumulate")
    run = rt.RunConfig(
        failure_config=rt.FailureConfig(worker_timeout_s=42, snapshot_interval_steps=5),
        checkpoint_config=rt.CheckpointConfig(async_save=True),
        monitor_config=rt.MonitorConfig(timing=True, timing_interval_s=0.5, comm_timing="hook"),
    )
    config = build_worker_config(scaling, run, max_steps=9)
    assert config == WorkerConfig(
        worker_timeout_s=42.0,
        async_checkpoint=True,
        timing_interval_s=0.5,
        comm_timing="hook",
        max_steps=9,
        elastic=ElasticSettings(2, 3, 5, grow=True),
        elastic_batch_policy="accumulate",
    )
    plain = build_worker_config(
        rt.ScalingConfig(num_workers=2),
        rt.RunConfig(
            failure_config=rt.FailureConfig(worker_timeout_s=None),
            monitor_config=rt.MonitorConfig(timing=False),
        ),
    )
    assert plain.elastic is None and plain.timing_interval_s is None and not plain.timing
    assert plain.worker_timeout_s is None and plain.max_steps is None


def test_each_attempt_and_each_joiner_get_their_start_config():
    spec = WorkerSpec(world_size=3, run_dir="/runs/r", attempt=1, start_round=4, config=FULL)
    first = spec.start_config()
    assert (first.run_dir, first.attempt, first.start_round) == ("/runs/r", 1, 4)
    assert first.elastic is not None and not first.elastic.joining
    joiner = spec.start_config(joining=True)
    assert joiner.elastic is not None and joiner.elastic.joining
    assert dataclasses.replace(joiner, elastic=first.elastic) == first
    assert spec.elastic and not WorkerSpec(world_size=1, run_dir="/r").elastic
    with pytest.raises(ValueError, match="not elastic"):
        WorkerSpec(world_size=1, run_dir="/r").start_config(joining=True)


def test_the_context_takes_the_config_from_start():
    ctx = context_from_env({"RINGTRAIN_DRIVER_ADDR": "127.0.0.1:5", "RANK": "1", "WORLD_SIZE": "3"})
    assert ctx.config == WorkerConfig() and ctx.worker_timeout_s is None
    got = ctx.with_config(dataclasses.replace(FULL, use_gpu=True))
    assert (got.world_rank, got.world_size, got.source) == (1, 3, "ringtrain")
    assert (got.attempt, got.run_dir, got.use_gpu) == (2, "/runs/r", True)
    assert got.worker_timeout_s == 37.5 and got.config.max_steps == 11


# ------------------------------------------------------------------ the launcher's environment


def test_the_launcher_sets_only_bootstrap_ringtrain_variables():
    env = worker_environment(
        rank=1,
        world_size=3,
        local_rank=1,
        local_world_size=3,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=1234,
        threads=2,
        driver_addr="127.0.0.1:5",
        authkey_hex="ab",
    )
    ours = {name for name in env if name.startswith("RINGTRAIN_")}
    assert ours <= BOOTSTRAP_ENV, ours - BOOTSTRAP_ENV
    assert (env["RANK"], env["WORLD_SIZE"], env["HOROVOD_SIZE"], env["OMP_NUM_THREADS"]) == (
        "1",
        "3",
        "3",
        "2",
    )
    assert TOKEN_ENV in BOOTSTRAP_ENV  # the reaper finds a group's processes by it


# ------------------------------------------------------------------ cluster environments

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
RINGTRAIN = {"RINGTRAIN_DRIVER_ADDR": "127.0.0.1:5", "RINGTRAIN_AUTHKEY": "0a0b", **TORCHRUN}


@pytest.mark.parametrize(
    ("cls", "environ", "expected"),
    [
        (RingtrainEnvironment, RINGTRAIN, True),
        (RingtrainEnvironment, TORCHRUN, False),
        (TorchrunEnvironment, TORCHRUN, True),
        (TorchrunEnvironment, {"RANK": "0"}, False),
        (TorchrunEnvironment, SLURM, False),
        (SlurmEnvironment, SLURM, True),
        (SlurmEnvironment, {**SLURM, "SLURM_NTASKS": "1"}, False),  # one task: a single process
        (SlurmEnvironment, TORCHRUN, False),
        (SingleProcessEnvironment, {}, True),
        (SingleProcessEnvironment, TORCHRUN, True),
    ],
)
def test_each_environment_detects_its_own_variables(cls, environ, expected):
    assert cls({**environ, "CUDA_VISIBLE_DEVICES": ""}).detect() is expected


def test_the_registry_asks_in_order_and_the_first_detection_wins():
    assert ENVIRONMENTS[-1] is SingleProcessEnvironment
    assert ENVIRONMENTS.index(RingtrainEnvironment) < ENVIRONMENTS.index(TorchrunEnvironment)
    cases = [
        (RINGTRAIN, RingtrainEnvironment),  # ours also sets torchrun's variables
        ({**TORCHRUN, **SLURM}, TorchrunEnvironment),  # torchrun inside an srun allocation
        (SLURM, SlurmEnvironment),
        ({}, SingleProcessEnvironment),
    ]
    for environ, cls in cases:
        found = detect_environment({**environ, "CUDA_VISIBLE_DEVICES": ""})
        assert type(found) is cls, (environ, found)
        assert context_from_env({**environ, "CUDA_VISIBLE_DEVICES": ""}).source == cls.source


def test_each_environment_builds_the_context():
    ringtrain = RingtrainEnvironment(RINGTRAIN)
    assert (ringtrain.driver_address(), ringtrain.authkey()) == ("127.0.0.1:5", b"\n\x0b")
    ctx = ringtrain.context()
    assert (ctx.world_rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (3, 4, 1, 2)
    assert ctx.use_gpu is False  # until Start says otherwise
    slurm = SlurmEnvironment({**SLURM, "SLURM_NODELIST": "gpu[07-08]", "CUDA_VISIBLE_DEVICES": ""})
    ctx = slurm.context()
    assert (ctx.world_rank, ctx.world_size, ctx.local_world_size, ctx.node_rank) == (5, 8, 4, 1)
    assert (ctx.master_addr, ctx.source) == ("gpu07", "slurm")
    torchrun = TorchrunEnvironment({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"})
    assert torchrun.context().attempt == 2
    assert SingleProcessEnvironment({}).context() == DistributedContext()
    with pytest.raises(ValueError, match="outside"):
        TorchrunEnvironment({"RANK": "4", "WORLD_SIZE": "4"}).context()
