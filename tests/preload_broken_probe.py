"""A module whose import fails (tests/multiprocess/test_pool.py): a zygote that preloads it says
so and goes on forking; a worker that imports it raises its own error."""

from __future__ import annotations

raise RuntimeError("preload_broken_probe cannot be imported")
