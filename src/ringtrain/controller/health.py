"""Liveness of one worker group's ranks: when each was last heard from, when it last made
progress, and which one is hung (``worker_timeout_s``)."""

from __future__ import annotations

import time

from ringtrain.wire.channel import Heartbeat

HELLO_TIMEOUT_S = 60.0
"""A worker process that has not connected after this long (or ``worker_timeout_s`` if longer)
is failed as hung."""


class Health:
    """What the driver knows of each rank's liveness (monotonic seconds).

    ``last_seen``: the last message of any kind (absent until its Hello); ``last_progress``: the
    last progress (absent until the rank's first batch, step or report); ``progress_count`` and
    ``last_step``: what its heartbeats said. Updating is O(1) per message; :meth:`check` is
    O(world size) and is run at most every ``check_interval_s``.
    """

    def __init__(self, world_size: int, check_interval_s: float = 0.1) -> None:
        self.world_size = world_size
        self.started_at = time.monotonic()
        self.last_seen: dict[int, float] = {}
        self.last_progress: dict[int, float] = {}
        self.progress_count: dict[int, int] = {}
        self.last_step: dict[int, int] = {}
        self.check_interval_s = check_interval_s
        self._next_check = 0.0
        self.resized_at: float | None = None
        # rank -> (host, since: Unix time): its host stops answering (the launcher's HostSilent)
        self.host_silent: dict[int, tuple[str, float]] = {}

    def resized(self, now: float) -> None:
        """This generation was re-formed from live processes (an elastic resize or grow, at
        ``now``, monotonic seconds): their start-up is paid, so from now on time without progress
        counts toward the hang timeout, re-forming the group included (else a member stuck
        there would wait for the collective timeout, ``2 * worker_timeout_s + 10``)."""
        self.resized_at = now
        for rank in range(self.world_size):
            self.last_progress[rank] = now

    def seen(self, rank: int, now: float) -> None:
        self.last_seen[rank] = now

    def progressed(self, rank: int, now: float) -> None:
        self.last_progress[rank] = now

    def heartbeat(self, beat: Heartbeat, now: float) -> None:
        rank = beat.rank
        if beat.progress_age_s is not None:
            self.last_progress[rank] = max(
                self.last_progress.get(rank, 0.0), now - beat.progress_age_s
            )
        if beat.step is not None:
            self.last_step[rank] = beat.step
        self.progress_count[rank] = beat.progress_count

    def unreachable(
        self, timeout_s: float, exited: dict[int, int], now: float, wall: float, stalled: bool
    ) -> tuple[int, str] | None:
        """A rank cut off from the driver, and how, or None: its host does not answer (the
        launcher's ``HostSilent``: a partition or a lost host, where a frozen process's host
        still answers) and it has been unheard for longer than ``timeout_s`` seconds, or, when
        the group is ``stalled`` (:meth:`hung` found a rank stuck beyond the timeout), for half
        of it (a live rank heartbeats five times per timeout): the partition is why the others
        wait. ``now``: monotonic seconds; ``wall``: Unix time (the launcher's ``since``)."""
        limit = timeout_s / 2 if stalled else timeout_s
        for rank, (host, since) in sorted(self.host_silent.items()):
            heard = self.last_seen.get(rank, self.started_at)
            if rank not in exited and now - heard > limit:
                return rank, (
                    f"on host {host} is unreachable: nothing heard from it for "
                    f"{now - heard:.1f} s and its host has not answered for "
                    f"{max(0.0, wall - since):.1f} s (a network partition or a lost host), "
                    f"beyond worker_timeout_s={timeout_s:g}"
                )
        return None

    def hung(self, timeout_s: float, exited: dict[int, int], now: float) -> tuple[int, str] | None:
        """The rank stuck longer than ``timeout_s`` seconds, and how, or None.

        One that made progress once and then none (its peers usually wait on it inside a
        collective: the one that stopped first, by progress count and then time, is blamed), one
        whose process stopped answering (silent for the timeout, or, once it is blamed, for half
        of it: a live rank heartbeats five times per timeout), or one that never connected
        (within the timeout, but at least ``HELLO_TIMEOUT_S``). Start-up, before a rank's first
        progress, is never a hang: collectives there time out on their own; but a generation
        re-formed from live processes (:meth:`resized`) counts from the resize. Ranks in
        ``exited`` are not looked at.
        """
        if now < self._next_check:
            return None
        self._next_check = now + min(self.check_interval_s, timeout_s / 4)
        live = [r for r in range(self.world_size) if r not in exited]
        silent = [r for r in live if now - self.last_seen.get(r, now) > timeout_s]
        idle = [
            r for r in live if r in self.last_progress and now - self.last_progress[r] > timeout_s
        ]
        unborn = []
        if now - self.started_at > max(timeout_s, HELLO_TIMEOUT_S):
            unborn = [r for r in live if r not in self.last_seen]
        if unborn:
            rank = unborn[0]
            how = f"never connected to the driver in {now - self.started_at:.1f} s"
        elif silent or idle:
            # Data-parallel ranks progress in lockstep: the one stuck first has counted the
            # fewest batches and steps (its peers fetched the next batch, then blocked on it).
            # Peers idle for half the timeout are stuck with it and weighed too: on a loaded
            # machine the culprit's last progress (its step) can come after a peer's (the next
            # batch), so a blocked peer may cross the timeout first; the culprit is then failed
            # when it crosses too, a scheduling skew later.
            stalled = [
                r
                for r in live
                if r in self.last_progress and now - self.last_progress[r] > timeout_s / 2
            ]
            rank = min(
                set(silent + idle + stalled),
                key=lambda r: (
                    self.progress_count.get(r, 0),
                    self.last_progress.get(r, self.last_seen[r]),
                    r,
                ),
            )
            if rank not in silent and rank not in idle:
                return None
            if rank in silent:
                how = (
                    f"stopped answering for {now - self.last_seen[rank]:.1f} s "
                    "(the process is frozen or stopped)"
                )
            elif now - self.last_seen[rank] > timeout_s / 2:
                # A live rank heartbeats every timeout/5 (launch/worker.heartbeat_interval), so
                # one unheard for half the timeout is frozen, even though a heartbeat sent
                # between its last progress and the freeze lets the progress threshold be
                # crossed first.
                how = (
                    f"stopped answering {now - self.last_seen[rank]:.1f} s ago and made no "
                    f"progress for {now - self.last_progress[rank]:.1f} s (the process is "
                    "frozen or stopped)"
                )
            elif self.last_progress[rank] == self.resized_at:
                how = (
                    f"has not resumed {now - self.last_progress[rank]:.1f} s after the group "
                    "was resized (alive, but stuck re-forming the group or before its first "
                    "step in it)"
                )
            else:
                how = (
                    f"made no progress for {now - self.last_progress[rank]:.1f} s (alive, "
                    "but stuck: a deadlock, an endless loop, or waiting on a collective)"
                )
        else:
            return None
        others = sorted(set(silent + idle) - {rank})
        waiting = f"; ranks {others} are stuck too, waiting on it" if others else ""
        return rank, f"{how}, beyond worker_timeout_s={timeout_s:g}{waiting}"
