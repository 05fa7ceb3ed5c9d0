"""A Ray node drain as a preemption notice (the Ray backend's :class:`NoticeSource`).

Before Ray takes a node away on purpose (a spot instance's reclaim warning handled by the
autoscaler, KubeRay deleting a pod, ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION
--deadline-remaining-seconds N``) it asks the GCS to *drain* the node: the node accepts no new
work and is killed at the deadline. The GCS lists the nodes being drained with the deadline of
each (``get_draining_nodes()``: node id -> deadline in Unix milliseconds, 0 when there is none;
ray-project/ray#42982); Ray Train v2 polls the same call for its own preemption handling
(ray-project/ray#63807, #63968). An idle node is drained at once, so a draining node that still
runs this run's workers is one that will be taken from under them.

:class:`RayDrainNotice` polls that list from a driver thread every ``interval_s`` seconds and, for
each newly draining node that runs workers of the current group, sends one
:class:`~ringtrain.preemption.PreemptionNotice` (source ``"ray-drain"``) whose ``ranks`` are
the workers on that node and whose ``deadline_s`` is the drain's. The controller then stops every
worker at one agreed step with a checkpoint (the run ends ``PREEMPTED``), or, in an elastic run
whose ``min`` still holds without those ranks, lets them leave in place (docs/fault-tolerance.md).

Where the workers are comes from the launcher (:meth:`RayLauncher.notice_sources
<ringtrain.launch.ray.RayLauncher.notice_sources>` passes the current group's ``node_ranks``):
the worker group changes on every restart and resize, the source stays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from ringtrain.preemption import Notify, PreemptionNotice

__all__ = ["NodeRanks", "RayDrainNotice", "draining_nodes"]

logger = logging.getLogger("ringtrain")

NodeRanks = Callable[[], Mapping[str, Sequence[int]]]
"""The current worker group's placement: Ray node id (hex) -> the ranks running there."""


def draining_nodes() -> dict[str, int]:
    """The nodes Ray is draining now: node id (hex) -> deadline (Unix milliseconds; 0: none).

    Reads the GCS through this process's Ray connection (``ray.init`` must have run).

    Raises:
        RuntimeError: if this Ray version has no way to list draining nodes.
    """
    import ray

    state = getattr(getattr(ray, "_private", None), "state", None)
    state = getattr(state, "state", None)
    if state is None or not hasattr(state, "get_draining_nodes"):
        raise RuntimeError(
            f"ray {ray.__version__} does not list draining nodes (get_draining_nodes, Ray >= 2.10)"
        )
    return {str(k): int(v or 0) for k, v in state.get_draining_nodes().items()}


class RayDrainNotice:
    """A preemption notice for the workers on each node that Ray starts draining.

    Args:
        node_ranks: the current group's placement (node id -> ranks); polled each time. An
            empty mapping (no group running) skips the poll.
        interval_s: seconds between polls of the GCS (> 0).
        draining: the list of draining nodes (default :func:`draining_nodes`; tests and other
            clusters pass their own).

    Raises:
        ValueError: if ``interval_s`` is not a positive number.
    """

    def __init__(
        self,
        node_ranks: NodeRanks,
        interval_s: float = 1.0,
        draining: Callable[[], Mapping[str, int]] = draining_nodes,
    ) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)):
            raise ValueError(f"RayDrainNotice(interval_s=...) must be a number, got {interval_s!r}")
        if not 0 < interval_s < float("inf"):
            raise ValueError(
                f"RayDrainNotice(interval_s=...) must be a positive number of seconds, got "
                f"{interval_s!r}"
            )
        self.node_ranks = node_ranks
        self.interval_s = float(interval_s)
        self.draining = draining
        self.notified: set[str] = set()  # nodes already said (one notice per node)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed_once = False

    def __repr__(self) -> str:
        return f"RayDrainNotice(interval_s={self.interval_s:g})"

    def start(self, notify: Notify) -> None:
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._poll, args=(notify,), name="ringtrain-ray-drain", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=max(2.0, 2 * self.interval_s))

    def _poll(self, notify: Notify) -> None:
        while not self._stop.wait(self.interval_s):
            notice = self.check()
            if notice is not None:
                notify(notice)

    def check(self) -> PreemptionNotice | None:
        """One poll: the notice for the nodes that started draining since the last one and run
        workers of the current group (``None``: none). Errors of the GCS call are logged once
        and polling goes on."""
        placement = {node: list(ranks) for node, ranks in self.node_ranks().items() if ranks}
        if not placement:
            return None
        try:
            draining = dict(self.draining())
        except Exception as exc:
            if not self._failed_once:
                self._failed_once = True
                logger.warning("RayDrainNotice: cannot list draining Ray nodes (%s)", exc)
            return None
        new = sorted(n for n in draining if n in placement and n not in self.notified)
        if not new:
            return None
        self.notified.update(new)
        ranks = sorted({r for n in new for r in placement[n]})
        deadlines = [draining[n] for n in new if draining[n] > 0]
        deadline_s = max(0.0, min(deadlines) / 1000.0 - time.time()) if deadlines else None
        nodes = ", ".join(n[:12] for n in new)
        how = f", deadline in {deadline_s:.0f} s" if deadline_s is not None else ""
        reason = f"Ray is draining node {nodes} (ranks {ranks}{how})"
        logger.info("RayDrainNotice: %s", reason)
        return PreemptionNotice.now(reason, "ray-drain", deadline_s=deadline_s, ranks=ranks)
