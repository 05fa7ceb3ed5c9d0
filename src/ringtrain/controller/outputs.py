"""The controller's outputs: the :class:`~ringtrain.result.Result` and ``result.json`` (a
:class:`~ringtrain.rundir.schema.ResultRecord`)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ringtrain.result import Result
from ringtrain.rundir.schema import ResultRecord

if TYPE_CHECKING:
    from ringtrain.controller.controller import Controller


def build_result(ctl: Controller) -> Result:
    """What ``Trainer.fit`` returns, from the controller's state now."""
    best = [(t.checkpoint, t.metrics) for t in ctl.checkpoints.ranked()]
    latest = ctl.checkpoints.latest
    return Result(
        metrics=dict(ctl.metrics_per_rank.get(0, {})),
        metrics_per_rank={r: dict(m) for r, m in sorted(ctl.metrics_per_rank.items())},
        checkpoint=latest.checkpoint if latest else None,
        best_checkpoints=best,
        path=ctl.run_dir.uri,
        error=ctl.error,
        failures=list(ctl.failures),
        follow_on_failures=list(ctl.follow_on_failures),
        metrics_history=[ctl.history[r] for r in sorted(ctl.history)],
        status=ctl.state.value if ctl.state.terminal else "RUNNING",
        preemptions=len(ctl.preemption.handled),
    )


def write_result(ctl: Controller) -> None:
    """Write ``result.json`` (status ``RUNNING`` until the state is terminal)."""
    result = build_result(ctl)
    now = time.time()
    finished = ctl.state.terminal
    ctl.run_dir.write_result(
        ResultRecord(
            status=ctl.state.value if finished else "RUNNING",
            name=ctl.run_dir.name,
            path=ctl.run_dir.uri,
            driver_pid=os.getpid(),
            start_time=ctl.start_time,
            end_time=now if finished else None,
            duration_s=now - ctl.start_time,
            world_size=ctl.world_size,
            rounds=ctl.next_round,
            metrics=result.metrics,
            metrics_per_rank={str(r): m for r, m in result.metrics_per_rank.items()},
            checkpoint=result.checkpoint.uri if result.checkpoint else None,
            best_checkpoints=[{"path": c.uri, "metrics": m} for c, m in result.best_checkpoints],
            error=str(ctl.error) if ctl.error else _aborted_because(ctl.current),
            failures=[f.to_dict() for f in ctl.failures],
            follow_on_failures=[f.to_dict() for f in ctl.follow_on_failures],
            preemptions=result.preemptions,
        )
    )


_ABORT_REASONS = {
    "KeyboardInterrupt": "interrupted by Ctrl-C",
    "DriverTerminated": "the driver received SIGTERM",
}


def _aborted_because(state: Any) -> str | None:
    """Why an ``ABORTED`` run ended, for ``ringtrain ls`` (which otherwise says "driver gone",
    the reason of a run whose driver died without a word)."""
    reason = getattr(state, "reason", None) if state.kind.value == "ABORTED" else None
    if not reason:
        return None
    return _ABORT_REASONS.get(reason, f"the driver raised {reason}")


def call_callbacks(callbacks: Sequence[Any], hook: str, *args: Any) -> None:
    """Call ``hook(*args)`` on every callback that defines it; one that raises is logged and
    the run continues."""
    for cb in callbacks:
        fn = getattr(cb, hook, None)
        if fn is None:
            continue
        try:
            fn(*args)
        except Exception:
            logging.getLogger("ringtrain").exception(
                "callback %s.%s raised; the run continues", type(cb).__name__, hook
            )
