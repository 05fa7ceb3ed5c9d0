import pytest

import ringtrain as rt


def test_defaults_are_valid():
    s = rt.ScalingConfig()
    assert (s.num_workers, s.use_gpu, s.backend) == (1, False, "local")
    r = rt.RunConfig()
    assert r.storage_path == "./runs" and r.name is None
    assert r.failure_config.max_failures == 0
    assert r.checkpoint_config.num_to_keep is None


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"num_workers": 0}, ValueError, ["num_workers", ">= 1", "num_workers=1"]),
        ({"num_workers": 2.0}, TypeError, ["num_workers", "int"]),
        ({"num_workers": True}, TypeError, ["num_workers"]),
        ({"backend": "slurm"}, ValueError, ["backend", "'local'"]),
        ({"use_gpu": "yes"}, TypeError, ["use_gpu"]),
        ({"resources_per_worker": {"TPU": 1}}, ValueError, ["TPU", "'CPU'"]),
        ({"resources_per_worker": {"CPU": 0}}, ValueError, ["positive"]),
        ({"resources_per_worker": {"GPU": 2}, "use_gpu": True}, ValueError, ["exactly one GPU"]),
        ({"preload_modules": "numpy"}, TypeError, ["preload_modules", "tuple of module names"]),
        ({"preload_modules": ("a-b",)}, ValueError, ["preload_modules", "'a-b'", "not a module"]),
        ({"preload_modules": (1,)}, ValueError, ["preload_modules", "1 is not a module"]),
        (
            {"preload_modules": ("no_such_module_rt.sub",)},
            ValueError,
            ["preload_modules", "no module named 'no_such_module_rt'", "install it"],
        ),
    ],
)
def test_scaling_config_rejects_bad_values(kwargs, error, words):
    with pytest.raises(error) as info:
        rt.ScalingConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_threads_per_worker():
    assert rt.ScalingConfig(num_workers=2).threads_per_worker(cpu_count=8) == 4
    assert rt.ScalingConfig(num_workers=4).threads_per_worker(cpu_count=2) == 1
    assert (
        rt.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 3}).threads_per_worker() == 3
    )


def test_configs_are_frozen_and_copy_dicts():
    resources = {"CPU": 1}
    s = rt.ScalingConfig(resources_per_worker=resources)
    resources["CPU"] = 99
    assert s.resources_per_worker == {"CPU": 1}
    with pytest.raises(AttributeError):
        s.num_workers = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"num_to_keep": 0}, ["num_to_keep", "None"]),
        ({"checkpoint_score_order": "up"}, ["'max' or 'min'"]),
        ({"checkpoint_score_attribute": ""}, ["checkpoint_score_attribute"]),
    ],
)
def test_checkpoint_config_rejects_bad_values(kwargs, words):
    with pytest.raises(ValueError) as info:
        rt.CheckpointConfig(**kwargs)
    for word in words:
        assert word in str(info.value)


def test_failure_config():
    assert rt.FailureConfig(max_failures=-1).max_failures == -1
    with pytest.raises(ValueError, match="max_failures"):
        rt.FailureConfig(max_failures=-2)


def test_run_config_rejects_bad_values():
    with pytest.raises(ValueError, match=r"RunConfig\.name"):
        rt.RunConfig(name="a/b")
    with pytest.raises(TypeError, match="checkpoint_config"):
        rt.RunConfig(checkpoint_config={"num_to_keep": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_report"):
        rt.RunConfig(callbacks=[object()])
    with pytest.raises(ValueError, match="progress"):
        rt.RunConfig(progress="fancy")  # type: ignore[arg-type]


def test_trainer_rejects_wrong_types_before_starting_anything(tmp_path):
    with pytest.raises(TypeError, match="callable"):
        rt.Trainer(42)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ScalingConfig"):
        rt.Trainer(lambda: None, scaling_config={"num_workers": 2})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="train_loop_config"):
        rt.Trainer(lambda c: None, train_loop_config=[1])  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_use_gpu_without_enough_gpus_fails_before_any_process(tmp_path):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 64:
        pytest.skip("this machine has 64 GPUs")
    trainer = rt.Trainer(
        lambda: None,
        rt.ScalingConfig(num_workers=64, use_gpu=True),
        rt.RunConfig(name="gpu", storage_path=str(tmp_path)),
    )
    with pytest.raises(ValueError, match="needs 64 CUDA devices"):
        trainer.fit()
    assert not (tmp_path / "gpu").exists()


def test_preload_modules_come_back_as_a_tuple_from_json():
    s = rt.ScalingConfig(preload_modules=["json", "email.mime"])  # type: ignore[arg-type]
    assert s.preload_modules == ("json", "email.mime")
    assert rt.ScalingConfig().preload_modules == ()
