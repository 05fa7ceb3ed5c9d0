import pytest

from ringtrain.cluster.env import context_from_env, detect_source, worker_environment


def test_single_process_without_launcher():
    ctx = context_from_env({})
    assert ctx.source == "single"
    assert (ctx.world_rank, ctx.world_size, ctx.local_rank) == (0, 1, 0)
    assert str(ctx.device) == "cpu"


def test_torchrun_variables():
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "CUDA_VISIBLE_DEVICES": "",
    }
    ctx = context_from_env(env)
    assert ctx.source == "torchrun"
    assert (ctx.world_rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (3, 4, 1, 2)
    assert (ctx.node_rank, ctx.master_addr, ctx.master_port) == (1, "10.0.0.1", 1234)
    assert ctx.use_gpu is False


def test_slurm_variables():
    env = {
        "SLURM_PROCID": "5",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NODEID": "1",
        "SLURM_NODELIST": "gpu[07-08]",
        "CUDA_VISIBLE_DEVICES": "",
    }
    ctx = context_from_env(env)
    assert ctx.source == "slurm"
    assert (ctx.world_rank, ctx.world_size, ctx.local_rank, ctx.local_world_size) == (5, 8, 1, 4)
    assert ctx.node_rank == 1
    assert ctx.master_addr == "gpu07"


def test_ringtrain_launcher_wins_and_carries_attempt():
    env = {
        "RINGTRAIN_DRIVER_ADDR": "127.0.0.1:5",
        "RANK": "0",
        "WORLD_SIZE": "2",
        "RINGTRAIN_ATTEMPT": "2",
        "RINGTRAIN_USE_GPU": "0",
    }
    assert detect_source(env) == "ringtrain"
    ctx = context_from_env(env)
    assert ctx.attempt == 2 and ctx.world_size == 2


def test_bad_values_are_named():
    with pytest.raises(ValueError, match="RANK"):
        context_from_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="outside"):
        context_from_env({"RANK": "2", "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": ""})


def test_worker_environment_has_horovods_variables():
    env = worker_environment(
        rank=5,
        world_size=8,
        local_rank=1,
        local_world_size=4,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=29500,
        threads=1,
        driver_addr="127.0.0.1:1",
        authkey_hex="00",
    )
    assert {k: v for k, v in env.items() if k.startswith("HOROVOD_")} == {
        "HOROVOD_RANK": "5",
        "HOROVOD_SIZE": "8",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "4",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
    }
    assert env["RANK"] == "5" and env["LOCAL_RANK"] == "1"


def test_a_cpu_worker_sees_no_gpu_unless_the_run_names_its_devices():
    from ringtrain.cluster.worker_env import cpu_worker_devices

    assert cpu_worker_devices(False, {}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert cpu_worker_devices(True, {}) == {}  # a GPU worker's device comes from its local rank
    assert cpu_worker_devices(False, {"CUDA_VISIBLE_DEVICES": "1"}) == {}  # the user's choice
