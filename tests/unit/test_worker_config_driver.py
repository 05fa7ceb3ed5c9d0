"""``WorkerConfig.driver_pid`` (issue 19): the local launcher puts the driver's pid into the typed
config (None on Ray, whose driver may be on another machine), it is validated, and
:mod:`ringtrain.worker.preempt` uses it (and what the zygote says) instead of reading ``/proc``."""

from __future__ import annotations

import os

import pytest

import ringtrain as rt
from ringtrain.wire.worker_config import WorkerConfig, build_worker_config
from ringtrain.worker import preempt as preempt_worker


def test_driver_pid_is_set_by_the_local_launcher_only_and_validated() -> None:
    # build_worker_config does not know where the workers run: the local launcher fills it in
    # (tests/multiprocess/test_pool.py checks what the workers receive); Ray leaves it None.
    config = build_worker_config(rt.ScalingConfig(num_workers=2), rt.RunConfig(name="x"))
    assert config.driver_pid is None
    with pytest.raises(ValueError, match=r"WorkerConfig\.driver_pid"):
        WorkerConfig(driver_pid=0)


def test_preempt_worker_uses_the_pids_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(preempt_worker, "_driver_pid", None)
    monkeypatch.setattr(preempt_worker, "_launched_by", frozenset())
    monkeypatch.setattr(preempt_worker, "_stoppers", set())
    assert preempt_worker.driver_pid() == os.getppid()  # a cold worker: its parent
    # Forked by a zygote (its parent) for a driver (the zygote's parent): no /proc look-up.
    preempt_worker.set_launchers(frozenset({os.getppid(), 4242}))
    assert preempt_worker.driver_pid() == 4242
    preempt_worker.set_driver_pid(None)  # Ray: nothing to add
    assert preempt_worker._stoppers == set() and preempt_worker.driver_pid() == 4242
    preempt_worker.set_driver_pid(777)  # Start arrived: the typed config wins
    assert preempt_worker.driver_pid() == 777 and 777 in preempt_worker._stoppers
