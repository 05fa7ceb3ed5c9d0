"""Hold a Ctrl-C across code that would swallow it, and raise it once that code is done.

Why: ``import torch`` initialises NumPy from C (``torch._C``) and, when that import fails, warns
and goes on without NumPy, whatever the error: a ``KeyboardInterrupt`` raised inside it is
swallowed. A driver that first imports torch when it starts its workers (``ringtrain run``, or a
script that did not import torch itself) then ignored a Ctrl-C that came during those seconds and
started training (under load, 2 of 12 SIGINTs sent in a driver's first seconds). :func:`held_ctrl_c`
holds the SIGINT while the import runs and raises ``KeyboardInterrupt`` right after it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["held_ctrl_c"]


@contextlib.contextmanager
def held_ctrl_c() -> Iterator[None]:
    """While active, a SIGINT is held; when the block ends, ``KeyboardInterrupt`` is raised if
    one came (one or more), else nothing changes.

    Only where Python's own Ctrl-C handler (:func:`signal.default_int_handler`) is installed and
    on the main thread: a handler of the program's own, or an ignored SIGINT, is left alone.
    Keep the block short (an import): a Ctrl-C cannot cut it short.

    Raises:
        KeyboardInterrupt: after the block, if a SIGINT came during it (also when the block
            raised: the Ctrl-C wins, the block's error is its context).
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    came: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        came.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if came:
            raise KeyboardInterrupt
