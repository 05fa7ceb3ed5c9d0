"""The exception ``hvd`` raises when a collective fails because a peer is gone.

A module of its own so that every part of :mod:`ringtrain.horovod` (the coordinator included)
can raise it without importing the runtime.
"""

from __future__ import annotations

__all__ = ["HorovodInternalError"]


class HorovodInternalError(RuntimeError):
    """A collective failed because a peer is gone (the process group broke).

    Under ringtrain the controller then restarts the whole worker group from the last
    checkpoint (see :mod:`ringtrain.horovod.elastic`); the error is not retried in-process.
    """
