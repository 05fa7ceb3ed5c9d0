"""Retention and the manifest rule, on a real local directory and on fsspec's memory://."""

import json
import os
import uuid

import fsspec
import pytest

from ringtrain.checkpoint import signing, storage
from ringtrain.checkpoint.manager import CheckpointManager
from ringtrain.config import CheckpointConfig


def _stage(fs, run_path, round_, content: bytes):
    src = f"/tmp/rt_src_{uuid.uuid4().hex}"
    os.makedirs(src)
    with open(os.path.join(src, "model.pt"), "wb") as f:
        f.write(content)
    return storage.upload_directory(
        src, fs, storage.join(fs, run_path, storage.staging_dirname(round_))
    )


@pytest.fixture(params=["local", "memory"])
def run_location(request, tmp_path):
    if request.param == "local":
        fs, path = fsspec.core.url_to_fs(str(tmp_path / "run"))
    else:
        fs, path = fsspec.core.url_to_fs(f"memory://rt-{uuid.uuid4().hex}/run")
    fs.makedirs(path, exist_ok=True)
    return fs, path


def _names(fs, path):
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))


def test_upload_records_size_and_sha256(run_location):
    fs, path = run_location
    files = _stage(fs, path, 0, b"hello")
    assert files == {
        "model.pt": {
            "size": 5,
            "sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
        }
    }


def test_keeps_best_by_score_and_always_the_latest(run_location):
    fs, path = run_location
    mgr = CheckpointManager(
        fs,
        path,
        CheckpointConfig(
            num_to_keep=2, checkpoint_score_attribute="acc", checkpoint_score_order="max"
        ),
    )
    for round_, acc in enumerate([0.5, 0.9, 0.7, 0.8, 0.1]):
        mgr.publish(round_, _stage(fs, path, round_, b"x" * (round_ + 1)), {"acc": acc})
    # best two: rounds 1 (0.9) and 3 (0.8); round 4 survives as the latest.
    assert [t.round for t in mgr.checkpoints] == [1, 3, 4]
    assert [t.round for t in mgr.ranked()] == [1, 3, 4]
    assert _names(fs, path) == ["checkpoint_000001", "checkpoint_000003", "checkpoint_000004"]
    assert {p.rsplit("/", 1)[-1] for p, _ in mgr.deleted} == {
        "checkpoint_000000",
        "checkpoint_000002",
    }


def test_min_order_and_missing_score_ranks_last(run_location):
    fs, path = run_location
    mgr = CheckpointManager(
        fs,
        path,
        CheckpointConfig(
            num_to_keep=1, checkpoint_score_attribute="loss", checkpoint_score_order="min"
        ),
    )
    mgr.publish(0, _stage(fs, path, 0, b"a"), {"loss": 0.3})
    mgr.publish(1, _stage(fs, path, 1, b"b"), {"other": 1.0})
    mgr.publish(2, _stage(fs, path, 2, b"c"), {"loss": 0.2})
    mgr.publish(3, _stage(fs, path, 3, b"d"), {"loss": 0.9})
    assert [t.round for t in mgr.checkpoints] == [2, 3]


def test_without_score_keeps_most_recent(run_location):
    fs, path = run_location
    mgr = CheckpointManager(fs, path, CheckpointConfig(num_to_keep=2))
    for r in range(4):
        mgr.publish(r, _stage(fs, path, r, b"z"), {})
    assert [t.round for t in mgr.checkpoints] == [2, 3]


def test_manifest_lists_every_file_and_publication_renames(run_location):
    fs, path = run_location
    files = _stage(fs, path, 7, b"weights")
    published = storage.publish(fs, path, 7, files, {"loss": 1.0})
    assert published.endswith("checkpoint_000007")
    assert _names(fs, path) == ["checkpoint_000007"]
    manifest = storage.read_manifest(fs, published, verify_checksums=True)
    assert manifest["round"] == 7 and manifest["files"]["model.pt"]["size"] == 7


def test_scan_skips_invalid_and_removes_staging(run_location):
    fs, path = run_location
    mgr = CheckpointManager(fs, path, CheckpointConfig())
    mgr.publish(0, _stage(fs, path, 0, b"good"), {"a": 1})
    mgr.publish(1, _stage(fs, path, 1, b"truncated"), {"a": 2})
    _stage(fs, path, 2, b"never completed")  # staging dir left by a crash
    # Truncate round 1's file: its manifest no longer matches.
    with fs.open(storage.join(fs, path, "checkpoint_000001", "model.pt"), "wb") as f:
        f.write(b"tr")
    fresh = CheckpointManager(fs, path, CheckpointConfig())
    notes = fresh.scan()
    assert [t.round for t in fresh.checkpoints] == [0]
    assert fresh.next_round == 1
    # the invalid checkpoint is set aside (kept for inspection, never loaded) and described
    assert [n for n in fresh.notes if "checkpoint_000001" in n and "bytes" in n]
    assert not fs.exists(storage.join(fs, path, "checkpoint_000001"))
    assert fs.exists(storage.join(fs, path, "checkpoint_000001.corrupt"))
    assert any("checkpoint_000002.tmp" in n for n in notes)
    assert not fs.exists(storage.join(fs, path, "checkpoint_000002.tmp"))


def test_directory_without_manifest_is_not_a_checkpoint(run_location):
    fs, path = run_location
    fs.makedirs(storage.join(fs, path, "checkpoint_000004"), exist_ok=True)
    with fs.open(storage.join(fs, path, "checkpoint_000004", "model.pt"), "wb") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match=r"no manifest\.json"):
        storage.read_manifest(fs, storage.join(fs, path, "checkpoint_000004"))
    with fs.open(storage.join(fs, path, "checkpoint_000004", "manifest.json"), "w") as f:
        f.write(json.dumps({"files": {"model.pt": {"size": 1, "sha256": "0" * 64}}}))
    with pytest.raises(ValueError, match="no signature"):  # unsigned: refused before any file
        storage.read_manifest(fs, storage.join(fs, path, "checkpoint_000004"))
    storage.write_manifest(
        fs,
        storage.join(fs, path, "checkpoint_000004"),
        {"model.pt": {"size": 1, "sha256": "0" * 64}},
        signing.resolve(),
        run="run",
        round_=4,
    )
    with pytest.raises(ValueError, match="SHA-256"):
        storage.read_manifest(
            fs, storage.join(fs, path, "checkpoint_000004"), verify_checksums=True
        )
