"""The live web dashboard: ``ringtrain dashboard`` and ``ringtrain run --dashboard``.

A read-only page (Starlette + uvicorn, charts drawn by the bundled uPlot) over the run
directories of a storage path; see docs/dashboard.md.
"""

from ringtrain.monitor.dashboard.server import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    TOKEN_ENV,
    DashboardServer,
    create_app,
    is_loopback,
)

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TOKEN_ENV",
    "DashboardServer",
    "create_app",
    "is_loopback",
]
