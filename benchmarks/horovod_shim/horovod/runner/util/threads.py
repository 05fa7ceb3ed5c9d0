"""``horovod.runner.util.threads.in_thread``, which Horovod's ``test/utils/common.py`` imports."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(
    target: Callable[..., Any],
    args: tuple = (),
    name: str | None = None,
    daemon: bool = True,
    silent: bool = False,
) -> threading.Thread:
    """Run ``target(*args)`` in a started thread and return the thread (exceptions are printed
    by the thread unless ``silent``)."""

    def run() -> None:
        try:
            target(*args)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread
