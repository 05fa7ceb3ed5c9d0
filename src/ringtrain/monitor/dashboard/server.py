"""The dashboard's web server: a read-only page and JSON API over run directories.

Routes (all ``GET``)::

    /                      the page (static/index.html, app.js, app.css and uPlot)
    /static/...            its files, installed with the package (no internet needed)
    /api/runs              the runs table (RunStore.list)
    /api/runs/{name}       one run; ?gen=&metrics=&timing=&timeline= ask only for what is new

On a loopback address the server answers only requests whose ``Host`` is a loopback name (a web
page elsewhere cannot read it through DNS rebinding). Any other address needs a token: every
request must carry it as ``?token=`` (the page then keeps it in a cookie), an
``X-Ringtrain-Token`` header or ``Authorization: Bearer``; anything else gets 401.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote, unquote

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringtrain.monitor.dashboard.data import Cursors, RunStore, clean_json

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "TOKEN_ENV",
    "DashboardServer",
    "create_app",
    "is_loopback",
]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8470
TOKEN_ENV = "RINGTRAIN_DASHBOARD_TOKEN"
"""Environment variable read for the token when none is given (keeps it out of ``ps`` output)."""

STATIC_DIR = Path(__file__).parent / "static"

logger = logging.getLogger("ringtrain")

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.", "ip6-localhost"})

_SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (
        b"content-security-policy",
        b"default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        b"frame-ancestors 'none'",
    ),
]


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``127.0.0.0/8``, ``::1`` or ``localhost``).

    Args:
        host: A host name or IP address, as given to ``--host`` (IPv6 with or without brackets).

    Returns:
        True for loopback addresses and names; False for anything else, ``0.0.0.0`` included.
    """
    name = host.strip().strip("[]").lower()
    if name in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _cookie_name(scope: Scope) -> str:
    # Cookies are shared by every port of a host: one name per port keeps two dashboards apart.
    server = scope.get("server") or ("", 0)
    return f"ringtrain_token_{server[1] or 0}"


class _Gate:
    """ASGI middleware: the token check (or, without a token, the loopback ``Host`` check), the
    security headers, and the time of the last request."""

    def __init__(self, app: ASGIApp, token: str | None, on_request: Any = None) -> None:
        self.app = app
        self.token = token
        self.on_request = on_request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.on_request is not None:
            self.on_request()
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        set_cookie: str | None = None
        if self.token is None:
            host = headers.get("host", "")
            name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
            if not is_loopback(name):
                await self._refuse(
                    scope,
                    receive,
                    send,
                    403,
                    f"this dashboard answers on loopback names only, "
                    f"not {host!r}: open http://127.0.0.1:{(scope.get('server') or ('', 0))[1]}/",
                )
                return
        else:
            given = query.get("token", [None])[-1]
            from_query = given is not None
            if given is None:
                given = headers.get("x-ringtrain-token")
            if given is None and headers.get("authorization", "").lower().startswith("bearer "):
                given = headers["authorization"][7:].strip()
            if given is None and "cookie" in headers:
                jar: SimpleCookie = SimpleCookie()
                with contextlib.suppress(Exception):
                    jar.load(headers["cookie"])
                morsel = jar.get(_cookie_name(scope))
                given = unquote(morsel.value) if morsel is not None else None
            if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
                await self._refuse(
                    scope,
                    receive,
                    send,
                    401,
                    "401 Unauthorized: this dashboard needs its token. Open the URL that "
                    "`ringtrain dashboard` printed (it ends in ?token=...), or send the header "
                    "X-Ringtrain-Token.",
                )
                return
            if from_query:
                value = quote(self.token, safe="")
                set_cookie = f"{_cookie_name(scope)}={value}; Path=/; HttpOnly; SameSite=Strict"

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra = list(_SECURITY_HEADERS)
                if set_cookie is not None:
                    extra.append((b"set-cookie", set_cookie.encode("latin-1")))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    async def _refuse(
        self, scope: Scope, receive: Receive, send: Send, status: int, text: str
    ) -> None:
        response = PlainTextResponse(
            text, status_code=status, headers={"cache-control": "no-store"}
        )
        await response(scope, receive, send)


class _JSON(JSONResponse):
    """Strict JSON (NaN written as the string "NaN": browsers cannot parse NaN), never cached."""

    def render(self, content: Any) -> bytes:
        try:
            text = json.dumps(content, allow_nan=False, separators=(",", ":"))
        except ValueError:
            text = json.dumps(clean_json(content), allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8")


def _int_param(request: Request, name: str) -> int:
    try:
        return max(0, int(request.query_params.get(name, "0")))
    except ValueError:
        return 0


def create_app(path: str, *, token: str | None = None, on_request: Any = None) -> Starlette:
    """Builds the dashboard's ASGI app (what :class:`DashboardServer` serves; tests drive it
    with Starlette's ``TestClient``).

    Args:
        path: A storage path (directory of runs, or a sweep's directory of trials) or one run
            directory; a local path or an fsspec URL.
        token: When given, every request must carry it (see the module docstring); when None,
            only requests addressed to a loopback host name are answered.
        on_request: Called (no arguments) at every request; used to know a page is open.

    Returns:
        The Starlette application.
    """
    store = RunStore(path)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-store"})

    def list_runs(request: Request) -> Response:
        return _JSON(store.list(), headers={"cache-control": "no-store"})

    def run_details(request: Request) -> Response:
        name = request.path_params["name"]
        cursors = Cursors(
            generation=request.query_params.get("gen") or None,
            metrics=_int_param(request, "metrics"),
            timing=_int_param(request, "timing"),
            timeline=_int_param(request, "timeline"),
        )
        data = store.run(name, cursors)
        if data is None:
            return _JSON({"error": f"no run {name!r} under {path}"}, status_code=404)
        return _JSON(data, headers={"cache-control": "no-store"})

    app = Starlette(
        routes=[
            Route("/", index, methods=["GET"]),
            Route("/api/runs", list_runs, methods=["GET"]),
            Route("/api/runs/{name}", run_details, methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
        ]
    )
    app.add_middleware(_Gate, token=token, on_request=on_request)
    return app


def _bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port)."""
    infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    family, socktype, proto, _, address = infos[0]
    sock = socket.socket(family, socktype, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


class DashboardServer:
    """The dashboard, served by uvicorn in a background thread.

    Args:
        path: A storage path or run directory (local path or fsspec URL).
        host: The address to listen on; anything but a loopback address needs ``token``.
        port: The TCP port; 0 picks a free one.
        token: The access token; None reads ``RINGTRAIN_DASHBOARD_TOKEN`` (and an empty value
            means no token).

    Raises:
        ValueError: ``host`` is not a loopback address and there is no token.
    """

    def __init__(
        self,
        path: str,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        token: str | None = None,
    ) -> None:
        if token is None:
            token = os.environ.get(TOKEN_ENV) or None
        if not is_loopback(host) and not token:
            raise ValueError(
                f"the dashboard would listen on {host!r}, which other machines can reach, so it "
                f"needs a token: pass --token SECRET or set {TOKEN_ENV} (or listen on 127.0.0.1 "
                "and use an SSH tunnel)"
            )
        self.path = path
        self.host = host
        self.port = port
        self.token = token
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._requests = threading.Condition()
        self._last_request = 0.0

    @property
    def url(self) -> str:
        """The page's address (with ``?token=`` when there is a token)."""
        host = self.host
        if host in ("0.0.0.0", "::", "[::]"):
            host = socket.gethostname()
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        url = f"http://{host}:{self.port}/"
        return f"{url}?token={quote(self.token, safe='')}" if self.token else url

    def _on_request(self) -> None:
        with self._requests:
            self._last_request = time.time()
            self._requests.notify_all()

    def start(self) -> str:
        """Starts serving in a daemon thread and returns the page's URL once it answers.

        Returns:
            :attr:`url`.

        Raises:
            OSError: The address cannot be listened on (port in use, unknown host).
            RuntimeError: The server did not start within 30 seconds.
        """
        import uvicorn

        sock = _bind(self.host, self.port)
        self.port = int(sock.getsockname()[1])
        app = create_app(self.path, token=self.token, on_request=self._on_request)
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        server = uvicorn.Server(config)
        self._server = server

        def serve() -> None:
            try:
                server.run(sockets=[sock])
            except BaseException as exc:  # reported by start() or logged
                self._error = exc
                logger.error("ringtrain dashboard stopped: %r", exc)
            finally:
                sock.close()

        self._thread = threading.Thread(target=serve, name="ringtrain-dashboard", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the dashboard did not start on {self.host}:{self.port}: {self._error!r}"
                )
            time.sleep(0.02)
        return self.url

    def wait_for_request(self, after: float, timeout_s: float) -> bool:
        """Waits until a request arrives later than ``after``.

        Args:
            after: Unix time in seconds.
            timeout_s: How long to wait at most (seconds).

        Returns:
            Whether such a request arrived in time.
        """
        deadline = time.monotonic() + timeout_s
        with self._requests:
            while self._last_request <= after:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._requests.wait(left)
            return True

    @property
    def last_request(self) -> float:
        """Unix time of the last request (0.0 before any)."""
        return self._last_request

    @property
    def running(self) -> bool:
        """Whether the server thread is alive (started and not stopped or crashed)."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Blocks until the server stops (Ctrl-C in the caller's thread interrupts the wait)."""
        while self._thread is not None and self._thread.is_alive():
            self._thread.join(0.5)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops serving and waits up to ``timeout_s`` seconds for the thread to end."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
