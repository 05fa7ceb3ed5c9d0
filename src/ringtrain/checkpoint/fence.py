"""The fence: which workers may still write to a run's storage.

A worker cut off by a network partition keeps running, and it can usually still reach the
run's storage (a shared filesystem, an object store) though not its driver. Once the controller
has declared it lost and started or re-formed a group without it, a checkpoint it writes would
land among the new group's files: a split brain. So the driver keeps ``fence.json`` in the
directory the workers write to: the current attempt and the workers of that attempt it has
declared lost (``"HOST:PID"``, as each said in its ``Hello``). A worker reads it before it
writes checkpoint files (:func:`check`) and stops with :class:`WorkerFenced` if it is named, or
if a later attempt has begun. The driver writes it before anything else when it declares a
worker unreachable, and at every attempt's start; it also guards publication while such a worker
may live (:meth:`ringtrain.checkpoint.manager.CheckpointManager.settle_staging`).

A write a worker began before the fence moved can still finish (storage has no
compare-and-swap); what it leaves is never published: a new attempt removes every staging
directory first, and a guarded publication drops files no current rank reported and refuses a
round whose files differ from what the ranks reported.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from typing import Any

FENCE = "fence.json"


class WorkerFenced(BaseException):
    """This worker was declared lost by its driver (or its attempt has ended): it may no longer
    write to the run's storage. A ``BaseException``, like ``SystemExit``: a train function's
    ``except Exception`` does not swallow it."""


@dataclass(frozen=True)
class Fence:
    """Attempt ``attempt`` is the current one; ``lost`` are its workers declared lost."""

    attempt: int
    lost: tuple[str, ...] = field(default_factory=tuple)

    def why_fenced(self, attempt: int, worker: str) -> str | None:
        """Why worker ``worker`` of attempt ``attempt`` may not write, or ``None``."""
        if attempt < self.attempt:
            return f"attempt {attempt} has ended (the run is at attempt {self.attempt})"
        if attempt == self.attempt and worker in self.lost:
            return f"the driver declared this worker ({worker}, attempt {attempt}) lost"
        return None


def worker_id() -> str:
    """This process as the driver knows it: ``"HOST:PID"`` (its ``Hello``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _path(fs: Any, root: str) -> str:
    from ringtrain.checkpoint.layout import join

    return str(join(fs, root, FENCE))


def write(fs: Any, root: str, fence: Fence) -> None:
    """Write ``fence`` to ``root`` on ``fs`` (a local file is replaced atomically)."""
    from ringtrain.checkpoint.layout import is_local_fs

    data = json.dumps({"attempt": fence.attempt, "lost": list(fence.lost)}).encode()
    target = _path(fs, root)
    if is_local_fs(fs):
        os.makedirs(root, exist_ok=True)
        tmp = f"{target}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    else:
        fs.pipe_file(target, data)


def read(fs: Any, root: str) -> Fence | None:
    """The fence at ``root``, or ``None`` (none written: nothing is fenced)."""
    try:
        with fs.open(_path(fs, root), "rb") as f:
            raw = json.loads(f.read())
        return Fence(int(raw["attempt"]), tuple(str(w) for w in raw.get("lost", ())))
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None


def check(fs: Any, root: str, attempt: int, worker: str | None = None) -> None:
    """Raise :class:`WorkerFenced` if worker ``worker`` (default: this process) of attempt
    ``attempt`` may no longer write under ``root``."""
    fence = read(fs, root)
    if fence is None:
        return
    why = fence.why_fenced(attempt, worker or worker_id())
    if why is not None:
        raise WorkerFenced(f"not writing to the run's storage: {why} (see {_path(fs, root)})")


__all__ = ["FENCE", "Fence", "WorkerFenced", "check", "read", "worker_id", "write"]
