"""The controller's states, each carrying its data, and the :class:`Transition` between two.

::

    from          to            when
    Starting      Running       the group was started (from the newest valid checkpoint)
    Running       Finished      every worker exited with status 0
    Running       Restarting    a rank failed, exited non-zero, or hung
    Running       Resizing      the same, in an elastic run
    Running       Growing       elastic runs below max: workers were started to join
    Growing       Running       the group was re-formed with them (or the grow failed)
    Running       Leaving       elastic runs: a preemption notice for some ranks, which leave in
                                place while min_workers holds without them
    Leaving       Running       every member paused; the group was re-formed without them
    Resizing      Running       the survivors continue in place as a smaller group
    Resizing      Restarting    resizing in place cannot be done (the reason says why)
    Restarting    Starting      the FailurePolicy says RESTART (or the checkpoint was unloadable)
    Restarting    Errored       the FailurePolicy says RAISE
    any live      Stopped       ``stop_event`` was set
    any live      Preempting    a PreemptionNotice (ringtrain.preemption: signals, user sources,
                                a worker's SIGTERM): the workers are asked to stop at one step
    Preempting    Preempted     every worker saved its state at that step and exited, or the
                                deadline passed (the previous checkpoint stays), or the group
                                could not be asked
    Preempting    Finished      every worker finished before reaching the stop step
    any           Aborted       the driver raised (Ctrl-C, a bug)

A failure while ``Growing`` or ``Leaving`` leaves it as from ``Running`` (to ``Resizing`` or
``Restarting``); the grow plan goes with the state (``Growing.plan``, then ``Resizing.plan``,
whose joiners are stopped), and a leave in progress ends.
Every state's ``kind`` is a :class:`RunState`; ``Controller.state`` is the current kind (the
``status`` of ``result.json`` and of the ``run_end`` event once terminal).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from ringtrain.preemption import PreemptionNotice

if TYPE_CHECKING:
    from ringtrain.controller.generation import Generation, Grow
    from ringtrain.controller.policy import FailureDecision
    from ringtrain.result import TrainingFailedError, WorkerFailure


class RunState(enum.Enum):
    """The kind of a controller state."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    GROWING = "GROWING"
    RESIZING = "RESIZING"
    LEAVING = "LEAVING"
    RESTARTING = "RESTARTING"
    PREEMPTING = "PREEMPTING"
    FINISHED = "FINISHED"
    ERRORED = "ERRORED"
    ABORTED = "ABORTED"
    STOPPED = "STOPPED"
    PREEMPTED = "PREEMPTED"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = {
    RunState.FINISHED,
    RunState.ERRORED,
    RunState.ABORTED,
    RunState.STOPPED,
    RunState.PREEMPTED,
}


@dataclass(frozen=True)
class State:
    """A controller state; subclasses carry the data that state needs."""

    kind: ClassVar[RunState]


@dataclass(frozen=True)
class Starting(State):
    """About to start worker group ``attempt`` (0 first, +1 per restart) from the newest valid
    checkpoint."""

    kind: ClassVar[RunState] = RunState.STARTING
    attempt: int = 0


@dataclass(frozen=True)
class Running(State):
    """The worker group ``generation`` trains; its events are handled as they come."""

    kind: ClassVar[RunState] = RunState.RUNNING
    generation: Generation = field(repr=False, compare=False)


@dataclass(frozen=True)
class Growing(State):
    """Elastic runs below ``max`` workers: ``plan``'s workers were started to join; the members
    keep training until they are all ready, then pause at a step boundary and the group is
    re-formed (back to ``Running``)."""

    kind: ClassVar[RunState] = RunState.GROWING
    generation: Generation = field(repr=False, compare=False)
    plan: Grow = field(repr=False, compare=False)


@dataclass(frozen=True)
class Leaving(State):
    """Elastic runs: a preemption ``notice`` for some ranks, which leave in place: every member
    was asked to pause at the next step boundary they all reach; once all paused, the group is
    re-formed without the leaving ranks (``Running``)."""

    kind: ClassVar[RunState] = RunState.LEAVING
    generation: Generation = field(repr=False, compare=False)
    notice: PreemptionNotice


@dataclass(frozen=True)
class Resizing(State):
    """Elastic runs: ``failure`` lost a rank; the survivors are waited for (each says
    ``Interrupted``), then the group continues in place with fewer ranks (``Running``) or, when
    that cannot be done, is restarted (``Restarting``). ``plan``: the grow that was under way
    (its joiners are stopped when the group is re-formed)."""

    kind: ClassVar[RunState] = RunState.RESIZING
    generation: Generation = field(repr=False, compare=False)
    failure: WorkerFailure | None
    plan: Grow | None = field(default=None, repr=False, compare=False)


@dataclass(frozen=True)
class Restarting(State):
    """A rank failed (``failure``: the first one seen). The group's remaining events are still
    collected for ``failure_grace_s`` (the real cause must win over its peers' connection
    errors) and while a live rank finishes a checkpoint write; then the group is stopped and the
    FailurePolicy decides: ``Starting(attempt + 1)`` or ``Errored``. ``verdict``: the policy's
    decision when it was already asked about this failure (an elastic run whose resize it
    refused): the policy is asked once per failure."""

    kind: ClassVar[RunState] = RunState.RESTARTING
    generation: Generation = field(repr=False, compare=False)
    failure: WorkerFailure | None
    verdict: FailureDecision | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Preempting(State):
    """The workers will be taken away (``notice``): every worker was asked to stop at the next
    step boundary they all reach, save its ``TrainState`` there and exit, before ``deadline``
    (``time.monotonic()``); then (or at the deadline, killing the group) ``Preempted``."""

    kind: ClassVar[RunState] = RunState.PREEMPTING
    generation: Generation = field(repr=False, compare=False)
    notice: PreemptionNotice
    deadline: float = 0.0


@dataclass(frozen=True)
class Finished(State):
    kind: ClassVar[RunState] = RunState.FINISHED


@dataclass(frozen=True)
class Errored(State):
    """The FailurePolicy gave up; ``error`` is what ``Trainer.fit`` raises."""

    kind: ClassVar[RunState] = RunState.ERRORED
    error: TrainingFailedError | None = None


@dataclass(frozen=True)
class Aborted(State):
    """The driver itself raised (Ctrl-C, a bug): ``reason`` names the exception."""

    kind: ClassVar[RunState] = RunState.ABORTED
    reason: str = ""


@dataclass(frozen=True)
class Stopped(State):
    """A caller asked the run to stop early (``stop_event``); its checkpoints are kept."""

    kind: ClassVar[RunState] = RunState.STOPPED


@dataclass(frozen=True)
class Preempted(State):
    """A preemption notice ended the run; it is resumable: a later ``fit()`` of the same run
    name continues from the checkpoint saved at the stop step."""

    kind: ClassVar[RunState] = RunState.PREEMPTED


@dataclass(frozen=True)
class Transition:
    """One step of the controller: from ``source`` to ``target`` because of ``reason``.

    A step that changes nothing has ``source is target`` (``changed`` is False) and is neither
    logged nor written; every other one is logged and written to ``events.jsonl`` as a
    ``transition`` event with fields ``from``, ``to`` (state kinds) and ``reason``.
    """

    source: State
    target: State
    reason: str = ""

    @property
    def changed(self) -> bool:
        return self.source is not self.target

    @property
    def from_(self) -> RunState:
        return self.source.kind

    @property
    def to(self) -> RunState:
        return self.target.kind
