"""``ringtrain dashboard`` (and ``ringtrain run --dashboard``): serve the read-only web page of
the runs (:mod:`ringtrain.monitor.dashboard`)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from ringtrain.cli.common import DASHBOARD_PORT, port_number

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
            print(f"{prog}: port {DASHBOARD_PORT} is taken; using a free port", file=sys.stderr)
            server.port = 0
            server.start()
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return None
    except (OSError, RuntimeError) as exc:
        print(f"{prog}: cannot serve the dashboard on {host}:{port}: {exc}", file=sys.stderr)
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
    """``ringtrain dashboard``: serve the page until Ctrl-C."""
    from fsspec.core import url_to_fs

    try:
        fs, fs_path = url_to_fs(args.path)
        missing = not fs.exists(fs_path)
    except (ImportError, ValueError, OSError) as exc:
        print(f"ringtrain dashboard: cannot open {args.path!r}: {exc}", file=sys.stderr)
        return 2
    server = start_dashboard(
        "ringtrain dashboard", args.path, host=args.host, port=args.port, token=args.token
    )
    if server is None:
        return 2
    if missing:
        print(f"note: {args.path} does not exist yet; runs appear as they start", file=sys.stderr)
    print(f"ringtrain dashboard: {args.path} (read-only) at {server.url}", flush=True)
    print("Ctrl-C to stop", file=sys.stderr, flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
