"""A worker notice that reaches the driver in one poll with the workers' last events.

Workers that got SIGTERM themselves tell the driver (``WorkerNotice``), agree a stop step, save
and exit on their own. A loaded driver can take all of it in one poll: the notice, every
``PreemptSaved``, every exit. The run must end PREEMPTED (its state saved mid-training), not
FINISHED (the CI flake of ``test_a_notice_loses_no_step[2-workers-SIGTERM]``: the notice was
queued, the group seen all exited, the run declared finished at step 8 of 20).
"""

from __future__ import annotations

import pytest

from fakes import FakeGroup, FakeLauncher
from fakes import controller_events as _events
from fakes import make_controller as _controller
from ringtrain.controller.states import RunState
from ringtrain.wire.channel import Done, Exited, PreemptSaved, WorkerNotice

pytestmark = pytest.mark.timeout(60)


class SendingGroup(FakeGroup):
    """A FakeGroup that takes driver -> worker messages (the workers are gone: nobody reads)."""

    def send(self, rank, message):
        pass


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_notice_polled_with_the_last_exits_ends_preempted(tmp_path, world_size):
    ranks = range(world_size)
    last_poll = [
        WorkerNotice(0, 1.0, "SIGTERM to rank 0 from pid 9"),
        *[PreemptSaved(r, 1.1, 8, None) for r in ranks],
        *[Done(r, 1.2, 0) for r in ranks],
        *[Exited(r, 1.3, 0) for r in ranks],
    ]
    group = SendingGroup(world_size, [last_poll])
    ctl = _controller(tmp_path, FakeLauncher([group]), world_size=world_size)
    ctl.step()  # Starting -> Running
    t = ctl.step()
    assert (t.from_, t.to) == (RunState.RUNNING, RunState.PREEMPTING), t.reason
    t = ctl.step(ctl._due_notice())
    assert (t.from_, t.to) == (RunState.PREEMPTING, RunState.PREEMPTED), t.reason
    assert t.reason == "every worker saved its state after step 8"
    result = ctl.result()
    assert (result.status, result.preemptions, result.failures) == ("PREEMPTED", 1, [])
    (notice,) = [e for e in _events(tmp_path) if e["type"] == "preemption"]
    assert notice["source"] == "worker-signal"


def test_workers_that_finish_with_a_notice_but_no_save_still_finish(tmp_path):
    """A notice polled with the exits of workers that finished (none saved): FINISHED."""
    last_poll = [WorkerNotice(1, 1.0, "SIGTERM to rank 1"), *[Done(r, 1.2, 0) for r in (0, 1)]]
    group = SendingGroup(2, [[*last_poll, Exited(0, 1.3, 0), Exited(1, 1.3, 0)]])
    ctl = _controller(tmp_path, FakeLauncher([group]))
    ctl.step()
    t = ctl.step()
    assert t.to is RunState.FINISHED and ctl.result().preemptions == 0
