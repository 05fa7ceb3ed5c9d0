"""Issue 18: a checkpoint is verified as a whole and signed, and a run directory cannot run code.

The attacker here can write the storage (the bucket, the shared run directory) but does not hold
the signing key. Each test builds the attack on real files and checks that ringtrain refuses it
before a byte of the attacker's choice is unpickled; worker-side behaviour is tested on real
worker processes.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ringtrain as rt
import workloads
from ringtrain.checkpoint import signing, storage
from ringtrain.checkpoint.checkpoint import CheckpointLoadError
from ringtrain.checkpoint.manager import CheckpointManager, NoValidCheckpointError
from ringtrain.config import CheckpointConfig
from ringtrain.worker.state import STATE_FILE, TrainState, rank_file
from support import Poisoned

LOCAL = fsspec.filesystem("file")


def _publish_state(run: Path, round_: int, state: TrainState) -> Path:
    """Publish ``state`` as checkpoint ``round_`` of run directory ``run``, as the driver does."""
    staging = run / storage.staging_dirname(round_)
    staging.mkdir(parents=True)
    files = {}
    for name, write in state._checkpoint_writers(False).items():
        with open(staging / name, "wb") as f:
            write(f)
        files[name] = storage.file_digest(LOCAL, str(staging / name))
    return Path(storage.publish(LOCAL, str(run), round_, files, {"step": state.step}))


def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / storage.MANIFEST).read_text())


def _write_manifest(ckpt: Path, manifest: dict) -> None:
    (ckpt / storage.MANIFEST).write_text(json.dumps(manifest))


def _resign(ckpt: Path, run: str, round_: int, files: dict | None = None) -> None:
    """Re-sign ``ckpt``'s manifest with the right key (what only the key holder can do)."""
    if files is None:
        files = {
            p.name: storage.file_digest(LOCAL, str(p))
            for p in sorted(ckpt.iterdir())
            if p.name != storage.MANIFEST
        }
    storage.write_manifest(LOCAL, str(ckpt), files, signing.resolve(), run=run, round_=round_)


def _two_checkpoints(tmp_path: Path) -> tuple[Path, Path, Path]:
    run = tmp_path / "run"
    run.mkdir()
    model = torch.nn.Linear(2, 2)
    old = _publish_state(run, 0, TrainState(model, step=1))
    with torch.no_grad():
        model.weight.add_(1.0)
    new = _publish_state(run, 1, TrainState(model, step=2))
    return run, old, new


def _latest(run: Path) -> tuple[CheckpointManager, object]:
    mgr = CheckpointManager(LOCAL, str(run), CheckpointConfig())
    mgr.scan()
    return mgr, mgr.latest_verified()


# ---------------------------------------------------------------- the manifest covers every file


def test_a_file_the_manifest_does_not_list_is_refused(tmp_path):
    run, old, new = _two_checkpoints(tmp_path)
    shutil.copy(new / STATE_FILE, new / "extra.pt")
    mgr, latest = _latest(run)
    assert latest.round == 0  # the newest is set aside, the one before is used
    assert (run / f"{new.name}.corrupt").is_dir()
    assert any("extra.pt is not listed" in n for n in mgr.notes)

    # A worker that was handed the verified table refuses an unlisted file it is asked for.
    ckpt = rt.Checkpoint(str(old))
    ckpt.set_verified_files({STATE_FILE: _manifest(old)["files"][STATE_FILE]})
    with pytest.raises(CheckpointLoadError, match=f"{rank_file(0)} is not listed"):
        TrainState(torch.nn.Linear(2, 2)).restore(ckpt)


def test_an_empty_files_table_with_a_flipped_rank_file_is_refused(tmp_path):
    run, _old, new = _two_checkpoints(tmp_path)
    manifest = _manifest(new)
    manifest["files"] = {}
    _write_manifest(new, manifest)
    data = bytearray((new / rank_file(0)).read_bytes())
    data[len(data) // 2] ^= 0x01
    (new / rank_file(0)).write_bytes(bytes(data))
    with pytest.raises(CheckpointLoadError, match="not signed"):
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(new)))
    # Even signed by the key holder, files on disk that the table omits are refused.
    _resign(new, "run", 1, files={})
    with pytest.raises(CheckpointLoadError, match="not listed"):
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(new)))
    _mgr, latest = _latest(run)
    assert latest.round == 0


def test_an_older_train_state_swapped_in_and_rehashed_is_refused(tmp_path):
    """The attacker copies an older train_state.pt in and fixes size and SHA-256 in the manifest;
    without the key the manifest's HMAC no longer matches."""
    run, old, new = _two_checkpoints(tmp_path)
    shutil.copy(old / STATE_FILE, new / STATE_FILE)
    manifest = _manifest(new)
    manifest["files"][STATE_FILE] = storage.file_digest(LOCAL, str(new / STATE_FILE))
    _write_manifest(new, manifest)
    with pytest.raises(CheckpointLoadError, match="not signed for run 'run' with your key"):
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(new)))
    mgr, latest = _latest(run)
    assert latest.round == 0 and any("not signed" in n for n in mgr.notes)


def test_an_older_checkpoint_renamed_newer_or_from_another_run_is_refused(tmp_path):
    run, old, new = _two_checkpoints(tmp_path)
    shutil.rmtree(new)
    shutil.copytree(old, run / storage.checkpoint_dirname(5))  # roll an old one forward
    mgr, latest = _latest(run)
    assert latest.round == 0
    assert any("is for round 0, not 5" in n for n in mgr.notes)

    other = tmp_path / "other"
    shutil.copytree(run, other)
    with pytest.raises(NoValidCheckpointError, match="belongs to run 'run'"):
        _latest(other)  # signed for run "run", found in run "other": none verifies, refused


# ---------------------------------------------------------------- paths stay in the checkpoint


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "attack",
    [
        "dotdot_hostname",
        "dotdot_dev_zero",
        "absolute",
        "nested_dotdot",
        "symlink_hostname",
        "symlink_dev_zero",
        "symlinked_dir",
        "fifo",
    ],
)
def test_manifest_paths_that_escape_are_refused_quickly(tmp_path, attack):
    """Signed with the right key even (ringtrain never writes such a manifest): the path rules
    hold on their own, before anything is opened, and nothing hangs (``/dev/zero`` is endless,
    a FIFO blocks its reader)."""
    run, _old, new = _two_checkpoints(tmp_path)
    files = dict(_manifest(new)["files"])
    fake = {"size": 10, "sha256": "0" * 64}
    if attack == "dotdot_hostname":
        files["../../../../../../etc/hostname"] = fake
    elif attack == "dotdot_dev_zero":
        files["../../../../../../../../dev/zero"] = fake
    elif attack == "absolute":
        files["/etc/hostname"] = fake
    elif attack == "nested_dotdot":
        files["sub/../../x"] = fake
    elif attack == "symlink_hostname":
        os.symlink("/etc/hostname", new / "host.pt")
        files["host.pt"] = fake
    elif attack == "symlink_dev_zero":
        (new / rank_file(0)).unlink()
        os.symlink("/dev/zero", new / rank_file(0))
        files[rank_file(0)] = {**files[rank_file(0)], "size": 1 << 40}
    elif attack == "symlinked_dir":
        os.symlink("/etc", new / "sub")
        files["sub/hostname"] = fake
    elif attack == "fifo":
        (new / rank_file(0)).unlink()
        os.mkfifo(new / rank_file(0))
    if attack in ("dotdot_hostname", "dotdot_dev_zero", "absolute", "nested_dotdot"):
        with pytest.raises(ValueError, match="not a plain relative path"):
            storage.write_manifest(LOCAL, str(new), files, signing.resolve(), run="run", round_=1)
        manifest = _manifest(new)
        manifest["files"] = files
        body = storage.manifest_body(manifest)
        manifest["hmac"] = signing.resolve().sign(body, "manifest", "run")
        _write_manifest(new, manifest)
    else:
        _resign(new, "run", 1, files=files)
    with pytest.raises(CheckpointLoadError):
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(new)))
    for verify in (False, True):
        with pytest.raises(ValueError):
            storage.read_manifest(LOCAL, str(new), verify)
    _mgr, latest = _latest(run)
    assert latest is not None and latest.round == 0


@pytest.mark.parametrize(
    "rel", ["a/./b", "a//b", "", ".", "..", "a\\b", "C:x", "x\0y", "manifest.json", "a/"]
)
def test_check_relpath_refuses_odd_names(rel):
    with pytest.raises(ValueError):
        storage.check_relpath(rel)


@pytest.mark.parametrize("rel", ["model.pt", "sub/dir/x.bin", "model:v1.pt", ".metadata", "..a"])
def test_check_relpath_accepts_plain_names(rel):
    assert storage.check_relpath(rel) == rel


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.sampled_from(["a", "b.pt", "..", ".", "", "/", "\\", "\0", "C:", "~", " ", "é"]),
        min_size=1,
        max_size=6,
    ).map("/".join)
    | st.text(max_size=20)
)
def test_an_accepted_manifest_path_always_stays_inside(rel):
    """Generated hostile names: whatever check_relpath accepts names a file strictly inside
    the checkpoint directory."""
    root = "/ckpt/dir"
    try:
        storage.check_relpath(rel)
    except ValueError:
        return
    full = os.path.normpath(os.path.join(root, rel))
    assert full.startswith(root + "/") and not os.path.isabs(rel) and "\0" not in rel


def test_a_file_name_no_manifest_may_hold_is_never_published(tmp_path):
    run = tmp_path / "run"
    staging = run / storage.staging_dirname(0)
    staging.mkdir(parents=True)
    (staging / "a\\b").write_bytes(b"x")
    mgr = CheckpointManager(LOCAL, str(run), CheckpointConfig())
    with pytest.raises(ValueError, match="not a plain relative path"):
        mgr.publish(0, {"a\\b": storage.file_digest(LOCAL, str(staging / "a\\b"))}, {})
    assert mgr.latest is None and not (run / storage.checkpoint_dirname(0)).exists()


def test_files_are_hashed_as_they_are_read(tmp_path):
    """A file swapped after the driver checked it (a worker's copy of the table is all it
    trusts) is refused when read: the bytes checked are the bytes loaded."""
    _run, _old, new = _two_checkpoints(tmp_path)
    ckpt = rt.Checkpoint(str(new))
    ckpt.set_verified_files(_manifest(new)["files"])  # what the driver sends in Start
    good = (new / STATE_FILE).read_bytes()
    torch.save({"format": 1, "objects": {}, "step": 99, "epoch": 0}, new / STATE_FILE)
    with pytest.raises(CheckpointLoadError, match=r"SHA-256|bytes"):
        TrainState(torch.nn.Linear(2, 2)).restore(ckpt)
    (new / STATE_FILE).write_bytes(good)
    state = TrainState(torch.nn.Linear(2, 2))
    assert state.restore(ckpt) and state.step == 2


# ---------------------------------------------------------------- keys


def test_another_key_is_refused_and_trust_unsigned_is_an_explicit_opt_in(tmp_path, caplog):
    _run, _old, new = _two_checkpoints(tmp_path)
    other = "another key, 0123456789abcdef"
    with pytest.raises(CheckpointLoadError, match="not signed for run 'run' with your key"):
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(str(new), signing_key=other))
    state = TrainState(torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        assert state.restore(rt.Checkpoint(str(new), signing_key=other, trust_unsigned=True))
    assert state.step == 2
    assert any("trust_unsigned=True" in r.getMessage() for r in caplog.records)


def test_a_handle_from_the_driver_reads_with_the_runs_key(tmp_path):
    """``Result.checkpoint`` of a run signed with its own key carries the verified table: it
    restores in the driver's process without the key, and a file changed later is refused."""
    run = tmp_path / "run"
    run.mkdir()
    signer = signing.resolve("the run's own key, 0123456789")
    state = TrainState(torch.nn.Linear(2, 2), step=3)
    staging = run / storage.staging_dirname(0)
    staging.mkdir()
    files = {}
    for name, write in state._checkpoint_writers(False).items():
        with open(staging / name, "wb") as f:
            write(f)
        files[name] = storage.file_digest(LOCAL, str(staging / name))
    mgr = CheckpointManager(LOCAL, str(run), CheckpointConfig(), signer=signer)
    ckpt = mgr.publish(0, files, {}).checkpoint
    restored = TrainState(torch.nn.Linear(2, 2))
    assert restored.restore(ckpt) and restored.step == 3
    with pytest.raises(CheckpointLoadError, match="not signed"):  # a fresh handle: default key
        TrainState(torch.nn.Linear(2, 2)).restore(rt.Checkpoint(ckpt.path))
    (Path(ckpt.path) / rank_file(0)).write_bytes(b"changed")
    with pytest.raises(CheckpointLoadError, match="bytes"):
        TrainState(torch.nn.Linear(2, 2)).restore(ckpt)


def test_the_key_file_is_private_and_created_once(tmp_path, monkeypatch):
    monkeypatch.setenv(signing.ENV_KEY_DIR, str(tmp_path / "keys"))
    monkeypatch.delenv(signing.ENV_SIGNING_KEY, raising=False)
    first = signing.resolve()
    path = tmp_path / "keys" / signing.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert signing.resolve().key == first.key  # reused, not replaced
    assert first.key not in repr(first).encode()
    path.chmod(0o640)
    with pytest.raises(PermissionError, match="chmod 600"):
        signing.resolve()
    with pytest.raises(PermissionError, match="chmod 600"):
        rt.Trainer(workloads.metrics_fn, run_config=rt.RunConfig(progress="off")).fit()
    path.chmod(0o600)
    monkeypatch.setenv(signing.ENV_SIGNING_KEY, "from the environment, 16+ bytes")
    assert signing.resolve().key == b"from the environment, 16+ bytes"
    with pytest.raises(ValueError, match="at least 16 bytes"):
        rt.RunConfig(signing_key="short")


# ---------------------------------------------------------------- run directories


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust_run")
    result = rt.Trainer(
        workloads.metrics_fn,
        rt.ScalingConfig(num_workers=1),
        rt.RunConfig(name="signed", storage_path=str(tmp / "runs"), progress="off"),
        train_loop_config={"rounds": 2, "scores": [1.0, 2.0]},
    ).fit()
    return Path(result.path)


def _copy_run(finished_run: Path, tmp_path: Path) -> Path:
    run = tmp_path / "runs" / finished_run.name
    shutil.copytree(finished_run, run)
    return run


def test_a_tampered_payload_is_refused_by_restore_and_the_cli(finished_run, tmp_path):
    run = _copy_run(finished_run, tmp_path)
    assert rt.Trainer.restore(str(run)).train_fn.__name__ == "metrics_fn"  # control
    marker = tmp_path / "marker"
    (run / "payload.pkl").write_bytes(pickle.dumps(Poisoned(str(marker))))
    with pytest.raises(ValueError, match=r"payload.pkl is not signed"):
        rt.Trainer.restore(str(run))
    with pytest.raises(ValueError, match=r"config.json is not signed"):  # read first
        rt.Trainer.restore(str(run), signing_key="another key, 0123456789abcdef")
    cli = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", "--resume", str(run), "--progress", "off"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=str(tmp_path),
    )
    assert cli.returncode == 2, cli.stderr
    assert "payload.pkl is not signed" in cli.stderr and "--trust-unsigned" in cli.stderr
    assert not marker.exists()
    (run / "payload.pkl.sig").unlink()
    with pytest.raises(ValueError, match=r"payload.pkl has no signature"):
        rt.Trainer.restore(str(run))
    assert not marker.exists()
    # Control: the opt-in really does unpickle (and run) what is there.
    with pytest.raises(Exception):  # noqa: B017 - the evil payload is not a (fn, config) pair
        rt.Trainer.restore(str(run), trust_unsigned=True)
    assert marker.read_text() == "code ran"


def test_a_tampered_config_json_is_refused(finished_run, tmp_path):
    run = _copy_run(finished_run, tmp_path)
    config = json.loads((run / "config.json").read_text())
    config["script"] = str(tmp_path / "evil.py")
    (run / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config.json is not signed"):
        rt.Trainer.restore(str(run))


def test_a_tampered_sweep_pickle_is_refused(tmp_path):
    from ringtrain import tune
    from ringtrain.rundir import RunDirectory

    tuner = tune.Tuner(
        workloads.metrics_fn,
        param_space={"rounds": 1},
        tune_config=tune.TuneConfig(metric="score", mode="max"),
        run_config=rt.RunConfig(storage_path=str(tmp_path), signing_key="k" * 32),
    )
    sweep = RunDirectory(str(tmp_path), "sweep")
    sweep.create()
    tuner._write_sweep_files(sweep, "sweep", {"CPU": 1.0})
    assert b"k" * 32 not in (tmp_path / "sweep" / "tuner.pkl").read_bytes()  # no key stored
    restored = tune.Tuner.restore(str(tmp_path / "sweep"), signing_key="k" * 32)
    assert restored.run_config.signing_key == "k" * 32
    with pytest.raises(ValueError, match=r"tuner.pkl is not signed"):
        tune.Tuner.restore(str(tmp_path / "sweep"))  # the default key is another
    marker = tmp_path / "marker"
    (tmp_path / "sweep" / "tuner.pkl").write_bytes(pickle.dumps(Poisoned(str(marker))))
    with pytest.raises(ValueError, match=r"tuner.pkl is not signed"):
        tune.Tuner.restore(str(tmp_path / "sweep"), signing_key="k" * 32)
    assert not marker.exists()


# ---------------------------------------------------------------- verified, yet unloadable


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_unloadable_newest_checkpoint_is_set_aside_within_one_restart(tmp_path, world_size):
    """The newest checkpoint's train_state.pt holds a pickle weights_only refuses, and its
    manifest is re-signed with the right key (a bug, or a leaked key): the driver's checks pass,
    the workers cannot load it, and the run falls back to the checkpoint before it at once
    (max_failures=0) and finishes."""
    name = f"unloadable{world_size}"

    def fit(epochs):
        out = tmp_path / f"{name}_{epochs}.pt"
        cfg = {"epochs": epochs, "out": str(out), "kill": None, "kill_rank": 0}
        result = rt.Trainer(
            workloads.exact_fn,
            rt.ScalingConfig(num_workers=world_size),
            rt.RunConfig(name=name, storage_path=str(tmp_path / "runs"), progress="off"),
            train_loop_config=cfg,
        ).fit(raise_on_error=False)
        return result, out

    first, _ = fit(1)
    assert first.error is None
    run = Path(first.path)
    ckpts = sorted(p for p in run.iterdir() if storage.parse_round(p.name) is not None)
    newest = ckpts[-1]
    round_ = storage.parse_round(newest.name)
    marker = tmp_path / "marker"
    torch.save({"format": 1, "objects": {"model": Poisoned(str(marker))}}, newest / STATE_FILE)
    _resign(newest, name, round_)

    result, out = fit(2)
    assert result.error is None, result.error
    assert result.failures == []
    assert not marker.exists()
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    second = events[min(i for i, e in enumerate(events) if e["type"] == "run_end") + 1 :]
    starts = [e for e in second if e["type"] == "run_start"]
    assert len(starts) == 2  # one restart
    invalid = [e["reason"] for e in second if e["type"] == "checkpoint_invalid"]
    assert len(invalid) == 1 and "could not load checkpoint" in invalid[0]
    assert f"resuming from {ckpts[-2].name}" in invalid[0]
    assert (run / f"{newest.name}.corrupt").is_dir()
    final = torch.load(out, weights_only=True)
    assert final["step"] == json.loads((run / "result.json").read_text())["metrics"]["step"]
