"""``ringtrain dashboard`` (and ``ringtrain run --dashboard``): serve the read-only web page of
the runs (:mod:`ringtrain.monitor.dashboard`)."""

from __future__ import annotations

import argparse
import signal
import threading
from typing import TYPE_CHECKING, Any

from ringtrain.cli.common import DASHBOARD_PORT, port_number, say

if TYPE_CHECKING:
    from ringtrain.monitor.dashboard import DashboardServer

DASHBOARD_HELP = """\
Serve a read-only web page of the runs under STORAGE_OR_RUN_DIR (default
./runs; a sweep's directory shows its trials table; a run directory shows that
run): status, metric curves, each worker's step-time breakdown with stragglers
in red, throughput, memory, checkpoints, failures and restarts on a timeline.
It updates every second while runs are going.

It listens on 127.0.0.1 only unless --host says otherwise; any other address
(0.0.0.0 included) needs a token, which every request must then carry: open
the printed URL (it ends in ?token=...). Prefer RINGTRAIN_DASHBOARD_TOKEN to
--token: command lines are visible to other users of the machine.

Examples:
  ringtrain dashboard
  ringtrain dashboard runs/my_sweep --port 8480
  RINGTRAIN_DASHBOARD_TOKEN=$(openssl rand -hex 16) ringtrain dashboard --host 0.0.0.0
  ringtrain run -n 2 --dashboard train.py       the same page, while the run goes
"""


def add_dashboard_parser(sub: Any) -> None:
    """Add the ``dashboard`` subcommand to ``sub`` (an ``add_subparsers()`` result)."""
    dash = sub.add_parser(
        "dashboard",
        help="serve a live web dashboard of the runs (read-only)",
        description=DASHBOARD_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    dash.add_argument(
        "path",
        nargs="?",
        default="./runs",
        metavar="STORAGE_OR_RUN_DIR",
        help="a directory of runs, a sweep's directory or one run directory; a local path or "
        "fsspec URL (default: ./runs)",
    )
    dash.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    dash.add_argument(
        "--port",
        type=port_number,
        default=None,
        help=f"port to listen on (default: {DASHBOARD_PORT}, or a free one if taken; 0: any)",
    )
    dash.add_argument(
        "--token",
        default=None,
        help="require this token on every request (needed off loopback; default: "
        "$RINGTRAIN_DASHBOARD_TOKEN)",
    )


def start_dashboard(
    prog: str, path: str, *, host: str = "127.0.0.1", port: int | None, token: str | None = None
) -> DashboardServer | None:
    """Starts a DashboardServer; on the default port, falls back to a free one if it is taken.
    Prints why and returns None when it cannot start."""
    import errno

    from ringtrain.monitor.dashboard import DashboardServer

    try:
        server = DashboardServer(
            path, host=host, port=DASHBOARD_PORT if port is None else port, token=token
        )
        try:
            server.start()
        except OSError as exc:
            if port is not None or exc.errno != errno.EADDRINUSE:
                raise
            say(f"{prog}: port {DASHBOARD_PORT} is taken; using a free port", err=True)
            server.port = 0
            server.start()
    except ValueError as exc:
        say(f"{prog}: {exc}", err=True)
        return None
    except (OSError, RuntimeError) as exc:
        say(f"{prog}: cannot serve the dashboard on {host}:{port}: {exc}", err=True)
        return None
    return server


def stop_run_dashboard(server: DashboardServer) -> None:
    """Lets an open page fetch the run's final state (up to 3 s), then stops the server."""
    import time

    ended = time.time()
    if server.last_request > ended - 10.0:
        server.wait_for_request(after=ended, timeout_s=3.0)
    server.stop()


def cmd_dashboard(args: argparse.Namespace) -> int:
    """``ringtrain dashboard``: serve the page until Ctrl-C (SIGINT) or SIGTERM; exits 0 then.

    The signal handlers are installed before the server starts and only set a flag: a Ctrl-C
    that arrives while the server starts, while the URL is printed or while the main thread
    waits never raises ``KeyboardInterrupt`` in the middle of that code (which could leave the
    server thread running, or a lock taken, at exit). A second Ctrl-C raises it.
    """
    from fsspec.core import url_to_fs

    try:
        fs, fs_path = url_to_fs(args.path)
        missing = not fs.exists(fs_path)
    except (ImportError, ValueError, OSError) as exc:
        say(f"ringtrain dashboard: cannot open {args.path!r}: {exc}", err=True)
        return 2
    with _StopSignals() as stop:
        server = start_dashboard(
            "ringtrain dashboard", args.path, host=args.host, port=args.port, token=args.token
        )
        if server is None:
            return 2
        try:
            if missing:
                say(
                    f"note: {args.path} does not exist yet; runs appear as they start",
                    err=True,
                )
            say(f"ringtrain dashboard: {args.path} (read-only) at {server.url}")
            say("Ctrl-C to stop", err=True)
            while server.running and not stop.wait(0.5):
                pass
        finally:
            server.stop()
    return 0


class _StopSignals:
    """While entered, SIGINT and SIGTERM set :attr:`event` instead of raising; a second SIGINT
    raises ``KeyboardInterrupt`` (a way out if stopping hangs). The previous handlers come back
    on exit. Outside the main thread (where Python cannot set handlers) it does nothing."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: object) -> None:
        if signum == signal.SIGINT and self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether a stop signal arrived, waiting up to ``timeout_s`` seconds for one."""
        return self.event.wait(timeout_s)

    def __enter__(self) -> _StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
