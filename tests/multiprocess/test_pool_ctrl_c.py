"""A Ctrl-C while the driver waits for the zygote's answer to a spawn request leaves the pool
usable: the late answer (the pid of a worker nobody waits for) does not answer the next request.

Before, it did: with a pool that outlives one fit (``rt.warm_pool()``, a sweep's), the fit after
a Ctrl-C got the interrupted fit's worker as its rank 0, and every later spawn was one answer
behind. The interruption is raised by a hook at the precise moment (the first wait for the
answer), as Python's SIGINT handler would raise it there.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

from ringtrain.launch.pool import WorkerPool

pytestmark = pytest.mark.timeout(120)


class _CtrlCOnFirstWait(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.interrupt = True

    def wait(self, timeout: float | None = None) -> bool:
        if self.interrupt and threading.current_thread() is threading.main_thread():
            self.interrupt = False
            raise KeyboardInterrupt
        return super().wait(timeout)


def _spawn(pool: WorkerPool):
    # A worker without a driver to reach: it exits at once (what it does is not the point).
    return pool.spawn(
        [], dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)), capture_output=False
    )


def test_a_ctrl_c_while_spawning_does_not_shift_the_next_answers():
    with WorkerPool(preload=False) as pool:
        answers: list[int] = []  # the zygote's answers in order: one forked pid per request
        dispatch = pool._dispatch

        def seen(msg: dict[str, int]) -> None:
            if "pid" in msg:
                answers.append(int(msg["pid"]))
            dispatch(msg)

        pool._dispatch = seen  # type: ignore[method-assign]
        pool._reply_ready = _CtrlCOnFirstWait()
        with pytest.raises(KeyboardInterrupt):
            _spawn(pool)
        later = [_spawn(pool).pid for _ in range(2)]
        assert len(answers) == 3 and later == answers[1:], (
            f"answers {answers}: the spawns after the Ctrl-C got {later}"
        )
