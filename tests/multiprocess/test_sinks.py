"""TensorBoard, CSV, MLflow and W&B callbacks: their files read back with each tool's own reader,
and a real two-worker run that logs through them."""

from __future__ import annotations

import csv
import io
import math
import os
import struct
import sys
import uuid

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import ringtrain as rt
import workloads
from ringtrain.monitor.sinks import CSVCallback, TensorBoardCallback, default_sinks
from ringtrain.monitor.straggler import StragglerEvent
from ringtrain.rundir import RunDirectory
from support import wait_until

TIMING_TAGS = {
    "step_s",
    "data_s",
    "compute_s",
    "comm_s",
    "comm_exposed_s",
    "optimizer_s",
    "other_s",
    "busy_s",
    "samples_per_s",
    "rss_bytes",
}


def window(step: int, step_s: float = 0.1, data_s: float = 0.01, gpu: bool = False) -> dict:
    """A timing window as the workers send it (fields of the ``timing`` event)."""
    compute, exposed, opt = 0.06, 0.01, 0.01
    other = step_s - data_s - compute - exposed - opt
    return {
        "steps": 5,
        "step": step,
        "step_s": step_s,
        "step_s_mean": step_s,
        "data_s": data_s,
        "compute_s": compute,
        "comm_exposed_s": exposed,
        "optimizer_s": opt,
        "other_s": other,
        "comm_s": 0.03,
        "comm_bytes": 4096.0,
        "busy_s": step_s - exposed,
        "samples": 40,
        "samples_per_s": 40 / (5 * step_s),
        "window_s": 5 * step_s,
        "rss_bytes": 300_000_000,
        "gpu_allocated_bytes": 2_000_000 if gpu else None,
        "gpu_peak_bytes": 3_000_000 if gpu else None,
        "gpu_util": 87.5 if gpu else None,
    }


def straggler(rank: int, flagged: bool) -> StragglerEvent:
    word = "is a straggler" if flagged else "is no longer a straggler"
    return StragglerEvent(
        rank=rank,
        flagged=flagged,
        busy_s=0.3 if flagged else 0.1,
        median_s=0.1,
        ratio=3.0 if flagged else 1.0,
        reason="data" if flagged else "",
        message=f"rank {rank} {word}",
        time=1_763_720_000.0,
    )


def failed_result() -> rt.Result:
    failure = rt.WorkerFailure(rank=1, kind="exception", message="rank 1 raised ValueError: bad")
    return rt.Result(error=rt.TrainingFailedError([failure]), failures=[failure])


def accumulator(log_dir: str) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def read_csv(path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        text = f.read()
    reader = csv.DictReader(io.StringIO(text))
    rows = list(reader)
    return list(reader.fieldnames or []), rows


# ------------------------------------------------------------------ TensorBoard


def test_tensorboard_tags_steps_and_values(tmp_path):
    log_dir = tmp_path / "tb"
    cb = TensorBoardCallback(str(log_dir))
    cb.on_report(0, 0, {"loss": 1.5, "step": 4, "phase": "train", "ok": True, "bad": math.nan})
    cb.on_report(1, 0, {"loss": 1.7, "step": 4})
    cb.on_round(0, {"loss": 1.5, "step": 4, "phase": "train", "ok": True, "bad": math.nan})
    cb.on_report(0, 1, {"loss": 0.5})  # no "step": the round is the x-axis
    cb.on_report(1, 1, {"loss": 0.7})
    cb.on_round(1, {"loss": 0.5})
    cb.on_timing(0, window(10, step_s=0.1))
    cb.on_timing(1, window(10, step_s=0.3, data_s=0.2, gpu=True))
    cb.on_timing(1, window(20, step_s=0.32, data_s=0.21, gpu=True))
    cb.on_straggler(straggler(1, True))
    cb.on_timing(1, window(30, step_s=0.1))
    cb.on_straggler(straggler(1, False))
    cb.on_end(rt.Result())

    acc = accumulator(log_dir)
    tags = set(acc.Tags()["scalars"])
    # Numbers only: strings and bools are not scalars; NaN is.
    assert {"metrics/loss", "metrics/step", "metrics/bad"} <= tags
    assert not {t for t in tags if t.endswith(("/phase", "/ok"))}
    assert scalars(acc, "metrics/loss") == [(4, 1.5), (1, 0.5)]
    assert math.isnan(scalars(acc, "metrics/bad")[0][1])
    assert scalars(acc, "rank_0/loss") == [(4, 1.5), (1, 0.5)]
    assert scalars(acc, "rank_1/loss") == [(4, pytest.approx(1.7)), (1, pytest.approx(0.7))]

    assert {t.rsplit("/", 1)[1] for t in tags if t.startswith("timing/rank_0/")} == TIMING_TAGS
    # GPU fields appear where the window has them (not None).
    assert {t.rsplit("/", 1)[1] for t in tags if t.startswith("timing/rank_1/")} == TIMING_TAGS | {
        "gpu_allocated_bytes",
        "gpu_peak_bytes",
        "gpu_util",
    }
    assert scalars(acc, "timing/rank_0/step_s") == [(10, pytest.approx(0.1))]
    assert [s for s, _ in scalars(acc, "timing/rank_1/data_s")] == [10, 20, 30]
    assert scalars(acc, "timing/rank_1/data_s")[1][1] == pytest.approx(0.21)
    assert scalars(acc, "timing/rank_0/rss_bytes") == [(10, 300_000_000.0)]
    assert scalars(acc, "timing/rank_1/gpu_util") == [(10, 87.5), (20, 87.5)]

    # Straggler flag at the rank's latest timing step, then cleared; the message as text.
    assert scalars(acc, "stragglers/rank_1") == [(20, 1.0), (30, 0.0)]
    assert [e.wall_time for e in acc.Scalars("stragglers/rank_1")] == [1_763_720_000.0] * 2
    texts = [
        b"".join(e.tensor_proto.string_val).decode() for e in acc.Tensors("stragglers/text_summary")
    ]
    assert texts == ["rank 1 is a straggler", "rank 1 is no longer a straggler"]


def test_tensorboard_flushes_while_the_run_goes(tmp_path):
    """A live TensorBoard must see data before the run ends (no close, no explicit flush)."""
    log_dir = tmp_path / "tb"
    cb = TensorBoardCallback(str(log_dir), flush_secs=0.5)
    try:
        cb.on_round(0, {"loss": 2.0, "step": 1})
        cb.on_round(1, {"loss": 1.0, "step": 2})

        def visible() -> bool:
            acc = accumulator(log_dir)
            return "metrics/loss" in acc.Tags()["scalars"] and len(acc.Scalars("metrics/loss")) == 2

        assert wait_until(visible, timeout_s=60, interval_s=0.2), "events never reached the file"
        assert scalars(accumulator(log_dir), "metrics/loss") == [(1, 2.0), (2, 1.0)]
    finally:
        cb.close()
    cb.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        cb.on_round(2, {"loss": 0.5})


def test_tensorboard_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        TensorBoardCallback("")
    with pytest.raises(ValueError, match="flush_secs"):
        TensorBoardCallback(str(tmp_path), flush_secs=0)


# ------------------------------------------------------------------ CSV


def test_csv_rows_are_readable_at_once_and_the_header_widens(tmp_path):
    cb = CSVCallback(str(tmp_path))
    cb.on_round(0, {"loss": 1.0, "step": 4})
    # Flushed with every row: readable while the callback still holds the file open.
    header, rows = read_csv(tmp_path / "metrics.csv")
    assert header == ["round", "time", "loss", "step"]
    assert [(r["round"], r["loss"], r["step"]) for r in rows] == [("0", "1.0", "4")]
    assert float(rows[0]["time"]) > 1e9

    # New keys widen the header; earlier rows get empty cells; containers are skipped; a metric
    # named like a leading column keeps its own column.
    cb.on_round(1, {"loss": 0.5, "step": 8, "acc": 0.9, "phase": "val", "hist": [1, 2], "round": 7})
    cb.on_round(2, {"loss": 0.25, "step": 12, "ok": True, "none": None})
    header, rows = read_csv(tmp_path / "metrics.csv")
    assert header == ["round", "time", "loss", "step", "acc", "phase", "metric.round", "ok", "none"]
    assert [r["round"] for r in rows] == ["0", "1", "2"]
    assert [r["acc"] for r in rows] == ["", "0.9", ""]
    assert [r["phase"] for r in rows] == ["", "val", ""]
    assert [r["metric.round"] for r in rows] == ["", "7", ""]
    assert rows[2]["ok"] == "True" and rows[2]["none"] == ""
    assert "hist" not in header
    with open(tmp_path / "metrics.csv") as f:
        assert f.read().count("round,time") == 1

    cb.on_timing(0, window(10))
    cb.on_timing(1, window(10, step_s=0.3, gpu=True))
    header, rows = read_csv(tmp_path / "timing.csv")
    assert header[:2] == ["time", "rank"]
    assert {"steps", "step", "step_s", "data_s", "comm_exposed_s", "rss_bytes", "gpu_util"} <= set(
        header
    )
    assert [(r["rank"], r["step"]) for r in rows] == [("0", "10"), ("1", "10")]
    assert float(rows[1]["step_s"]) == pytest.approx(0.3)
    assert rows[0]["gpu_util"] == "" and rows[1]["gpu_util"] == "87.5"
    cb.on_end(rt.Result())
    cb.on_end(rt.Result())  # idempotent


def test_csv_continues_the_files_of_an_earlier_driver(tmp_path):
    first = CSVCallback(str(tmp_path))
    first.on_round(0, {"loss": 1.0})
    first.on_timing(0, window(5))
    first.on_end(rt.Result())

    second = CSVCallback(str(tmp_path))
    second.on_round(1, {"loss": 0.5, "acc": 0.8})
    second.on_timing(0, window(10))
    second.on_end(rt.Result())

    header, rows = read_csv(tmp_path / "metrics.csv")
    assert header == ["round", "time", "loss", "acc"]
    assert [(r["round"], r["loss"], r["acc"]) for r in rows] == [
        ("0", "1.0", ""),
        ("1", "0.5", "0.8"),
    ]
    _, timing = read_csv(tmp_path / "timing.csv")
    assert [r["step"] for r in timing] == ["5", "10"]


# ------------------------------------------------------------------ default sinks


def test_default_sinks_follow_the_monitor_config(tmp_path):
    run_dir = RunDirectory(str(tmp_path), "run")
    tb, csv_cb = default_sinks(run_dir, rt.MonitorConfig())
    assert isinstance(tb, TensorBoardCallback) and isinstance(csv_cb, CSVCallback)
    assert tb.local_dir == str(tmp_path / "run" / "tensorboard")
    assert csv_cb.local_dir == str(tmp_path / "run")
    only_csv = default_sinks(run_dir, rt.MonitorConfig(tensorboard=False))
    assert [type(s) for s in only_csv] == [CSVCallback]
    only_tb = default_sinks(run_dir, rt.MonitorConfig(csv=False))
    assert [type(s) for s in only_tb] == [TensorBoardCallback]
    assert default_sinks(run_dir, rt.MonitorConfig(tensorboard=False, csv=False)) == []
    # Nothing is written until an event arrives.
    assert not (tmp_path / "run").exists()


def test_remote_run_directory_gets_the_files_on_end(tmp_path):
    storage = f"memory://sinks-{uuid.uuid4().hex}"
    run_dir = RunDirectory(storage, "run")
    fs = run_dir.fs
    try:
        # A metrics.csv from an earlier driver of this run is continued, not replaced.
        run_dir.create()
        run_dir.write_bytes("metrics.csv", b"round,time,loss\n0,1763720000.0,2.0\n")
        sinks = default_sinks(run_dir, rt.MonitorConfig())
        tb, csv_cb = sinks
        local_dirs = [tb.local_dir, csv_cb.local_dir]
        for d in local_dirs:
            assert not d.startswith(storage) and os.path.isabs(d)
        for cb in sinks:
            cb.on_round(1, {"loss": 1.0, "step": 4})
            cb.on_timing(0, window(4))
        # Not there until the run ends.
        assert not fs.exists(run_dir.path + "/timing.csv")
        assert not fs.exists(run_dir.path + "/tensorboard")
        for cb in sinks:
            cb.on_end(rt.Result())
        for d in local_dirs:
            assert not os.path.exists(d), "the local staging directory was not removed"

        metrics = fs.cat_file(run_dir.path + "/metrics.csv").decode()
        rows = list(csv.DictReader(io.StringIO(metrics)))
        assert [(r["round"], r["loss"], r["step"]) for r in rows] == [
            ("0", "2.0", ""),
            ("1", "1.0", "4"),
        ]
        timing = list(
            csv.DictReader(io.StringIO(fs.cat_file(run_dir.path + "/timing.csv").decode()))
        )
        assert [(r["rank"], r["step"]) for r in timing] == [("0", "4")]
        events = fs.ls(run_dir.path + "/tensorboard", detail=False)
        assert len(events) == 1 and "tfevents" in events[0]
        local_copy = tmp_path / "tb"
        local_copy.mkdir()
        fs.get_file(events[0], str(local_copy / events[0].rsplit("/", 1)[1]))
        acc = accumulator(local_copy)
        assert scalars(acc, "metrics/loss") == [(4, 1.0)]
        assert scalars(acc, "timing/rank_0/step_s") == [(4, pytest.approx(0.1))]
    finally:
        if fs.exists(run_dir.path):
            fs.rm(run_dir.path, recursive=True)


# ------------------------------------------------------------------ MLflow and W&B


@pytest.mark.parametrize(
    ("name", "modules", "hint"),
    [
        ("MLflowCallback", ["mlflow", "mlflow.entities", "mlflow.tracking"], "mlflow-skinny"),
        ("WandbCallback", ["wandb"], "pip install wandb"),
    ],
)
def test_trackers_say_how_to_install_a_missing_package(monkeypatch, name, modules, hint):
    from ringtrain.monitor import integrations

    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import of it raises ImportError
    with pytest.raises(ImportError, match=hint):
        getattr(integrations, name)()


def _log_a_run(cb) -> None:
    cb.on_round(0, {"loss": 1.0, "step": 4, "phase": "train"})
    cb.on_timing(0, window(5))
    cb.on_timing(1, window(5, step_s=0.3, data_s=0.2))
    cb.on_timing(1, window(9, step_s=0.3, data_s=0.2))
    cb.on_straggler(straggler(1, True))
    cb.on_round(1, {"loss": 0.5, "step": 8})
    cb.on_timing(1, window(12))
    cb.on_straggler(straggler(1, False))


def test_mlflow_run_read_back_with_mlflow(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="needs MLflow (pip install mlflow-skinny)")
    from mlflow.tracking import MlflowClient

    # MLflow 3 refuses the file store unless asked; a local store keeps the test self-contained.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    cb = rt.MLflowCallback(
        tracking_uri=uri,
        experiment_name="ringtrain-test",
        run_name="two-workers",
        config={"lr": 0.1, "optimizer": {"name": "sgd", "momentum": 0.9}},
    )
    _log_a_run(cb)
    cb.on_end(rt.Result())

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(cb.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "two-workers"
    assert client.get_experiment(run.info.experiment_id).name == "ringtrain-test"
    assert run.data.params == {"lr": "0.1", "optimizer.name": "sgd", "optimizer.momentum": "0.9"}

    def history(key):
        return [(m.step, m.value) for m in client.get_metric_history(cb.run_id, key)]

    assert history("loss") == [(4, 1.0), (8, 0.5)]
    assert history("step") == [(4, 4.0), (8, 8.0)]
    assert "phase" not in run.data.metrics
    assert history("timing/rank_0/step_s") == [(5, pytest.approx(0.1))]
    assert [s for s, _ in history("timing/rank_1/data_s")] == [5, 9, 12]
    assert history("timing/rank_1/rss_bytes")[0] == (5, 300_000_000.0)
    assert "timing/rank_0/gpu_util" not in run.data.metrics  # None on CPU
    assert history("stragglers/rank_1") == [(9, 1.0), (12, 0.0)]
    assert run.data.tags["straggler.rank_1"] == "rank 1 is no longer a straggler"

    failed = rt.MLflowCallback(tracking_uri=uri, experiment_name="ringtrain-test")
    failed.on_round(0, {"loss": 3.0})
    failed.on_failure(failed_result().failures[0])
    failed.on_end(failed_result())
    run = client.get_run(failed.run_id)
    assert run.info.status == "FAILED"
    assert "rank 1 raised ValueError" in run.data.tags["ringtrain.failure"]


def _wandb_records(path):
    """The records of a W&B offline run file (``run-<id>.wandb``): LevelDB-log framing of
    ``wandb_internal.Record`` protobufs, decoded with wandb's own message classes."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    block, pos, pending = 32768, 7, b""
    while pos < len(data):
        left = block - pos % block
        if left < 7:
            pos += left  # block trailer padding
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (2, 3):  # FIRST, MIDDLE
            pending += chunk
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending + chunk)
        pending = b""
        yield record


def _key(item) -> str:
    """A history / summary item's name (W&B stores names with "/" as a nested key)."""
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_files(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="needs Weights & Biases (pip install wandb)")
    import json

    for key, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CACHE_DIR": str(tmp_path / "cache"),
        "WANDB_CONFIG_DIR": str(tmp_path / "config"),
        "WANDB_DATA_DIR": str(tmp_path / "data"),
    }.items():
        monkeypatch.setenv(key, value)
    try:
        cb = rt.WandbCallback(
            project="ringtrain-test",
            config={"lr": 0.1, "optimizer": {"name": "sgd"}},
            name="two-workers",
            settings=wandb.Settings(x_disable_stats=True),
        )
        _log_a_run(cb)
        cb.on_failure(failed_result().failures[0])
        cb.on_end(failed_result())
        run_id = cb.run.id
    finally:
        wandb.teardown()  # stops the wandb-core service process

    (run_file,) = list(tmp_path.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    records = list(_wandb_records(run_file))
    kinds = [r.WhichOneof("record_type") for r in records]
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.project == "ringtrain-test" and run_record.display_name == "two-workers"
    config = {i.key: json.loads(i.value_json) for i in run_record.config.update}
    assert config["lr"] == 0.1
    assert config["optimizer"] == {"name": "sgd"}

    history = [
        {_key(i): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    rounds = [h for h in history if "loss" in h]
    assert [(h["trainer/step"], h["trainer/round"], h["loss"]) for h in rounds] == [
        (4, 0, 1.0),
        (8, 1, 0.5),
    ]
    assert all("phase" not in h for h in history)
    timing = [h for h in history if "timing/rank_1/step" in h]
    assert [h["timing/rank_1/step"] for h in timing] == [5, 9, 12]
    assert timing[0]["timing/rank_1/data_s"] == pytest.approx(0.2)
    assert timing[0]["timing/rank_1/rss_bytes"] == 300_000_000
    assert [h["stragglers/rank_1"] for h in history if "stragglers/rank_1" in h] == [1, 0]

    metrics = {
        (r.metric.name or r.metric.glob_name): r.metric.step_metric
        for r in records
        if r.WhichOneof("record_type") == "metric"
    }
    assert metrics["loss"] == "trainer/step"
    assert metrics["timing/rank_1/*"] == "timing/rank_1/step"
    assert metrics["stragglers/*"] == "trainer/step"

    summary: dict = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
    assert summary["stragglers/rank_1/message"] == "rank 1 is no longer a straggler"
    assert "rank 1 raised ValueError" in summary["ringtrain/failure"]
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 1
    assert kinds.index("exit") > max(i for i, k in enumerate(kinds) if k == "history")


# ------------------------------------------------------------------ a real run


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """Two CPU workers, seven report rounds (``step`` 4, 8, 10, 12, 16, 20, 20), logging through
    TensorBoardCallback and CSVCallback passed as callbacks, plus the default sinks."""
    tmp = tmp_path_factory.mktemp("logged_run")
    tb, csv_cb = TensorBoardCallback(str(tmp / "tb")), CSVCallback(str(tmp / "csv"))
    result = rt.Trainer(
        workloads.exact_fn,
        rt.ScalingConfig(num_workers=2),
        rt.RunConfig(
            name="logged", storage_path=str(tmp / "runs"), progress="off", callbacks=[tb, csv_cb]
        ),
        train_loop_config={"epochs": 2, "every": 4, "kill_rank": -1, "out": str(tmp / "out.pt")},
    ).fit()
    return tmp, result


STEPS = [4, 8, 10, 12, 16, 20, 20]


def test_end_to_end_per_rank_report_scalars(logged_run):
    tmp, result = logged_run
    assert [m["step"] for m in result.metrics_history] == STEPS
    acc = accumulator(tmp / "tb")
    for rank in (0, 1):
        assert [s for s, _ in scalars(acc, f"rank_{rank}/loss")] == STEPS
        assert [v for _, v in scalars(acc, f"rank_{rank}/step")] == [float(s) for s in STEPS]
        assert [s for s, _ in scalars(acc, f"rank_{rank}/epoch_end")] == [10, 20]
    rank0 = [m["loss"] for m in result.metrics_history]
    assert [v for _, v in scalars(acc, "rank_0/loss")] == pytest.approx(rank0, rel=1e-6)


def test_end_to_end_round_metrics(logged_run):
    tmp, result = logged_run
    acc = accumulator(tmp / "tb")
    losses = [m["loss"] for m in result.metrics_history]
    assert [s for s, _ in scalars(acc, "metrics/loss")] == STEPS
    assert [v for _, v in scalars(acc, "metrics/loss")] == pytest.approx(losses, rel=1e-6)
    header, rows = read_csv(tmp / "csv" / "metrics.csv")
    assert header[:2] == ["round", "time"] and {"loss", "step", "epoch_end"} <= set(header)
    assert [int(r["round"]) for r in rows] == list(range(7))
    assert [int(r["step"]) for r in rows] == STEPS
    assert [float(r["loss"]) for r in rows] == pytest.approx(losses)
    assert [r["epoch_end"] for r in rows] == ["", "", "0", "", "", "", "1"]


def test_end_to_end_timing(logged_run):
    tmp, _result = logged_run
    acc = accumulator(tmp / "tb")
    tags = set(acc.Tags()["scalars"])
    _, rows = read_csv(tmp / "csv" / "timing.csv")
    for rank in (0, 1):
        assert {f"timing/rank_{rank}/{f}" for f in TIMING_TAGS} <= tags
        steps = [s for s, _ in scalars(acc, f"timing/rank_{rank}/step_s")]
        assert steps and steps[-1] == 20, "the final window must cover every step"
        assert all(v > 0 for _, v in scalars(acc, f"timing/rank_{rank}/step_s"))
        mine = [r for r in rows if r["rank"] == str(rank)]
        assert [int(r["step"]) for r in mine] == steps
        assert sum(int(r["steps"]) for r in mine) == 20
        assert all(float(r["rss_bytes"]) > 1e6 for r in mine)


def test_default_sinks_are_wired_by_the_trainer(logged_run):
    tmp, _result = logged_run
    run_dir = tmp / "runs" / "logged"
    acc = accumulator(run_dir / "tensorboard")
    assert [s for s, _ in scalars(acc, "metrics/loss")] == STEPS
    _, rows = read_csv(run_dir / "metrics.csv")
    assert [int(r["step"]) for r in rows] == STEPS
    _, timing = read_csv(run_dir / "timing.csv")
    assert {r["rank"] for r in timing} == {"0", "1"}
