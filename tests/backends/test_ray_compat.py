"""Ray Train compatibility: Ray's own PyTorch examples port by changing their imports.

The repository holds no copy of Ray's examples: the tests take the examples installed with Ray
(``ray/train/examples/pytorch/`` and ``ray/train/examples/horovod/``), rewrite their import lines
with ``tests/ray_port.py`` (and check that only import lines changed, as many as docs/ray.md's
table says), and run them. Their data downloads (``torchvision.datasets.FashionMNIST`` and
``MNIST``) come from the seeded synthetic stand-in ``tests/stubs/torchvision``, put on the
workers' ``sys.path`` for these runs only. The ported fashion-MNIST loop gives, epoch by epoch
and rank by rank, the very metrics Ray's ``TorchTrainer`` gives running the same installed file
unchanged on the same data, and the names Ray Train code calls exist with Ray's meaning.

The Ray comparison runs on the tier's two-node Ray cluster (tests/backends/conftest.py, started
before the test, so its processes predate the leak check); it is skipped when Ray Train cannot
be imported (``pip install 'ray[train]'``: Ray Train needs pyarrow).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

import ringtrain as rt
from ray_port import changed_lines, port, port_line, ray_example
from ringtrain.cluster.env import DistributedContext
from ringtrain.train.horovod import HorovodConfig, HorovodTrainer
from ringtrain.train.torch import TorchConfig, TorchTrainer

# One local Ray cluster at a time: the Ray tests share one pytest worker (pyproject addopts).
pytestmark = pytest.mark.xdist_group("ray")

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parents[1] / "stubs"  # the torchvision stand-in
SAMPLES = "256"  # TORCHVISION_STUB_SAMPLES: a few seconds per run
FASHION_CONFIG = {"lr": 1e-3, "epochs": 2, "batch_size_per_worker": 16}
# Ray example -> the number of lines its port changes, all of them import lines (docs/ray.md
# gives the same table).
PORTED_LINES = {
    "torch_fashion_mnist_example.py": 3,
    "torch_linear_example.py": 3,
    "torch_quick_start.py": 3,
    "horovod_example.py": 4,
}


def installed(name: str) -> Path:
    path = ray_example(name)
    if path is None:
        pytest.skip(f"Ray's {name} is not installed: pip install 'ray[train]'")
    return path


# -- no processes ---------------------------------------------------------------------------


def test_docs_import_table_is_what_port_does() -> None:
    """Every row of docs/ray.md's "Ray Train line | ringtrain line" table is tests/ray_port.py's
    rule (this needs no Ray)."""
    doc = (ROOT / "docs" / "ray.md").read_text()
    rows = re.findall(r"^\| `((?:import|from) [^`]+)`[^|]*\| `([^`]+)`", doc, re.MULTILINE)
    assert len(rows) >= 8, rows
    for ray_line, ours in rows:
        assert port_line(ray_line) == ours, (ray_line, port_line(ray_line), ours)
    assert port_line("import ray") == "import ray"  # the real Ray stays (ray.init in __main__)
    assert port("x = 1\nimport ray.train\n") == ("x = 1\nimport ringtrain as ray\n", 1)
    assert "examples/ray_ports" not in doc


def test_installed_examples_port_by_their_import_lines_only() -> None:
    doc = (ROOT / "docs" / "ray.md").read_text()
    for name, count in PORTED_LINES.items():
        assert f"| `{name}` | {count} |" in doc, name
        original = installed(name).read_text()
        ported, changed = port(original)  # asserts every changed line is an import statement
        assert changed == count, (name, changed_lines(original))
        for ray_line, ours in changed_lines(original):
            assert re.search(r"\b(ray|horovod)\b", ray_line) and "ringtrain" in ours, (name, ours)
            assert f"`{ray_line.strip()}`" in doc and f"`{ours.strip()}`" in doc, (name, ours)
        assert "from ray" not in ported and "import ray." not in ported, name
        assert "import ray\n" not in ported or "ray.init(" in ported, name  # only __main__'s


def test_trainer_takes_rays_keyword_names() -> None:
    def loop(config):
        pass

    t = rt.Trainer(
        train_loop_per_worker=loop,
        train_loop_config={"lr": 0.1},
        scaling_config=rt.ScalingConfig(num_workers=2),
        run_config=rt.RunConfig(storage_path=None),
    )
    assert (t.train_fn, t.train_loop_config, t.scaling_config.num_workers) == (loop, {"lr": 0.1}, 2)
    assert t.run_config.storage_path == "./runs" == rt.RunConfig().storage_path
    assert rt.Trainer(loop, rt.ScalingConfig(num_workers=3)).scaling_config.num_workers == 3
    assert TorchTrainer(loop, train_loop_config={"a": 1}).train_fn is loop
    assert TorchTrainer(train_loop_per_worker=loop, torch_config=TorchConfig()).train_fn is loop
    with pytest.raises(TypeError, match="both train_fn and train_loop_per_worker"):
        rt.Trainer(loop, train_loop_per_worker=loop)
    with pytest.raises(TypeError, match="needs the per-worker training function"):
        rt.Trainer()
    with pytest.raises(ValueError, match=r"datasets=.*prepare_data_loader"):
        rt.Trainer(loop, datasets={"train": [1, 2]})
    with pytest.raises(ValueError, match=r"metadata=.*train_loop_config"):
        TorchTrainer(loop, metadata={"a": 1})
    with pytest.raises(ValueError, match="resume_from_checkpoint"):
        TorchTrainer(loop, resume_from_checkpoint=object())
    with pytest.raises(ValueError, match="ringtrain uses 'gloo'"):
        TorchTrainer(loop, torch_config=TorchConfig(backend="nccl"))
    with pytest.raises(ValueError, match="worker_timeout_s"):
        TorchConfig(timeout_s=60)
    assert HorovodTrainer(loop, horovod_config=HorovodConfig()).train_fn is loop
    with pytest.raises(ValueError, match=r"HorovodConfig.ssh_port=22 does not apply"):
        HorovodConfig(ssh_port=22)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharding_order_is_rays_distributed_sampler(world_size: int) -> None:
    """The order ringtrain.train.torch.prepare_data_loader shards by (ringtrain's resumable
    sampler, seed 0) is Ray's DistributedSampler(dataset, shuffle=...) order on every rank, with
    padding (23 samples do not divide by 2, 3 or 4) and across epochs."""
    from torch.utils.data import DistributedSampler

    from ringtrain.worker.data import ResumableDistributedSampler

    data = list(range(23))
    for rank in range(world_size):
        for shuffle in (True, False):
            ours = ResumableDistributedSampler(data, world_size, rank, shuffle=shuffle, seed=0)
            ray = DistributedSampler(data, world_size, rank, shuffle=shuffle)
            for epoch in (0, 1, 5):
                ours.set_epoch(epoch)
                ray.set_epoch(epoch)
                assert list(ours) == list(ray), (world_size, rank, shuffle, epoch)


def test_context_answers_rays_method_names() -> None:
    ctx = DistributedContext(
        world_rank=5,
        world_size=6,
        local_rank=1,
        local_world_size=2,
        node_rank=2,
        run_dir="memory://runs/fashion",
    )
    assert (
        ctx.get_world_rank(),
        ctx.get_world_size(),
        ctx.get_local_rank(),
        ctx.get_local_world_size(),
        ctx.get_node_rank(),
    ) == (5, 6, 1, 2, 2)
    assert ctx.get_experiment_name() == ctx.get_trial_name() == "fashion"
    assert ctx.get_trial_dir() == "memory://runs/fashion"
    assert DistributedContext().get_experiment_name() == ""
    with pytest.raises(NotImplementedError, match="run_dir"):
        ctx.get_storage()
    import ringtrain as ray  # what the ports do

    assert ray.train.get_context().get_world_size() == 1  # a plain process: rank 0 of 1
    assert ray.train.ScalingConfig is rt.ScalingConfig and ray.train.torch.TorchTrainer is (
        TorchTrainer
    )
    with pytest.raises(NotImplementedError, match="prepare_data_loader"):
        ray.train.get_dataset_shard("train")


# -- the same numbers as Ray ----------------------------------------------------------------


def _use_stubs(config) -> None:
    """In a worker: the torchvision stand-in first on sys.path, its size, and a home directory
    for the examples' ``FileLock("~/...")`` files."""
    import sys

    sys.path.insert(0, config["stubs"])
    os.environ["TORCHVISION_STUB_SAMPLES"] = config["samples"]
    os.environ["HOME"] = config["home"]


def _ringtrain_loop(config):
    """In each ringtrain worker: the ported fashion-MNIST loop (its reports are the compared
    numbers), the context and loader checks, then quick-start's distributed loop, the linear
    example's loop (which reports ``Checkpoint.from_directory`` on every rank) and the Horovod
    example's loop."""
    import runpy

    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import ringtrain as ray

    torch.set_num_threads(1)
    _use_stubs(config)
    fashion = runpy.run_path(config["fashion"])
    fashion["train_func_per_worker"](config["fashion_config"])

    ctx = ray.train.get_context()
    assert (ctx.get_world_rank(), ctx.get_world_size()) == (dist.get_rank(), dist.get_world_size())
    assert ctx.get_local_rank() == ctx.local_rank and ctx.get_node_rank() == 0
    assert ctx.get_local_world_size() == ctx.world_size
    assert ctx.get_experiment_name() == "compat"
    # the Ray-compatible loader yields what Ray's DistributedSampler(shuffle=True) yields
    data = TensorDataset(torch.arange(23))
    loader = ray.train.torch.prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True))
    reference = DistributedSampler(data, shuffle=True)  # seed 0, as Ray builds it
    for epoch in (0, 1):
        loader.sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        got = [int(i) for (batch,) in loader for i in batch]
        assert got == list(reference), (epoch, got, list(reference))

    quick = runpy.run_path(config["quick_start"])
    quick["train_func_distributed"]()
    linear = runpy.run_path(config["linear"])
    losses = linear["train_func"]({"lr": 1e-2, "batch_size": 4, "epochs": 2})
    assert len(losses) == 2 and losses[1]["loss"] < losses[0]["loss"], losses
    horovod = runpy.run_path(config["horovod"])  # HorovodTrainer's loop: hvd.init() and all
    horovod["train_func"]({"num_epochs": 1, "batch_size": 32, "log_interval": 100})


def make_ray_loop():
    """The function each Ray Train worker runs: Ray's fashion-MNIST loop from the installed file,
    unchanged, its reports recorded. (Nested, so that it is pickled by value: Ray's workers
    cannot import this module.)"""

    def ray_loop(config):
        import json
        import os
        import runpy
        import sys

        import ray.train
        import torch

        torch.set_num_threads(1)
        sys.path.insert(0, config["stubs"])
        os.environ["TORCHVISION_STUB_SAMPLES"] = config["samples"]
        os.environ["HOME"] = config["home"]
        fashion = runpy.run_path(config["fashion"])
        history = []
        real = ray.train.report

        def report(metrics, *args, **kwargs):
            history.append(dict(metrics))
            return real(metrics, *args, **kwargs)

        ray.train.report = report  # record what the unchanged loop reports
        try:
            fashion["train_func_per_worker"](config["fashion_config"])
        finally:
            ray.train.report = real
        rank = ray.train.get_context().get_world_rank()
        with open(os.path.join(config["out"], f"rank{rank}.json"), "w") as f:
            json.dump(history, f)

    return ray_loop


@pytest.fixture(scope="module")
def ray_train(cluster):
    """Ray, initialised on the tier's two-node cluster (tests/backends/conftest.py: 4 CPUs, for
    the 2 workers and Train's controller), or a skip without Ray Train."""
    import ray

    try:
        import ray.train
        import ray.train.torch
    except ImportError as exc:
        pytest.skip(f"Ray Train cannot be imported ({exc}): pip install 'ray[train]'")
    yield ray
    # Ray Train leaves detached, named actors of its own alive after a run (Ray Data's
    # AutoscalingCoordinator): the next module on the shared cluster must find none.
    for actor in ray.util.list_named_actors(all_namespaces=True):
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)


@pytest.mark.timeout(480)
def test_fashion_mnist_port_gives_ray_train_numbers(ray_train, tmp_path) -> None:
    """Seeded, same synthetic data, 2 workers, 2 epochs: every rank's test loss and accuracy of
    every epoch equal Ray's TorchTrainer's exactly."""
    import ray.train
    from ray.train.torch import TorchTrainer as RayTorchTrainer

    ported = {}
    for name in PORTED_LINES:
        ported[name] = tmp_path / f"ported_{name}"
        ported[name].write_text(port(installed(name).read_text())[0])
    home = tmp_path / "home"  # the examples' FileLock("~/data.lock") files
    home.mkdir()
    common = {"samples": SAMPLES, "stubs": str(STUBS), "home": str(home)}
    out = tmp_path / "ray_out"
    out.mkdir()
    ray_trainer = RayTorchTrainer(
        make_ray_loop(),
        train_loop_config={
            **common,
            "fashion": str(installed("torch_fashion_mnist_example.py")),  # Ray's file, unchanged
            "fashion_config": FASHION_CONFIG,
            "out": str(out),
        },
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(storage_path=str(tmp_path / "ray_results"), name="ray"),
    )
    ours_trainer = TorchTrainer(
        train_loop_per_worker=_ringtrain_loop,
        train_loop_config={
            **common,
            "fashion": str(ported["torch_fashion_mnist_example.py"]),
            "quick_start": str(ported["torch_quick_start.py"]),
            "linear": str(ported["torch_linear_example.py"]),
            "horovod": str(ported["horovod_example.py"]),
            "fashion_config": FASHION_CONFIG,
        },
        scaling_config=rt.ScalingConfig(num_workers=2),
        run_config=rt.RunConfig(storage_path=str(tmp_path / "runs"), name="compat", progress="off"),
    )
    # Both at once (Ray's from a thread: ringtrain's fit() wants the main thread for signals):
    # most of either run is process start-up, which overlaps well.
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ray_done = pool.submit(ray_trainer.fit)
        result = ours_trainer.fit()
        ours_s = time.monotonic() - started
        ray_done.result(timeout=420)
    print(f"ringtrain run {ours_s:.1f} s, both {time.monotonic() - started:.1f} s")
    ray_metrics = {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}
    events = [json.loads(line) for line in (Path(result.path) / "events.jsonl").open()]
    ours: dict[int, list] = {0: [], 1: []}
    for e in sorted((e for e in events if e["type"] == "report"), key=lambda e: e["round"]):
        ours[e["rank"]].append(e["metrics"])
    epochs = FASHION_CONFIG["epochs"]
    assert len(ray_metrics[0]) == epochs
    fashion = {r: ours[r][:epochs] for r in ours}  # then linear's 2 reports, Horovod's 1
    assert fashion == ray_metrics, f"ringtrain {fashion}\nRay Train {ray_metrics}"
    # the linear loop's Checkpoint.from_directory(tmpdir) of every rank: one checkpoint a round
    assert result.checkpoint is not None and len(result.best_checkpoints) == 2
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "model.pt"), weights_only=True)
    assert set(state) == {"module.weight", "module.bias"}  # DDP's state dict, as in Ray
