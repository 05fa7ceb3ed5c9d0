"""A Ctrl-C that lands in an awkward place of the driver's run still ends it ``ABORTED``, with
the end recorded and the driver's signal handlers as they were.

The interruption is raised by a hook at the precise moment (a ``KeyboardInterrupt`` is what
Python's SIGINT handler raises on the main thread): while the preemption notice sources start
(``SignalNotice`` already holds SIGTERM and result.json already says ``RUNNING``), in the first
poll of the group (the common case), and a second Ctrl-C while the group is being stopped after
the first. Before, the first left SIGTERM/SIGUSR1 caught by a dead run's handler and result.json
saying ``RUNNING`` with no ``run_end``; the third left result.json saying ``RUNNING``.

And a Ctrl-C during code that swallows every error (``import torch``'s NumPy initialisation, the
driver's first import of torch when it starts workers) is held and raised after it
(:func:`ringtrain.monitor.interrupts.held_ctrl_c`).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from fakes import FakeGroup, FakeLauncher
from fakes import controller_events as _events
from fakes import make_controller as _controller
from ringtrain.launch import local
from ringtrain.launch.base import WorkerSpec
from ringtrain.monitor.interrupts import held_ctrl_c
from ringtrain.preemption import SignalNotice

pytestmark = pytest.mark.timeout(60)


def _ctrl_c(*args: object) -> list:
    raise KeyboardInterrupt


class CtrlCOnStart:
    """A notice source whose start is interrupted by Ctrl-C."""

    def start(self, notify: object) -> None:
        _ctrl_c()

    def stop(self) -> None:
        pass


class CtrlCOnStop(FakeGroup):
    """A group whose stop is interrupted by a second Ctrl-C."""

    def stop(self, grace_s: float = 5.0) -> None:
        super().stop(grace_s)
        _ctrl_c()


@pytest.mark.parametrize("window", ["notice-sources-start", "first-poll", "second-during-stop"])
def test_a_ctrl_c_anywhere_ends_the_run_aborted_and_recorded(tmp_path, window):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    group_type = CtrlCOnStop if window == "second-during-stop" else FakeGroup
    group = group_type(2, [_ctrl_c] if window != "notice-sources-start" else [])
    sources = [SignalNotice()]
    if window == "notice-sources-start":
        sources.append(CtrlCOnStart())
    ctl = _controller(tmp_path, FakeLauncher([group]), notice_sources=sources)
    try:
        with pytest.raises(KeyboardInterrupt):
            ctl.run()
        now = {s: signal.getsignal(s) for s in handlers}
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    assert now == handlers, f"{window}: the run's notice handlers were left installed"
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["status"] == "ABORTED", window
    events = _events(tmp_path)
    assert [e["status"] for e in events if e["type"] == "run_end"] == ["ABORTED"], window
    aborted = [e for e in events if e["type"] == "transition" and e["to"] == "ABORTED"]
    assert len(aborted) == 1 and "KeyboardInterrupt" in aborted[0]["reason"], events
    if window != "notice-sources-start":
        assert group.stopped and ctl.group is None


def _swallowing_ctrl_c() -> None:
    """A Ctrl-C during code that swallows any error, as torch's NumPy initialisation does."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(50):  # Python runs the handler between these
            time.sleep(0.01)
    except BaseException:
        pass


def test_a_ctrl_c_held_across_code_that_swallows_it_is_raised_after():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a terminal's
    try:
        _swallowing_ctrl_c()  # unheld: lost, which is what held_ctrl_c is for
        with pytest.raises(KeyboardInterrupt), held_ctrl_c():
            _swallowing_ctrl_c()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with held_ctrl_c():  # no Ctrl-C: nothing raised
            pass
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        seen: list[int] = []
        signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
        with held_ctrl_c():  # the program's own handler is left alone
            _swallowing_ctrl_c()
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_while_the_group_imports_torch_leaves_no_listener(tmp_path, monkeypatch):
    """The Ctrl-C that :func:`held_ctrl_c` raises after the driver's first torch import (in
    ``start_store``) closes the channel listener opened just before (its socket and thread)."""
    monkeypatch.setattr(local, "start_store", _ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        local.LocalWorkerGroup(WorkerSpec(world_size=2, run_dir=str(tmp_path)))
    accepting = [t for t in threading.enumerate() if t.name == "ringtrain-accept" and t.is_alive()]
    assert not accepting, "the channel listener of the interrupted group was left open"
