"""A checkpoint that fails verification when a run resumes is never set aside in silence.

One run of ``workloads.exact_fn`` on 2 real workers leaves several checkpoints; then, as an
attacker or a broken disk would: (1) the newest one's train state has a byte flipped and its
manifest is re-hashed (sizes and SHA-256 fixed, the HMAC not: no key): the resumed run falls back
to the newest checkpoint that verifies, one ``checkpoint_invalid`` event names the set-aside
checkpoint, its new name, the reason and the checkpoint resumed from, and the driver prints it
once; (2) every checkpoint is damaged: the run refuses to start from step 0 and renames nothing;
(3) with ``CheckpointConfig.from_scratch_if_invalid=True`` it sets them all aside and starts from
step 0, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import workloads
from ringtrain.checkpoint import storage
from ringtrain.checkpoint.manager import NoValidCheckpointError
from support import read_events, run_job

pytestmark = pytest.mark.timeout(240)

STATE_FILE = "train_state.pt"
LOCAL = LocalFileSystem()


def _checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in run.iterdir() if storage.parse_round(p.name) is not None)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _tamper_and_rehash(ckpt: Path) -> None:
    """Flip a byte of the train state and fix its size and SHA-256 in the manifest (what
    anyone who can write the storage can do; only the HMAC, under a key not in the storage,
    tells)."""
    _flip_byte(ckpt / STATE_FILE)
    manifest = json.loads((ckpt / storage.MANIFEST).read_text())
    manifest["files"][STATE_FILE] = storage.file_digest(LOCAL, str(ckpt / STATE_FILE))
    (ckpt / storage.MANIFEST).write_text(json.dumps(manifest))


def _fit(tmp_path: Path, **job):
    out = tmp_path / "final.pt"
    cfg = {"epochs": 1, "out": str(out), "kill": None, "kill_rank": 0}
    return run_job(
        workloads.exact_fn,
        2,
        storage_path=tmp_path / "runs",
        name="run",
        train_loop_config=cfg,
        progress="plain",
        **job,
    )


def _invalid_events_of_last_run(run: Path) -> list[dict]:
    events = read_events(run)
    ends = [i for i, e in enumerate(events) if e["type"] == "run_end"]
    last = events[ends[-2] + 1 :] if len(ends) > 1 else events
    return [e for e in last if e["type"] == "checkpoint_invalid"]


def test_a_tampered_checkpoint_is_set_aside_loudly_and_never_for_step_0(tmp_path, capfd):
    first = _fit(tmp_path)
    assert first.error is None and first.failures == []
    run = tmp_path / "runs" / "run"
    ckpts = _checkpoints(run)
    assert len(ckpts) >= 3, [p.name for p in ckpts]
    newest, older = ckpts[-1], ckpts[-2]
    capfd.readouterr()

    # (1) The newest is tampered with, its manifest re-hashed: the one before is resumed from.
    _tamper_and_rehash(newest)
    second = _fit(tmp_path)
    assert second.error is None and second.failures == []
    (event,) = _invalid_events_of_last_run(run)
    assert event["checkpoint"] == newest.name
    assert event["set_aside_as"] == f"{newest.name}.corrupt"
    assert event["resumed_from"] == older.name
    assert "not signed" in event["reason"] or "signature" in event["reason"], event
    assert (run / f"{newest.name}.corrupt").is_dir()
    resumes = read_events(run, "resume")
    assert resumes[-1]["checkpoint"].rstrip("/").endswith(older.name)
    said = capfd.readouterr()
    printed = (said.out + said.err).count(f"checkpoint {newest.name} is invalid")
    assert printed == 1, said  # once on the driver
    assert f"resuming from {older.name}" in said.out + said.err

    # (2) Every checkpoint damaged: refused, nothing renamed, nothing started.
    ckpts = _checkpoints(run)
    for ckpt in ckpts:
        _flip_byte(ckpt / STATE_FILE)
    starts = len(read_events(run, "run_start"))
    with pytest.raises(NoValidCheckpointError) as refused:
        _fit(tmp_path)
    message = str(refused.value)
    assert all(c.name in message for c in ckpts), message
    assert "from_scratch_if_invalid=True" in message and "--from-scratch-if-invalid" in message
    assert _checkpoints(run) == ckpts
    assert len(read_events(run, "run_start")) == starts

    # (3) Asked to: every one set aside, the run starts from step 0 and finishes.
    third = _fit(tmp_path, from_scratch_if_invalid=True)
    assert third.error is None and third.failures == []
    events = _invalid_events_of_last_run(run)
    assert sorted(e["checkpoint"] for e in events) == [c.name for c in ckpts]
    assert all(e["resumed_from"] is None for e in events), events
    assert all("starting from scratch" in e["reason"] for e in events), events
    assert all((run / f"{c.name}.corrupt").is_dir() for c in ckpts)
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    assert final["step"] == third.metrics["step"]
