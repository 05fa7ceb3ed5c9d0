"""``FailureConfig``: how a run answers worker failures (restarts, hang detection, elastic
snapshots) and preemption notices (grace, notice sources, SLURM requeue); part of
:class:`~ringtrain.config.RunConfig`, validated when it is built, re-exported by
:mod:`ringtrain.config`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringtrain.config.validation import check_int, short_errors
from ringtrain.preemption import NoticeSource, check_sources


@short_errors
@dataclass(frozen=True)
class FailureConfig:
    """What to do when a worker fails.

    Attributes:
        max_failures: how many worker-group failures to survive by restarting the group from the
            latest checkpoint; 0 stops at the first failure, -1 retries forever.
        worker_timeout_s: a worker that shows no progress (no batch from a prepared loader, no
            ``TrainState.step`` change, no report) for this many seconds, or whose process stops
            answering, is treated as failed (hung; ``unreachable`` when its host does not
            answer either, on Ray: a network partition or a lost host, and then its connections
            give up after this long too). It also bounds every collective (at twice
            this plus 10 s, so the driver names the stuck rank first), so a dead peer never
            blocks the group forever. ``None`` disables hang detection (collectives then time
            out after torch's default 30 minutes).
        snapshot_interval_steps: elastic runs only (``ScalingConfig(num_workers=(min, max))``):
            every this many ``TrainState.step`` increments each worker copies its TrainState to
            host memory (a copy into reused buffers, no communication), which is what a
            resize in place rolls back to (docs/elastic.md). Ignored with an int ``num_workers``.
        preemption_grace_s: after a preemption notice (SIGTERM or SIGUSR1 to the driver, SIGTERM
            to the workers, a ``notice_sources`` entry), the seconds the workers get to reach one
            agreed step boundary, save their ``TrainState`` there and exit; then the group is
            killed (what was not written is said in a ``preemption_incomplete`` event and the
            previous checkpoint stays). A source that knows its deadline uses it instead. The run
            ends ``PREEMPTED``; notices never count against ``max_failures``
            (docs/fault-tolerance.md, "Preemption").
        notice_sources: extra preemption notice sources, each with ``start(notify)`` and
            ``stop()`` (:class:`ringtrain.preemption.NoticeSource`, e.g.
            ``CallableNotice(fn, interval_s)``); the driver's SIGTERM/SIGUSR1 are always watched.
        slurm_requeue: inside a SLURM job (``SLURM_JOB_ID`` set), a run that ends ``PREEMPTED``
            asks for its job to be queued again (``scontrol requeue``); the requeued job resumes
            the run by its name (:mod:`ringtrain.cluster.slurm`). ``False`` leaves the job ended.
        replica_check_every: every this many ``TrainState.step`` increments, the data-parallel
            replicas (DDP's ranks, HSDP's ``dp_replicate`` axis; DiLoCo's global parameters
            and outer optimizer over every rank, its local state within islands) compare a
            64-bit fingerprint of their parameters and optimizer state (one allgather of 24
            bytes per rank, pipelined with the next step). Replicas are bit-identical by
            construction, so a rank that differs holds corrupted bits: the run rolls back to the
            newest checkpoint that passed a check and continues; a rank caught twice is excluded
            (elastic runs) or stops the run with its name and host. 0 (default): off. Cost and
            detection: docs/fault-tolerance.md, "Silent data corruption".
        replay_check_every: every this many steps each rank's step (its batch, its RNG state,
            the parameters before the step) is recomputed by the next rank in a ring and the
            local gradients' fingerprints compared: this catches a rank whose *gradient* is
            wrong, which the replica check cannot see (the allreduce spreads it to every replica
            alike): a device that miscomputes at every step within this many steps, a transient
            flip with probability 1/N. 0 (default): off.
    """

    max_failures: int = 0
    worker_timeout_s: float | None = 600.0
    snapshot_interval_steps: int = 1
    preemption_grace_s: float = 30.0
    notice_sources: Sequence[NoticeSource] = ()
    slurm_requeue: bool = True
    replica_check_every: int = 0
    replay_check_every: int = 0

    def __post_init__(self) -> None:
        check_int(
            "FailureConfig",
            "snapshot_interval_steps",
            self.snapshot_interval_steps,
            1,
            "use 1 to snapshot after every TrainState.step increment",
        )
        check_int(
            "FailureConfig",
            "max_failures",
            self.max_failures,
            -1,
            "use 0 to stop at the first failure, -1 to retry forever",
        )
        t = self.worker_timeout_s
        if t is not None and (
            isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t != t
        ):
            raise ValueError(
                f"FailureConfig.worker_timeout_s must be a positive number of seconds or None, "
                f"got {t!r} (None disables hang detection)"
            )
        g = self.preemption_grace_s
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g < float("inf"):
            raise ValueError(
                f"FailureConfig.preemption_grace_s must be a positive number of seconds, got "
                f"{g!r} (the time the workers get after a preemption notice, e.g. 30)"
            )
        if not isinstance(self.slurm_requeue, bool):
            raise TypeError(
                f"FailureConfig.slurm_requeue must be True or False, got {self.slurm_requeue!r}"
            )
        for name in ("replica_check_every", "replay_check_every"):
            check_int(
                "FailureConfig",
                name,
                getattr(self, name),
                0,
                "use 0 to turn the check off, or N to check every N TrainState.step increments",
            )
        sources = check_sources("FailureConfig.notice_sources", self.notice_sources)
        object.__setattr__(self, "notice_sources", sources)

    def to_dict(self) -> dict[str, Any]:
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "notice_sources"
        }
        # Objects, not data: written for the reader (a resumed `ringtrain run` cannot rebuild
        # them; its driver still watches SIGTERM/SIGUSR1).
        out["notice_sources_repr"] = [repr(s) for s in self.notice_sources]
        return out
