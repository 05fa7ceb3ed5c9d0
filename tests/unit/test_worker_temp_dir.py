"""A worker's multiprocessing temp dir (``ringtrain.launch.reaper``): named by its pid, installed
as the process's ``multiprocessing.util.get_temp_dir()``, and removed by whoever reaps the worker,
only its own and only real directories of this user. The whole path on real workers, SIGKILL
included: tests/multiprocess/test_process_hygiene.py."""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os

import pytest

from ringtrain.launch.reaper import (
    remove_worker_temp_dir,
    use_worker_temp_dir,
    worker_temp_prefix,
)


@pytest.fixture
def temp_base(tmp_path, monkeypatch):
    """``tempfile.gettempdir()`` is ``tmp_path/base`` for the test."""
    import tempfile

    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(base))
    return base


def test_the_worker_dir_is_this_processes_multiprocessing_temp_dir(temp_base, monkeypatch):
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    monkeypatch.setitem(config, "tempdir", None)  # put back whatever pytest's process had
    path = use_worker_temp_dir()
    assert os.path.dirname(path) == str(temp_base)
    assert os.path.basename(path).startswith(worker_temp_prefix(os.getpid()))
    assert multiprocessing.util.get_temp_dir() == path  # what a DataLoader worker's socket uses
    assert os.stat(path).st_mode & 0o777 == 0o700
    remove_worker_temp_dir(os.getpid())
    assert not os.path.exists(path)


def test_only_that_workers_directories_are_removed(temp_base, tmp_path):
    mine = temp_base / f"{worker_temp_prefix(4242)}abc"
    (mine / "sub").mkdir(parents=True)
    (mine / "listener-x").write_text("")
    other_pid = temp_base / f"{worker_temp_prefix(42420)}abc"  # 4242 is a prefix of 42420
    other_pid.mkdir()
    plain = temp_base / "pymp-abcdefgh"  # an ordinary multiprocessing dir of another process
    plain.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("")
    link = temp_base / f"{worker_temp_prefix(4242)}link"  # a planted symbolic link: not followed
    link.symlink_to(target)
    remove_worker_temp_dir(4242)
    assert not mine.exists()
    assert other_pid.exists() and plain.exists()
    assert link.is_symlink() and (target / "keep").exists()


def test_the_workers_own_tmpdir_is_searched_too(temp_base, tmp_path):
    worker_tmp = tmp_path / "worker-tmp"
    worker_tmp.mkdir()
    theirs = worker_tmp / f"{worker_temp_prefix(77)}abc"
    theirs.mkdir()
    remove_worker_temp_dir(77)  # the reaper's own temp dir only
    assert theirs.exists()
    remove_worker_temp_dir(77, {"TMPDIR": str(worker_tmp)})
    assert not theirs.exists()


def test_a_missing_directory_is_not_an_error(temp_base):
    remove_worker_temp_dir(99999, {"TMPDIR": str(temp_base / "gone")})


def test_no_writable_temp_dir_leaves_multiprocessing_as_it_was(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))
    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    monkeypatch.setitem(config, "tempdir", None)
    assert use_worker_temp_dir() is None  # the worker starts all the same
    assert config["tempdir"] is None
