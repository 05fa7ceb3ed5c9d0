"""A rank's checkpoint files: checksummed, retried with backoff, optionally in the background.

A rank's part of a checkpoint is a handful of files (``train_state.pt`` on rank 0, ``rank_NNNNN.pt``
on every rank, or the files of a user's directory). :func:`write_files` writes them into the
round's staging directory, hashing each byte as it goes, and retries the whole set when the storage
fails transiently. :class:`AsyncCheckpointWriter` runs that on one background thread so that the
training loop pays only for staging the state to host memory (the design of
``torch.distributed.checkpoint.async_save``): at most one save is in flight, and a new save first
waits for the previous one, so memory holds at most one staged copy.
"""

from __future__ import annotations

import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from ringtrain.checkpoint import storage

logger = logging.getLogger("ringtrain")

# Jitter comes from a private generator: the library must never draw from the global `random`
# stream, which is part of the user's training state (a retry would make a resumed run diverge).
_jitter = random.Random()

FileWriter = Callable[[Any], None]
"""Writes one file's bytes to the binary file object it is given."""

# Errors that retrying cannot fix: the path or the permissions are wrong, or our own bug.
_PERMANENT = (
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    TypeError,
    ValueError,
    AttributeError,
)


class _HashingWriter:
    """A binary file-like that forwards writes and keeps their size and SHA-256."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.sha.update(view)
        self.size += view.nbytes
        self.inner.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.inner.flush()


def retry(
    fn: Callable[[], Any],
    *,
    what: str,
    attempts: int = 5,
    initial_s: float = 0.2,
    max_s: float = 5.0,
) -> Any:
    """Call ``fn`` until it succeeds, sleeping ``initial_s * 2**k`` (capped at ``max_s``, with
    +-25% jitter) between attempts; errors in ``_PERMANENT`` are raised at once.

    Raises:
        The last error, once ``attempts`` calls have failed.
    """
    delay = initial_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except _PERMANENT:
            raise
        except Exception as exc:
            if attempt == attempts:
                raise
            logger.warning(
                "%s failed (%s: %s); retry %d of %d in %.1f s",
                what,
                type(exc).__name__,
                exc,
                attempt,
                attempts - 1,
                delay,
            )
            time.sleep(delay * _jitter.uniform(0.75, 1.25))
            delay = min(delay * 2, max_s)
    raise AssertionError("unreachable")


def write_files(
    fs: Any, dest: str, writers: dict[str, FileWriter], *, attempts: int = 5
) -> dict[str, dict[str, Any]]:
    """Write each ``name -> writer`` into directory ``dest`` on ``fs``, retrying transient errors.

    Returns:
        ``{name: {"size": bytes, "sha256": hex}}``, what the manifest records.

    Raises:
        OSError (or the storage's own error): when the storage still fails after ``attempts``
        tries, or at once for a permanent error (missing bucket, no permission).
    """

    def write_all() -> dict[str, dict[str, Any]]:
        files: dict[str, dict[str, Any]] = {}
        fs.makedirs(dest, exist_ok=True)
        for name, write in writers.items():
            target = storage.join(fs, dest, name)
            with fs.open(target, "wb") as raw:
                out = _HashingWriter(raw)
                write(out)
                storage._fsync(raw)
            files[name] = {"size": out.size, "sha256": out.sha.hexdigest()}
        return files

    return dict(retry(write_all, what=f"writing checkpoint files to {dest}", attempts=attempts))


class AsyncCheckpointWriter:
    """One background thread that writes checkpoints while training goes on.

    ``submit(job)`` first waits for the previous job, then starts ``job`` on a new thread;
    ``wait()`` blocks until the current job (if any) has finished. Jobs report their own outcome
    (the session sends it to the driver), so a failed write never raises into the training loop.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> float:
        """Block until the in-flight write is done (or ``timeout_s`` seconds have passed).
        Returns the seconds spent waiting."""
        if self._thread is None:
            return 0.0
        start = time.perf_counter()
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._thread = None
        return time.perf_counter() - start

    def submit(self, job: Callable[[], None]) -> float:
        """Start ``job`` in the background. Returns the seconds spent waiting for the previous."""
        waited = self.wait()
        self._thread = threading.Thread(target=job, name="ringtrain-checkpoint-writer", daemon=True)
        self._thread.start()
        return waited
