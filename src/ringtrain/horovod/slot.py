"""The process's one Horovod runtime slot.

Horovod's API is module-level by contract (``hvd.init()``, ``hvd.rank()`` and a
``ProcessSet``'s ``size()`` take no context), so the runtime :func:`ringtrain.horovod.init`
creates lives here: set by ``init()``, cleared by ``shutdown()``, guarded by :data:`lock`. It is a
module of its own so that :mod:`ringtrain.horovod.process_sets` (whose sets look their view up)
and :mod:`ringtrain.horovod.runtime` (which registers the sets) both import it without importing
each other.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ringtrain.horovod.runtime import Runtime

#: The one Runtime of this process (``None`` before ``hvd.init()`` and after ``hvd.shutdown()``).
current: Runtime | None = None
lock = threading.Lock()


def runtime() -> Runtime:
    """The runtime :func:`ringtrain.horovod.init` created.

    Raises:
        ValueError: before ``hvd.init()`` (Horovod's error).
    """
    rt = current
    if rt is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return rt
