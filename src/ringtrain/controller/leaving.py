"""Leaving in place: the ranks of a preemption notice that covers only some of them (a Ray node
drain, SIGTERM to one worker) leave an elastic group without a restart, when ``min_workers``
still holds without them. Every member is asked to pause at the next step boundary they all
reach (a :class:`~ringtrain.wire.channel.GrowRequest`, as for a grow), and the group re-forms from
the others (no disk round trip; the global batch kept by the elastic batch policy); the leaving
processes are stopped.

:class:`Leaving` is owned by :class:`ringtrain.controller.elastic.ElasticCoordinator`
(its ``leaving``); the controller calls :meth:`Leaving.refusal` and :meth:`Leaving.start` when a
notice arrives, and the coordinator's ``grow_tick`` drives a leave in progress
(:meth:`Leaving.tick`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ringtrain.config.replica_groups import whole_groups
from ringtrain.controller.generation import Generation
from ringtrain.preemption import PreemptionNotice
from ringtrain.rundir.schema import PreemptionEvent
from ringtrain.wire.channel import GrowRequest

if TYPE_CHECKING:
    from ringtrain.controller.elastic import ElasticCoordinator

logger = logging.getLogger("ringtrain")


class Leaving:
    """The partial preemption notice whose ranks are leaving one coordinator's group.

    Args:
        coordinator: the elastic coordinator whose policy, launcher group, grow in progress and
            generation this reads, and which re-forms the group
            (:meth:`~ringtrain.controller.elastic.ElasticCoordinator.grow_resize`).

    ``notice`` is the notice being acted on (``None``: no leave is in progress).
    """

    def __init__(self, coordinator: ElasticCoordinator) -> None:
        self.coordinator = coordinator
        self.notice: PreemptionNotice | None = None

    def refusal(self, gen: Generation, notice: PreemptionNotice) -> str | None:
        """Why the ranks of the partial ``notice`` cannot leave ``gen`` in place (``None``: they
        can; otherwise the caller preempts the whole run)."""
        coord = self.coordinator
        policy = coord.policy
        if policy is None or notice.ranks is None:
            return "the notice covers every rank" if policy else "the run is not elastic"
        leaving = set(notice.ranks) & set(range(gen.world_size))
        stay = gen.world_size - len(leaving)
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
        if coord.growable() is None:
            return "this launcher cannot resize a worker group"
        if coord.grow is not None or self.notice is not None or gen.interrupted:
            return "the group is re-forming"
        if gen.first_failure_at is not None or gen.done or gen.exited:
            return "the group is failing or finishing"
        return None

    def start(self, gen: Generation, notice: PreemptionNotice) -> str:
        """Ask every member of ``gen`` to pause at the next step boundary they all reach (a
        GrowRequest); once all paused, :meth:`tick` re-forms the group without the ranks of
        ``notice``. Returns the reason, for the log. Call it when :meth:`refusal` is None."""
        coord = self.coordinator
        ctl = coord.ctl
        group = coord.growable()
        assert group is not None and coord.policy is not None and notice.ranks is not None
        ranks = sorted(set(notice.ranks) & set(range(gen.world_size)))
        self.notice = notice
        for rank in range(gen.world_size):
            try:
                group.send(rank, GrowRequest(coord.generation))
            except OSError:
                pass  # that member is gone: its failure follows and ends the leave
        ctl.run_dir.write(
            PreemptionEvent(
                source=notice.source or None,
                reason=notice.reason or None,
                grace_s=notice.grace_s(ctl.preemption.grace_s),
                ranks=ranks,
            )
        )
        ctl.preemption.handled.append(notice)
        message = (
            f"preemption notice for ranks {ranks} ({notice.reason or notice.source}): they leave "
            f"in place at the next step boundary; {gen.world_size - len(ranks)} workers go on "
            f"(min_workers={coord.policy.min_workers})"
        )
        logger.warning(message)
        ctl.progress.message(message)
        return message

    def tick(self, gen: Generation, paused: list[int]) -> Generation | None:
        """Once every member paused, the group without the leaving ranks (renumbered); None
        until then."""
        notice = self.notice
        assert notice is not None
        if len(paused) < gen.world_size:
            return None  # at the deadline the cluster kills them: a failure ends the leave
        self.notice = None
        leaving = set(notice.ranks or ())
        members = [r for r in range(gen.world_size) if r not in leaving]
        cause = f"preemption notice for ranks {sorted(leaving)}"
        return self.coordinator.grow_resize(
            gen, [], None, cause, members=members, since=notice.time
        )
