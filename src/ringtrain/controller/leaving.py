"""Leaving in place: the ranks of a preemption notice that covers only some of them (a Ray node
drain, SIGTERM to one worker) leave an elastic group without a restart, when ``min_workers``
still holds without them.

The controller enters the ``Leaving`` state (:class:`~ringtrain.controller.states.Leaving`, which
carries the notice) with the effects of :func:`start`: every member is asked to pause at the next
step boundary they all reach (a :class:`~ringtrain.wire.channel.GrowRequest`, as for a grow).
Once every member paused, :func:`staying` names the members that stay and the group is re-formed
from them (:func:`ringtrain.controller.elastic.reform`; no disk round trip, the global batch kept
by the elastic batch policy); the leaving processes are stopped. A failure while leaving ends the
leave: the lost rank's failure decides, as from ``Running``.
"""

from __future__ import annotations

from ringtrain.config.replica_groups import whole_groups
from ringtrain.controller.effects import Effect, Say, Send, Write
from ringtrain.controller.elastic import paused_members
from ringtrain.controller.generation import Generation
from ringtrain.elastic.policy import ElasticPolicy
from ringtrain.preemption import PreemptionNotice
from ringtrain.rundir.schema import PreemptionEvent
from ringtrain.wire.channel import GrowRequest


def refusal(
    policy: ElasticPolicy | None,
    gen: Generation,
    notice: PreemptionNotice,
    *,
    can_resize: bool,
    spares: int = 0,
) -> str | None:
    """Why the ranks of the partial ``notice`` cannot leave ``gen`` in place (``None``: they can;
    otherwise the caller preempts the whole run).

    Args:
        policy: the run's elastic policy (``None``: not an elastic run).
        gen: the group, in the ``Running`` state.
        notice: a notice for some ranks.
        can_resize: the launcher's group can be resized in place.
        spares: hot spares ready to take the leaving ranks' places (``ScalingConfig.spares``).
    """
    if policy is None or notice.ranks is None:
        return "the notice covers every rank" if policy else "the run is not elastic"
    leaving = set(notice.ranks) & set(range(gen.world_size))
    stay = gen.world_size - len(leaving) + min(spares, len(leaving))
    if not leaving:
        return f"the notice names ranks {list(notice.ranks)}, none of the group's"
    if stay < policy.min_workers:
        return (
            f"without ranks {sorted(leaving)} {stay} workers would be left, fewer than "
            f"min_workers={policy.min_workers}"
        )
    size = policy.replica_group_size
    if not whole_groups(leaving, size):
        return (
            f"ranks {sorted(leaving)} are part of a replica group of {size} ranks (a replica "
            "group leaves whole: its other ranks' shards are useless without them)"
        )
    if not can_resize:
        return "this launcher cannot resize a worker group"
    if gen.interrupted:
        return "the group is re-forming"
    if gen.first_failure_at is not None or gen.done or gen.exited:
        return "the group is failing or finishing"
    return None


def start(
    gen: Generation,
    notice: PreemptionNotice,
    *,
    generation: int,
    grace_s: float,
    min_workers: int,
    spares: int = 0,
) -> tuple[str, list[Effect]]:
    """The leave of ``notice``'s ranks from ``gen`` (call it when :func:`refusal` is ``None``):
    the reason for the log and the effects (the pause request to every member, the
    ``preemption`` event). ``grace_s``: ``FailureConfig.preemption_grace_s``; ``spares``: hot
    spares ready to take the leaving ranks' places."""
    ranks = sorted(set(notice.ranks or ()) & set(range(gen.world_size)))
    taken = min(spares, len(ranks))
    handed = f", hot spares take the places of ranks {ranks[:taken]}" if taken else ""
    message = (
        f"preemption notice for ranks {ranks} ({notice.reason or notice.source}): they leave "
        f"in place at the next step boundary{handed}; {gen.world_size - len(ranks) + taken} "
        f"workers go on (min_workers={min_workers})"
    )
    return message, [
        # A member that cannot be reached is gone: its failure follows and ends the leave.
        Send(tuple(range(gen.world_size)), GrowRequest(generation)),
        Write(
            PreemptionEvent(
                source=notice.source or None,
                reason=notice.reason or None,
                grace_s=notice.grace_s(grace_s),
                ranks=ranks,
            )
        ),
        Say(message, warn=True),
    ]


def staying(gen: Generation, notice: PreemptionNotice) -> list[int] | None:
    """Once every member paused, the members that stay (old ranks, in order); ``None`` until
    then (at the notice's deadline the cluster kills the leaving ranks: a failure ends it)."""
    if len(paused_members(gen)) < gen.world_size:
        return None
    leaving = set(notice.ranks or ())
    return [r for r in range(gen.world_size) if r not in leaving]
