"""PyTorch Lightning on ringtrain: real worker processes (gloo) through ``rt.Trainer(...).fit()``.

The reference is Lightning's own DDP: the same LightningModule and seed, started by Lightning
(``strategy="ddp"``, ``devices=2``, ``accelerator="cpu"``) in a subprocess. The ringtrain run must
end with the same parameters; a run whose rank 1 is SIGKILLed must resume from the Lightning
checkpoint and end with exactly the parameters of the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ringtrain.cluster.env import DistributedContext
from ringtrain.worker import session as session_mod
from support import Poisoned, run_job

pl = pytest.importorskip(
    "lightning.pytorch", reason="needs the extra: pip install 'ringtrain[lightning]'"
)

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

import lightning_shard_workloads as shard  # noqa: E402
import lightning_workloads  # noqa: E402
from ringtrain.config.parallel import MeshShape  # noqa: E402
from ringtrain.integrations.lightning import (  # noqa: E402
    RingtrainCallback,
    RingtrainEnvironment,
    RingtrainFSDPStrategy,
    get_ckpt_path,
    own_files,
    prepare_trainer,
)
from ringtrain.wire.worker_config import WorkerConfig  # noqa: E402

EPOCHS = 2  # 5 batches of 4 per rank and epoch: 10 optimizer steps
_runs: dict[str, dict] = {}


def _fit(tmp_path, name, max_failures=0, backend="local", **config):
    out = tmp_path / f"{name}.pt"
    starts = tmp_path / f"{name}.starts"
    result = run_job(
        lightning_workloads.train_fn,
        storage_path=tmp_path / "runs",
        name=name,
        backend=backend,
        max_failures=max_failures,
        train_loop_config={"epochs": EPOCHS, "out": str(out), "starts": str(starts), **config},
    )
    assert result.error is None, result.error
    final = torch.load(out, weights_only=True)
    entries = [json.loads(line) for line in starts.read_text().splitlines()]
    return result, final, entries


def _clean(tmp_path_factory, prepared: bool = False):
    """The uninterrupted ringtrain run (cached per loader kind)."""
    key = "prepared" if prepared else "plain"
    if key not in _runs:
        tmp = tmp_path_factory.mktemp(f"clean_{key}")
        every = 2 if prepared else None
        result, final, entries = _fit(tmp, "clean", prepared=prepared, every=every)
        _runs[key] = {"result": result, "final": final, "entries": entries}
    return _runs[key]


assert_same_parameters = lightning_workloads.assert_same_parameters


# ------------------------------------------------------------------------------------ optional


def test_import_ringtrain_does_not_import_lightning():
    code = (
        "import sys, ringtrain, ringtrain.integrations\n"
        "ringtrain.Trainer, ringtrain.TrainState, ringtrain.prepare_model\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('lightning', 'pytorch_lightning', 'lightning_fabric')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


# ------------------------------------------------------------- prepare_trainer (no processes)


def _context(world_size=2, local_world_size=2, rank=0, node_rank=0) -> None:
    ctx = DistributedContext(
        world_rank=rank,
        world_size=world_size,
        local_rank=rank % local_world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr="10.0.0.1",
        master_port=29555,
        source="ringtrain",
    )
    session_mod._install_session(session_mod.Session(context=ctx))


def _trainer(**kwargs):
    args = dict(
        accelerator="cpu",
        devices="auto",
        strategy="ddp",
        plugins=[RingtrainEnvironment()],
        callbacks=[RingtrainCallback()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    args.update(kwargs)
    return pl.Trainer(**args)


def test_environment_reads_the_ringtrain_context():
    _context(world_size=4, local_world_size=2, rank=0, node_rank=0)
    env = RingtrainEnvironment()
    assert env.creates_processes_externally
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 0, 0, 0)
    assert (env.main_address, env.main_port) == ("10.0.0.1", 29555)
    env.set_world_size(1)  # Lightning's num_nodes * devices does not override ringtrain's
    assert env.world_size() == 4
    with pytest.raises(ValueError, match=r"prepare_trainer\(trainer\)"):
        env.validate_settings(num_devices=1, num_nodes=1)


@pytest.mark.parametrize(
    "world_size, local_world_size, nodes, per_node",
    [(2, 2, 1, 2), (4, 2, 2, 2), (3, 2, 1, 3)],  # one node, two nodes, uneven placement
)
def test_prepare_trainer_makes_lightning_world_size_match(
    world_size, local_world_size, nodes, per_node
):
    _context(world_size=world_size, local_world_size=local_world_size)
    trainer = _trainer()
    assert trainer.strategy.num_processes * trainer.strategy.num_nodes == 1  # "auto" on CPU
    assert prepare_trainer(trainer) is trainer
    strategy = trainer.strategy
    assert (strategy.num_nodes, strategy.num_processes) == (nodes, per_node)
    assert strategy.distributed_sampler_kwargs == {"num_replicas": world_size, "rank": 0}
    assert strategy.root_device == torch.device("cpu")
    assert trainer.world_size == world_size
    strategy.cluster_environment.validate_settings(strategy.num_processes, strategy.num_nodes)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(strategy="ddp_spawn"), r"starts its own processes.*strategy='ddp'"),
        (dict(strategy="auto", devices=1), r"SingleDeviceStrategy.*strategy='ddp'"),
        (dict(plugins=[]), r"cluster environment is .*plugins=\[RingtrainEnvironment\(\)\]"),
        (dict(devices=3), r"devices=3.*2 worker\(s\) on this node.*devices='auto'"),
        (dict(num_nodes=2), r"num_nodes=2.*leave num_nodes at its default"),
    ],
)
def test_prepare_trainer_explains_mismatches(kwargs, message):
    _context(world_size=2, local_world_size=2)
    with pytest.raises(ValueError, match=message):
        prepare_trainer(_trainer(**kwargs))


def test_prepare_trainer_rejects_other_objects_and_bad_callback_args():
    with pytest.raises(TypeError, match=r"lightning\.pytorch\.Trainer"):
        prepare_trainer(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every_n_steps must be a positive int"):
        RingtrainCallback(every_n_steps=0)


# ------------------------------------------------------------------- real runs, 2 workers


@pytest.mark.xdist_group("test_lightning-clean")  # they share the clean run (_clean)
def test_metrics_reach_the_driver_and_match_lightnings_own_ddp(tmp_path, tmp_path_factory):
    clean = _clean(tmp_path_factory)
    result = clean["result"]
    # One report per epoch; rank 0's metrics are the run's, every rank's reach the driver.
    assert [m["epoch"] for m in result.metrics_history] == list(range(EPOCHS))
    assert [m["step"] for m in result.metrics_history] == [5, 10]
    assert set(result.metrics) >= {"train_loss", "val_acc", "epoch", "step"}
    assert all(isinstance(v, (int, float)) for v in result.metrics.values())
    assert set(result.metrics_per_rank) == {0, 1}
    # Rank 1 trained on the other half of the data: its own loss.
    assert result.metrics_per_rank[1]["train_loss"] != result.metrics_per_rank[0]["train_loss"]
    assert result.checkpoint is not None
    assert os.path.exists(get_ckpt_path(result.checkpoint))

    # Lightning's own DDP launcher, same module and seed, in a subprocess.
    native_out = tmp_path / "native.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PL_")}
    proc = subprocess.run(
        [sys.executable, lightning_workloads.__file__, str(native_out), str(EPOCHS)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    native = torch.load(native_out, weights_only=True)
    assert native["step"] == clean["final"]["step"] == EPOCHS * lightning_workloads.BATCHES
    for k, v in native["model"].items():
        torch.testing.assert_close(clean["final"]["model"][k], v, rtol=1e-5, atol=1e-6)
    native_metrics = json.loads((tmp_path / "native.pt.json").read_text())
    for key in ("train_loss", "val_acc"):
        assert result.metrics[key] == pytest.approx(native_metrics[key], rel=1e-5)


@pytest.mark.xdist_group("test_lightning-clean")  # they share the clean run (_clean)
def test_killed_worker_resumes_from_the_epoch_checkpoint_exactly(tmp_path, tmp_path_factory):
    clean = _clean(tmp_path_factory)
    result, final, entries = _fit(tmp_path, "killed", max_failures=1, kill=[1, 7])
    assert [(f.rank, f.kind) for f in result.failures] == [(1, "signal")]
    # Attempt 1 was pointed at the epoch-end checkpoint (step 5) and started from it.
    assert [(e["attempt"], e["step"]) for e in entries] == [(0, 0), (1, 5)]
    assert entries[1]["ckpt_path"].endswith("checkpoint_000000/lightning.ckpt")
    assert_same_parameters(final, clean["final"])  # dropout too: the RNG states were restored
    assert result.metrics["step"] == 10
    # Both attempts forked their workers with Lightning imported in the zygote once: the train
    # function's module uses it (ringtrain.launch.pool.AUTO_PRELOAD).
    config = json.loads((tmp_path / "runs" / "killed" / "config.json").read_text())
    assert config["scaling_config"]["preload_modules"] == ["lightning.pytorch"]


def test_stateful_loader_resumes_mid_epoch_exactly(tmp_path, tmp_path_factory):
    """rt.prepare_data_loader's loader is stateful: Lightning saves its position, and a run
    killed after step 7 resumes at step 6 (a checkpoint every 2 steps), mid-epoch."""
    clean = _clean(tmp_path_factory, prepared=True)
    steps = [m["step"] for m in clean["result"].metrics_history]
    assert steps == [2, 4, 5, 6, 8, 10]  # every 2 steps and at each epoch's end
    result, final, entries = _fit(
        tmp_path, "killed", max_failures=1, kill=[1, 7], prepared=True, every=2
    )
    assert [(f.rank, f.kind) for f in result.failures] == [(1, "signal")]
    assert [(e["attempt"], e["step"]) for e in entries] == [(0, 0), (1, 6)]
    assert_same_parameters(final, clean["final"])


# cluster: the backends tier's two-node Ray cluster (tests/backends/conftest.py).
@pytest.mark.xdist_group("ray")  # one local Ray cluster at a time (pyproject addopts)
def test_ray_backend_gives_the_same_parameters(tmp_path, tmp_path_factory, cluster):
    clean = _clean(tmp_path_factory)
    result, final, _ = _fit(tmp_path, "ray", backend="ray")
    assert [m["step"] for m in result.metrics_history] == [5, 10]
    assert result.checkpoint is not None and get_ckpt_path(result.checkpoint) is not None
    assert_same_parameters(final, clean["final"])


def test_a_resumed_lightning_checkpoint_is_loaded_weights_only_even_when_torch_is_told_not_to(
    tmp_path, monkeypatch
):
    """Lightning loads ``ckpt_path`` with ``weights_only=None``, which
    ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1`` turns into a full unpickle; the bridge forces
    ``weights_only=True`` on the strategy it resumes."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from ringtrain.integrations.lightning import _force_weights_only

    marker = tmp_path / "ran"
    poisoned = tmp_path / "lightning.ckpt"
    torch.save({"state_dict": {}, "x": Poisoned(str(marker))}, poisoned)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    unguarded = SingleDeviceStrategy(device=torch.device("cpu"))
    unguarded.load_checkpoint(str(poisoned))  # the hole: the environment wins over the default
    assert marker.exists()
    marker.unlink()
    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    _force_weights_only(strategy)
    with pytest.raises(Exception, match=r"[Ww]eights.only|Unsupported global"):
        strategy.load_checkpoint(str(poisoned), weights_only=False)
    assert not marker.exists()


# ------------------------------------------- sharded strategies: FSDP, ModelParallel, DeepSpeed


def _mesh_context(world_size: int, mesh: MeshShape | None) -> None:
    ctx = DistributedContext(
        world_rank=0,
        world_size=world_size,
        local_world_size=world_size,
        source="ringtrain",
        config=WorkerConfig(mesh=mesh),
    )
    session_mod._install_session(session_mod.Session(context=ctx))


def test_lightning_itself_refuses_fsdp_on_cpu_and_ringtrains_subclass_passes():
    """The evidence for RingtrainFSDPStrategy: Lightning's accelerator connector refuses
    ``strategy="fsdp"`` (and an exact FSDPStrategy) without a GPU, before prepare_trainer runs."""
    _context(world_size=2, local_world_size=2)
    for strategy in ("fsdp", FSDPStrategy()):
        with pytest.raises(ValueError, match="requires a GPU accelerator"):
            _trainer(strategy=strategy)
    trainer = prepare_trainer(_trainer(strategy=RingtrainFSDPStrategy()))
    assert (trainer.strategy.num_nodes, trainer.strategy.num_processes) == (1, 2)


class _OtherFSDP(FSDPStrategy):
    pass


@pytest.mark.parametrize(
    "world_size, mesh, strategy, message",
    [
        (2, None, _OtherFSDP, r"_OtherFSDP on a CPU worker.*RingtrainFSDPStrategy"),
        (
            2,
            None,
            lambda: ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2),
            r"data_parallel_size=1, tensor_parallel_size=2\) contradicts ringtrain's 2 workers"
            r".*ScalingConfig\(parallel=rt.ParallelConfig",
        ),
        (
            4,
            MeshShape(dp_shard=2, tp=2),
            lambda: ModelParallelStrategy(tensor_parallel_size=4),
            r"tensor_parallel_size=4\) contradicts ScalingConfig.parallel \(dp_replicate=1 x "
            r"dp_shard=2, tp=2\).*tensor_parallel_size=2",
        ),
        (
            4,
            MeshShape(pp=2, dp_shard=2),
            ModelParallelStrategy,
            r"pp=2.*no pipeline dimension.*rt.prepare_pipeline",
        ),
    ],
)
def test_prepare_trainer_refuses_sharded_strategies_that_cannot_run(
    world_size, mesh, strategy, message
):
    _mesh_context(world_size, mesh)
    with pytest.raises(ValueError, match=message):
        prepare_trainer(_trainer(strategy=strategy()))


@pytest.mark.parametrize(
    "world_size, mesh, sizes",
    [
        (2, None, (2, 1)),  # no ParallelConfig: all data-parallel
        (4, MeshShape(dp_shard=2, tp=2), (2, 2)),
        (4, MeshShape(dp_replicate=2, dp_shard=2), (4, 1)),  # Lightning's one dp dimension
    ],
)
def test_model_parallel_sizes_come_from_ringtrains_mesh(world_size, mesh, sizes):
    _mesh_context(world_size, mesh)
    strategy = prepare_trainer(_trainer(strategy=ModelParallelStrategy())).strategy
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == sizes
    assert strategy.num_nodes * strategy.num_processes == world_size


def test_lightnings_deepspeed_on_cpu_is_refused_with_the_way_out():
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeedStrategy needs deepspeed")
    assert deepspeed
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from ringtrain.integrations.lightning import RingtrainDeepSpeedStrategy

    _context(world_size=2, local_world_size=2)
    with pytest.raises(
        ValueError, match=r"only supported on CUDA GPUs.*RingtrainDeepSpeedStrategy\(stage=...\)"
    ):
        prepare_trainer(_trainer(strategy=DeepSpeedStrategy(stage=2)))
    trainer = prepare_trainer(_trainer(strategy=RingtrainDeepSpeedStrategy(stage=3)))
    assert (trainer.strategy.num_nodes, trainer.strategy.num_processes) == (1, 2)


def test_own_files_split_a_sharded_checkpoint_between_ranks(tmp_path):
    names = [
        "lightning.ckpt/.metadata",
        "lightning.ckpt/meta.pt",
        "lightning.ckpt/__0_0.distcp",
        "lightning.ckpt/__1_0.distcp",
        "lightning.ckpt/__12_0.distcp",
        "ds/checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "ds/checkpoint/mp_rank_00_model_states.pt",
    ]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x")
    assert own_files(str(tmp_path), 0) == sorted(
        [
            "ds/checkpoint/mp_rank_00_model_states.pt",
            "lightning.ckpt/.metadata",
            "lightning.ckpt/__0_0.distcp",
            "lightning.ckpt/meta.pt",
        ]
    )
    assert own_files(str(tmp_path), 1) == [
        "ds/checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "lightning.ckpt/__1_0.distcp",
    ]
    assert own_files(str(tmp_path), 12) == ["lightning.ckpt/__12_0.distcp"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "strategy, kwargs, workers, parallel, dp",
    [
        # RingtrainFSDPStrategy (FSDP1): sharded checkpoints at W=3 (uneven shards), and
        # Lightning's default full state dict (one file, gathered on rank 0)
        ("fsdp", {"state_dict_type": "sharded"}, 3, None, 3),
        ("fsdp", {}, 2, None, 2),
        ("model_parallel", {}, 2, None, 2),  # FSDP2 over data_parallel
        ("model_parallel", {}, 2, (1, 2), 1),  # TP over tensor_parallel: both ranks, one batch
        ("deepspeed", {"stage": 3}, 2, None, 2),  # RingtrainDeepSpeedStrategy, ZeRO-3
    ],
)
def test_sharded_strategy_matches_one_process_and_resumes_from_its_checkpoint(
    tmp_path, monkeypatch, strategy, kwargs, workers, parallel, dp
):
    """Rank 1 is SIGKILLed after step 7; the restarted group resumes from the checkpoint of
    step 5 (every rank's shards, from the run directory, verified) and every step's loss (the
    mean over the ranks) matches one process on the global batch."""
    import ringtrain as rt

    losses = str(tmp_path / "losses")
    extra = {}
    extensions = tmp_path / "torch_extensions"
    if strategy == "deepspeed":
        pytest.importorskip("deepspeed", reason="DeepSpeedStrategy needs deepspeed")
        # Where DeepSpeed would JIT-compile its CPU shared-memory allreduce (~75 s of C++ on a
        # fresh machine): RingtrainDeepSpeedStrategy must compile nothing.
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    if parallel is not None:
        extra["parallel"] = rt.ParallelConfig(dp_shard=parallel[0], tp=parallel[1])
    config = {"strategy": strategy, "strategy_kwargs": kwargs, "losses": losses, "kill": [1, 7]}
    result = run_job(
        shard.train_fn,
        workers,
        storage_path=tmp_path / "runs",
        name=strategy,
        max_failures=1,
        train_loop_config=config,
        **extra,
    )
    assert result.error is None, result.error
    assert [(f.rank, f.kind) for f in result.failures] == [(1, "signal")]
    built = sorted(p.name for p in extensions.rglob("*")) if extensions.exists() else []
    assert not built, f"compiled during the run: {built}"
    ckpt = result.checkpoint
    assert ckpt is not None
    listed = set(ckpt.verified_files())
    if strategy == "fsdp" and not kwargs:
        assert "lightning.ckpt" in listed
    elif strategy == "deepspeed":
        files = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(workers)}
        assert {f"lightning.ckpt/checkpoint/{f}" for f in files} <= listed
        assert "lightning.ckpt/latest" in listed
    else:
        assert {"lightning.ckpt/.metadata", "lightning.ckpt/meta.pt"} <= listed
        assert {f"lightning.ckpt/__{r}_0.distcp" for r in range(workers)} <= listed

    starts: dict[int, int] = {}
    with open(f"{losses}.rank0") as f:
        for line in f:
            entry = json.loads(line)
            starts.setdefault(entry["attempt"], entry["step"])
    assert starts == {0: 1, 1: 6}, starts  # attempt 1 resumed after the step-5 checkpoint
    got = shard.run_losses(losses, workers)
    reference = shard.reference_losses(dp)
    steps = shard.EPOCHS * shard.BATCHES
    for step in range(1, steps + 1):
        mean = sum(got[r][step] for r in range(workers)) / workers
        assert mean == pytest.approx(reference[step - 1], abs=1e-4), (strategy, step)
