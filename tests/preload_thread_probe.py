"""A module that starts a thread when imported (tests/multiprocess/test_pool.py): a zygote
that preloads it must stop forking (a fork would copy the thread's locks held)."""

from __future__ import annotations

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, name="preload-probe", daemon=True).start()
