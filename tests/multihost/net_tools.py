"""Small network programs the multi-host tests run on a bed's hosts (``python net_tools.py
COMMAND ...``): a TCP sink that prints its port, a client that connects or sends bytes and
prints how long it took."""

from __future__ import annotations

import socket
import sys
import time


def sink(host: str) -> None:
    """Accept connections on ``host`` (port chosen by the OS, printed) and drain them."""
    server = socket.create_server((host, 0))
    print(server.getsockname()[1], flush=True)
    while True:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 16):
                pass


def send(host: str, port: int, nbytes: int, timeout_s: float) -> None:
    """Connect and send ``nbytes``; print the seconds it took, or the error."""
    start = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(b"x" * nbytes)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)  # until the sink has read everything and closed
    except OSError as exc:
        print(f"error {type(exc).__name__}: {exc}", flush=True)
        return
    print(f"{time.monotonic() - start:.3f}", flush=True)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "sink":
        sink(args[0])
    else:
        send(args[0], int(args[1]), int(args[2]), float(args[3]))
