"""What the controller's deciders ask of it, as values.

The deciders of :mod:`ringtrain.controller` (:mod:`~ringtrain.controller.events`,
:mod:`~ringtrain.controller.elastic`, :mod:`~ringtrain.controller.leaving`,
:mod:`~ringtrain.controller.preempting`, :mod:`~ringtrain.controller.rounds`) never hold the
:class:`~ringtrain.controller.controller.Controller`: they take the facts they need (a state, an
event, a generation's book-keeping) and return a decision, a next state, and the effects below.
Only the controller executes them (``Controller.apply``), so it alone owns the run's mutable
state (its failures, metrics, rounds, the worker group) and a unit test of a decider compares
values. Each effect is a small frozen dataclass; their order in a list is the order they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Write:
    """Write ``record`` (a :mod:`ringtrain.rundir.schema` event) to ``events.jsonl``."""

    record: Any


@dataclass(frozen=True)
class Say:
    """Log ``text`` (as a warning when ``warn``; ``log_prefix`` before it in the log only) and
    show it on the live display."""

    text: str
    warn: bool = False
    log_prefix: str = ""


@dataclass(frozen=True)
class Show:
    """Call the live display's ``method(*args)`` (``worker_state``, ``report``,
    ``round_complete``, ``timing``, ``straggler``: :class:`~ringtrain.monitor.progress.
    ProgressReporter`)."""

    method: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Notify:
    """Call the driver-side callbacks' ``hook(*args)`` (:data:`ringtrain.config.CALLBACK_HOOKS`)."""

    hook: str
    args: tuple[Any, ...] = ()


@dataclass(frozen=True)
class FenceOff:
    """Declare worker ``worker`` (``"HOST:PID"``, ``None``: it never said Hello) of attempt
    ``attempt`` lost in the run's fence (:mod:`ringtrain.checkpoint.fence`), before anything
    else: it may still run, cut off, and must no longer write; and guard publication from now on
    (a write it began may still land)."""

    attempt: int
    worker: str | None


@dataclass(frozen=True)
class Publish:
    """Publish round ``round``'s checkpoint of the current generation once every write of it is
    in (:class:`~ringtrain.controller.rounds.Publisher`)."""

    round: int


@dataclass(frozen=True)
class DumpStacks:
    """Ask ``ranks`` of the worker group to print their stacks (before it is stopped)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Send:
    """Send ``message`` to each of ``ranks`` (a rank that cannot be reached is skipped: it is
    gone, and its failure follows)."""

    ranks: tuple[int, ...]
    message: Any


@dataclass(frozen=True)
class Discard:
    """Stop the workers of ``ranks`` that are not members of the group (joiners of a grow)."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class DiscardStaging:
    """Remove the staging directories of ``rounds`` (they can never be published)."""

    rounds: tuple[int, ...]


@dataclass(frozen=True)
class RankMetrics:
    """``rank`` reported ``metrics``: the latest of that rank (``Result.metrics_per_rank``)."""

    rank: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class RoundDone:
    """Every rank reported round ``round``; ``metrics`` are the round's (rank 0's)."""

    round: int
    metrics: dict[str, Any]


@dataclass(frozen=True)
class Timed:
    """``rank`` sent a timing ``window``: the straggler detector's input, and rank 0's DiLoCo
    outer-step count (``Result.outer_steps``)."""

    rank: int
    window: dict[str, Any]


@dataclass(frozen=True)
class GrowIdle:
    """The group is below ``max`` from now (monotonic ``since``): the next grow is timed from
    here; ``grew``: a grow just succeeded (its failure count starts again)."""

    since: float
    grew: bool = False


@dataclass(frozen=True)
class Verified:
    """Rank 0 passed the replica check the driver asked about (``event``: its
    :class:`~ringtrain.wire.channel.IntegrityVerified`): the re-run names the corrupted rank."""

    event: Any


@dataclass(frozen=True)
class Adopt:
    """A script run by ``ringtrain run`` sent its own ``RunConfig`` (``event``: its
    :class:`~ringtrain.wire.channel.RunSettings`): adopt what can still apply
    (:mod:`ringtrain.controller.script_settings`)."""

    event: Any


Effect = (
    Write
    | Say
    | Show
    | Notify
    | Publish
    | DumpStacks
    | FenceOff
    | Send
    | Discard
    | DiscardStaging
    | RankMetrics
    | RoundDone
    | Timed
    | GrowIdle
    | Verified
    | Adopt
)
"""Anything a decider may ask the controller to do."""
