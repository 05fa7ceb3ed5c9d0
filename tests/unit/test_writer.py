"""The checkpoint writer: retry with backoff, checksummed writes, the background thread."""

from __future__ import annotations

import hashlib
import threading
import time

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import ringtrain as rt
from ringtrain.checkpoint import signing, storage
from ringtrain.checkpoint import writer as writer_mod
from ringtrain.checkpoint.writer import AsyncCheckpointWriter, retry, write_files
from ringtrain.worker.state import STATE_FILE, TrainState, rank_file


@pytest.fixture
def sleeps(monkeypatch):
    """Record retry() back-off delays instead of sleeping."""
    delays: list[float] = []
    monkeypatch.setattr(writer_mod.time, "sleep", delays.append)
    return delays


class _Flaky:
    """Fails ``failures`` times with the given errors, then returns ``"ok"``."""

    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


# ---------------------------------------------------------------- retry


def test_retry_recovers_from_transient_errors(sleeps):
    fn = _Flaky(OSError("EIO"), ConnectionError("reset"), TimeoutError("slow"))
    assert retry(fn, what="x", attempts=5, initial_s=0.2, max_s=5.0) == "ok"
    assert fn.calls == 4
    assert len(sleeps) == 3


def test_retry_backoff_grows_and_is_capped(sleeps, monkeypatch):
    monkeypatch.setattr(writer_mod._jitter, "uniform", lambda a, b: 1.0)  # no jitter
    fn = _Flaky(*[OSError("EIO")] * 6)
    assert retry(fn, what="x", attempts=7, initial_s=0.2, max_s=1.0) == "ok"
    assert sleeps == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0, 1.0])


def test_retry_jitter_stays_within_a_quarter(sleeps):
    fn = _Flaky(*[OSError("EIO")] * 5)
    retry(fn, what="x", attempts=6, initial_s=0.1, max_s=0.5)
    nominal = [0.1, 0.2, 0.4, 0.5, 0.5]
    assert len(sleeps) == len(nominal)
    for got, want in zip(sleeps, nominal, strict=True):
        assert 0.75 * want <= got <= 1.25 * want


def test_retry_jitter_never_draws_from_the_global_random_stream(sleeps):
    """The global `random` state is part of the user's training state (TrainState saves it): a
    retry that drew from it would make a resumed run diverge from one without retries."""
    import random

    random.seed(5)
    before = random.getstate()
    retry(_Flaky(OSError("EIO"), OSError("EIO")), what="x", attempts=3, initial_s=0.01)
    assert random.getstate() == before


def test_retry_raises_the_last_error_after_all_attempts(sleeps):
    errors = [ConnectionError(f"try {i}") for i in range(4)]
    fn = _Flaky(*errors)
    with pytest.raises(ConnectionError, match="try 3"):
        retry(fn, what="x", attempts=4, initial_s=0.01)
    assert fn.calls == 4
    assert len(sleeps) == 3  # no sleep after the last attempt


@pytest.mark.parametrize(
    "error", [FileNotFoundError("no bucket"), PermissionError("denied"), TypeError("bug")]
)
def test_retry_does_not_retry_permanent_errors(sleeps, error):
    fn = _Flaky(error, OSError("never reached"))
    with pytest.raises(type(error)):
        retry(fn, what="x", attempts=5)
    assert fn.calls == 1
    assert sleeps == []


# ---------------------------------------------------------------- write_files


def _payloads() -> dict[str, bytes]:
    return {"a.bin": b"hello world", "b.bin": bytes(range(256)) * 4099, "empty.bin": b""}


def _byte_writers(payloads: dict[str, bytes]):
    def make(data: bytes):
        def write(f):
            # Several writes, of several buffer types, as a serialiser would issue them.
            half = len(data) // 2
            f.write(data[:half])
            f.write(bytearray(data[half : half + 3]))
            f.write(memoryview(data)[half + 3 :])

        return write

    return {name: make(data) for name, data in payloads.items()}


def _check_files(dest, files, payloads):
    assert set(files) == set(payloads)
    for name, data in payloads.items():
        on_disk = (dest / name).read_bytes()
        assert on_disk == data
        assert files[name] == {"size": len(data), "sha256": hashlib.sha256(on_disk).hexdigest()}


def test_write_files_records_size_and_sha256(tmp_path):
    payloads = _payloads()
    dest = tmp_path / "run" / "checkpoint_000000.tmp"  # created by write_files
    files = write_files(fsspec.filesystem("file"), str(dest), _byte_writers(payloads))
    _check_files(dest, files, payloads)


class _FlakyOpenFS(LocalFileSystem):
    """The local disk, except that the first ``fail_opens`` opens for writing fail."""

    cachable = False  # a fresh instance (and counter) per test

    def __init__(self, fail_opens: int = 2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.fail_opens = fail_opens
        self.write_opens = 0

    def _open(self, path, mode="rb", *args, **kwargs):
        if "w" in mode:
            self.write_opens += 1
            if self.write_opens <= self.fail_opens:
                raise OSError(f"transient failure #{self.write_opens} opening {path}")
        return super()._open(path, mode, *args, **kwargs)


def test_write_files_retries_when_the_storage_fails(tmp_path, sleeps):
    payloads = _payloads()
    fs = _FlakyOpenFS(fail_opens=2)
    dest = tmp_path / "staging"
    files = write_files(fs, str(dest), _byte_writers(payloads))
    _check_files(dest, files, payloads)
    assert len(sleeps) == 2  # two failed attempts, then success
    assert fs.write_opens == 2 + len(payloads)


def test_write_files_gives_up_after_its_attempts(tmp_path, sleeps):
    fs = _FlakyOpenFS(fail_opens=100)
    with pytest.raises(OSError, match="transient failure #3"):
        write_files(fs, str(tmp_path / "staging"), _byte_writers(_payloads()), attempts=3)
    assert len(sleeps) == 2


def test_write_files_rehashes_after_a_failure_mid_file(tmp_path, sleeps):
    data = b"0123456789" * 1000
    calls = []

    def write(f):
        calls.append(1)
        f.write(data[:4000])
        if len(calls) == 1:
            raise ConnectionError("connection dropped mid-upload")
        f.write(data[4000:])

    files = write_files(fsspec.filesystem("file"), str(tmp_path / "s"), {"x.bin": write})
    _check_files(tmp_path / "s", files, {"x.bin": data})
    assert len(calls) == 2 and len(sleeps) == 1


def test_write_files_of_a_train_state_restores(tmp_path):
    """The real writers (torch.save into the hashing wrapper) produce loadable files."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = TrainState(model, opt, step=7, note="x")
    dest = tmp_path / "ckpt"
    files = write_files(fsspec.filesystem("file"), str(dest), state._checkpoint_writers(True))
    assert set(files) == {STATE_FILE, rank_file(0)}
    for name, info in files.items():
        data = (dest / name).read_bytes()
        assert info == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    fs = fsspec.filesystem("file")
    storage.write_manifest(fs, str(dest), files, signing.resolve(), run="t", round_=0)

    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    restored = TrainState(fresh, fresh_opt, note=None)
    assert restored.restore(rt.Checkpoint(str(dest)))
    assert restored.step == 7 and restored["note"] == "x"
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(
        fresh_opt.state_dict()["state"][0]["momentum_buffer"],
        opt.state_dict()["state"][0]["momentum_buffer"],
    )


# ---------------------------------------------------------------- AsyncCheckpointWriter


def test_async_writer_runs_one_job_at_a_time_in_order():
    gate = threading.Event()
    log: list[str] = []

    def first():
        log.append("first start")
        gate.wait(5)
        log.append("first end")

    def second():
        log.append("second start")
        log.append("second end")

    writer = AsyncCheckpointWriter()
    assert writer.submit(first) == pytest.approx(0.0, abs=0.05)
    assert writer.busy

    submitted = threading.Event()
    waited: list[float] = []

    def submit_second():
        waited.append(writer.submit(second))
        submitted.set()

    t = threading.Thread(target=submit_second)
    t.start()
    assert not submitted.wait(0.2)  # blocked behind the first job
    assert log == ["first start"]
    gate.set()
    assert submitted.wait(5)
    t.join(5)
    writer.wait()
    assert log == ["first start", "first end", "second start", "second end"]
    assert waited[0] >= 0.15
    assert not writer.busy


def test_async_writer_wait_returns_after_the_job_finished():
    done = threading.Event()

    def job():
        time.sleep(0.1)
        done.set()

    writer = AsyncCheckpointWriter()
    assert writer.wait() == 0.0  # nothing in flight
    writer.submit(job)
    assert not done.is_set()
    waited = writer.wait()
    assert done.is_set()
    assert waited >= 0.05
    assert not writer.busy
    assert writer.wait() == 0.0
