"""The driver's elastic decisions: resize in place, wait, or fall back to the full restart; and
when to grow back to ``max_workers``.

Pure logic over what the controller has seen of one worker-group generation, so it is unit-tested
without processes. The rules:

- only *lost* workers (killed by a signal, or exited non-zero without raising in Python) are
  resized away; an exception in the train function or a hang means a bug or a stuck collective,
  and the group is restarted from the disk checkpoint as in a non-elastic run;
- every other rank must have said :class:`~ringtrain.wire.channel.Interrupted` (it is alive and
  waiting) within ``wait_s`` of the first failure, and must hold an in-memory snapshot;
- at least ``min_workers`` ranks must remain.

On a device mesh with a varying ``dp_replicate`` (``replica_group_size`` > 1 or sharded state:
:mod:`ringtrain.config.replica_groups`) a lost rank takes its whole replica group with it: its other
ranks are left out of the new group (and stopped), and the others resume from the *oldest*
snapshot step a survivor reports: every survivor holds it (its newest or the one before, which a
sharded snapshot keeps), so no rank needs another's shards.

The new group resumes from the newest snapshot any survivor holds (a rank whose last collective
completed just before the peer died may be one step ahead of the others; its state is the
complete result of that step, so the others take it by broadcast).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from ringtrain.config.replica_groups import replica_survivors
from ringtrain.result import WorkerFailure
from ringtrain.wire.channel import Interrupted

LOST_KINDS = ("signal", "exit")


class ElasticAction(enum.Enum):
    WAIT = "wait"
    RESIZE = "resize"
    FALLBACK = "fallback"


@dataclass(frozen=True)
class ElasticDecision:
    """``survivors``: the old ranks that form the new group, in new-rank order. ``source``: the
    new rank whose snapshot all take (``None``: all hold the same). ``snapshot_step``: the step
    the new group resumes after. ``stuck``: the survivors that did not report the lost peer in
    time (a FALLBACK for that reason). ``spares``: how many ready hot spares take lost ranks
    (``ScalingConfig.spares``; :func:`ringtrain.controller.spares.replace` places them)."""

    action: ElasticAction
    reason: str
    survivors: tuple[int, ...] = ()
    stuck: tuple[int, ...] = ()
    source: int | None = None
    snapshot_step: int | None = None
    spares: int = 0


class ElasticPolicy:
    """Args:
    min_workers: the fewest workers to continue with in place.
    max_workers: the world size of a full (re)start.
    wait_s: how long after the first failure to wait for every survivor's Interrupted
        (seconds) before giving up on the resize.
    grow_after_s: after a resize below ``max_workers``, how long to wait before growing back
        (seconds; ``None``: never; ``ScalingConfig.elastic_grow_after_s``).
    replica_group_size: ranks per replica group (``dp_shard`` of an elastic
        ``ParallelConfig(dp_replicate=-1, ...)``; 1: every rank on its own). The group shrinks
        and grows by whole replica groups.
    replicas: the run is laid out on a device mesh (``ScalingConfig.parallel``): resume from the
        oldest snapshot step a survivor holds, never by broadcast (sharded state stays put).
    """

    def __init__(
        self,
        min_workers: int,
        max_workers: int,
        wait_s: float = 30.0,
        grow_after_s: float | None = None,
        replica_group_size: int = 1,
        replicas: bool = False,
    ) -> None:
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.wait_s = wait_s
        self.grow_after_s = grow_after_s
        self.replica_group_size = replica_group_size
        self.replicas = replicas or replica_group_size > 1

    def use_mesh(self, replica_group_size: int) -> None:
        """The run is laid out on a device mesh (``WorkerConfig.mesh``) whose replica groups are
        ``replica_group_size`` ranks (its ``dp_shard``: the config allows elastic meshes with
        ``tp = pp = 1`` only); the coordinator calls it as each worker group starts."""
        self.replica_group_size = replica_group_size
        self.replicas = True

    def grow_delay_s(self, failed_grows: int) -> float | None:
        """Seconds to wait after a resize (or a failed grow) before trying to grow back:
        ``grow_after_s``, doubled after each consecutive grow whose new worker failed (at most
        64 times it), so a worker that cannot start does not pause the group over and over.
        ``None``: never grow."""
        if self.grow_after_s is None:
            return None
        return self.grow_after_s * 2 ** min(max(failed_grows, 0), 6)

    def grow_ranks(self, world_size: int, idle_s: float, failed_grows: int) -> list[int]:
        """The ranks to start to grow a group of ``world_size`` back to ``max_workers`` now
        (``[]``: not now).

        Args:
            world_size: members of the current generation.
            idle_s: seconds since the last resize or failed grow.
            failed_grows: consecutive grows whose new workers failed (0 after a success).
        """
        delay = self.grow_delay_s(failed_grows)
        if delay is None or world_size >= self.max_workers or idle_s < delay:
            return []
        return list(range(world_size, self.max_workers))

    def decide(
        self,
        world_size: int,
        failures: Mapping[int, WorkerFailure],
        interrupted: Mapping[int, Interrupted],
        finished: set[int],
        waited_s: float,
        spares: int = 0,
    ) -> ElasticDecision:
        """Args:
        world_size: ranks of the current generation.
        failures: rank -> its failure, so far.
        interrupted: rank -> its Interrupted message.
        finished: ranks that exited successfully or sent Done.
        waited_s: seconds since the first failure.
        spares: hot spares ready to take lost ranks (each counts toward ``min_workers``; not
            on a mesh: a spare takes one rank, a replica group leaves whole).
        """
        other = {r: f for r, f in failures.items() if f.kind not in LOST_KINDS}
        if other:
            _rank, f = min(other.items())
            return ElasticDecision(
                ElasticAction.FALLBACK,
                f"not resizing in place: {f.message} (a {f.kind}, not a lost worker)",
            )
        if finished:
            return ElasticDecision(
                ElasticAction.FALLBACK,
                f"not resizing in place: ranks {sorted(finished)} already finished",
            )
        lost = sorted(failures)
        survivors, leaving = replica_survivors(world_size, self.replica_group_size, lost)
        gone = ""
        if self.replica_group_size > 1 and leaving:
            gone = f" (replica groups {list(leaving)} of {self.replica_group_size} ranks leave)"
        used = 0 if self.replicas else min(spares, len(lost))
        if lost and len(survivors) + used < self.min_workers:
            ready = f" and {used} spares are ready" if used else ""
            return ElasticDecision(
                ElasticAction.FALLBACK,
                f"not resizing in place: {len(survivors)} of {world_size} workers remain{gone}"
                f"{ready}, fewer than min={self.min_workers}",
            )
        waiting = [r for r in survivors if r not in interrupted]
        if waiting or not lost:
            if waited_s < self.wait_s:
                return ElasticDecision(ElasticAction.WAIT, "waiting for the survivors")
            what = f"ranks {waiting} did not" if waiting else "no worker was lost, but ranks"
            return ElasticDecision(
                ElasticAction.FALLBACK,
                f"not resizing in place: {what} report a lost peer within {self.wait_s:g} s",
                stuck=tuple(waiting),
            )
        steps = {r: interrupted[r].snapshot_step for r in survivors}
        if any(s is None for s in steps.values()):
            none = sorted(r for r, s in steps.items() if s is None)
            return ElasticDecision(
                ElasticAction.FALLBACK,
                f"not resizing in place: ranks {none} hold no in-memory snapshot yet (none is "
                "taken before the first TrainState.step increment, nor for FSDP-sharded state "
                "outside ParallelConfig(dp_replicate=-1, ...))",
            )
        held = [s for s in steps.values() if s is not None]
        newest = min(held) if self.replicas else max(held)
        source = None
        if len(set(steps.values())) > 1 and not self.replicas:
            source = survivors.index(min(r for r in survivors if steps[r] == newest))
        reason = (
            f"resizing in place: {world_size} -> {len(survivors)} workers (lost ranks {lost})"
            + gone
        )
        if used:
            reason = (
                f"replacing in place: {used} spare(s) take lost ranks {lost[:used]}; "
                f"{world_size} -> {len(survivors) + used} workers"
            )
        return ElasticDecision(
            ElasticAction.RESIZE,
            reason,
            survivors=survivors,
            source=source,
            snapshot_step=newest,
            spares=used,
        )
