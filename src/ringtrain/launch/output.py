"""A local worker's output on the driver's streams: line by line, prefixed with its rank, a
traceback as one block (:func:`forward`; split from :mod:`ringtrain.launch.local`)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import IO

from ringtrain.monitor.console_io import write_whole

_OUTPUT_LOCK = threading.Lock()
"""Held while one forwarded line or traceback block is written: two ranks' tracebacks never
interleave line by line."""

_TRACEBACK_START = "Traceback (most recent call last):"
_TRACEBACK_MAX_LINES = 1000


def _ends_traceback(line: str) -> bool:
    """The ``ExcType: message`` line that closes a traceback block (not indented, not a
    chained-exception separator, not blank)."""
    text = line.rstrip("\r\n")
    return (
        bool(text)
        and not text[0].isspace()
        and not text.startswith(
            (_TRACEBACK_START, "During handling of the above exception", "The above exception")
        )
    )


def forward(rank: int | str, pipe: IO[bytes], stream_name: str) -> None:
    """Copy a worker's output line by line to the driver's stream, prefixed with its rank
    (``(rank N)``; a name instead of a rank: ``(store)``).

    A traceback the worker prints is copied as one block once its last line (``Type: message``)
    is in, so that it never interleaves with another rank's output; a block the worker could
    not finish (it was stopped mid-print) is copied at end of output with a note saying so."""
    prefix = f"(rank {rank}) " if isinstance(rank, int) else f"({rank}) "
    block: list[str] = []

    def write(lines: list[str]) -> None:
        stream = sys.stdout if stream_name == "stdout" else sys.stderr
        with _OUTPUT_LOCK:
            try:  # whole: a traceback block is often longer than one 2048-byte tty write
                write_whole(stream, "".join(prefix + line for line in lines))
                stream.flush()
            except (ValueError, OSError):
                pass  # the driver's stream was closed (interpreter shutting down)

    try:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            if block:
                block.append(line)
                if _ends_traceback(line) or len(block) >= _TRACEBACK_MAX_LINES:
                    write(block)
                    block = []
            elif line.startswith(_TRACEBACK_START):
                block = [line]
            else:
                write([line])
        if block:
            write([*block, "... (traceback cut short: the worker was stopped)\n"])
    finally:
        with contextlib.suppress(OSError):
            pipe.close()
