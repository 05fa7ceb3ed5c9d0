"""Imported by a warm pool's zygote when a run preloads it (tests/multiprocess/test_pool.py):
``IMPORTED_IN`` is the pid of the process that imported it, so a forked worker tells its
zygote's import from its own."""

from __future__ import annotations

import os

IMPORTED_IN = os.getpid()
