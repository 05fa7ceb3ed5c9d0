"""Terminal writes that are never cut short: the live panel's frames and forwarded worker output.

Why: ``write(2)`` to a terminal may return early: Linux writes to a tty in chunks of 2048 bytes
and stops between two chunks when a signal is pending for the writing thread (any signal with a
handler, a Ctrl-C held by :func:`ringtrain.monitor.interrupts.held_ctrl_c` included), or when a
non-blocking terminal's buffer is full. Python's own streams do not always write the rest: under
``PYTHONUNBUFFERED=1`` (``python -u``; set on many machines and CI systems) ``sys.stdout`` is a
text layer over an unbuffered file, and ``TextIOWrapper.write`` ignores how many bytes the file
took (``_textiowrapper_writeflush`` in CPython's ``Modules/_io/textio.c``): the rest of the text
is dropped, silently. A live panel's frame is 3-4 KB at 200 columns; a dropped tail left the
final panel cut after 2048 bytes, mid-row, and the next line printed continued that row.

:class:`WholeWrites` is the file a :class:`rich.console.Console` draws on: it encodes the text
itself and writes every byte to the stream's file descriptor, looping over partial writes and
waiting for a non-blocking descriptor to take more (:func:`write_all`).
"""

from __future__ import annotations

import io
import os
import select
import sys
from typing import TYPE_CHECKING, TextIO, cast

from ringtrain.monitor.interrupts import held_ctrl_c

if TYPE_CHECKING:
    from rich.live import Live

__all__ = ["WholeWrites", "stop_live", "whole_writes", "write_all", "write_whole"]


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to file descriptor ``fd``.

    Loops over partial writes (``os.write`` returns how many bytes the kernel took); on a
    non-blocking descriptor that is full, waits until it can take more (``select``). An
    interrupted write is retried by ``os.write`` itself (PEP 475) unless a signal handler raises.

    Args:
        fd: An open file descriptor.
        data: The bytes to write.

    Raises:
        OSError: as ``os.write`` does (a closed descriptor, ``EIO`` on a hung-up terminal,
            ``BrokenPipeError``).
    """
    view = memoryview(data)
    while view:
        try:
            n = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [])
            continue
        view = view[n:]


def write_whole(stream: TextIO, text: str) -> None:
    """Write ``text`` to ``stream`` whole. A ``TextIOWrapper`` on a file descriptor (``sys.stdout``
    and ``sys.stderr`` of a plain process, a file) is written through the descriptor with
    :func:`write_all` (what the stream holds is flushed first, so the order is kept), encoded
    with the stream's encoding and error handler. Any other stream gets ``stream.write(text)``:
    one without a descriptor (``io.StringIO``, a capture), and those whose ``fileno()`` is not
    where their text goes: a live display's stand-in for ``sys.stdout`` (rich's ``FileProxy``,
    which prints above the display) and a Jupyter kernel's ``OutStream`` (whose ``fileno()`` is
    the kernel's terminal, not the notebook cell).

    Args:
        stream: A text stream (``sys.stdout``, ``sys.stderr``, a file, a ``StringIO``).
        text: The text to write.

    Raises:
        UnicodeEncodeError: ``text`` cannot be encoded with the stream's encoding (and its error
            handler is ``strict``), as ``stream.write`` would raise.
        OSError: see :func:`write_all`.
    """
    if not isinstance(stream, io.TextIOWrapper):  # its own write decides where the text goes
        stream.write(text)
        return
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # io.UnsupportedOperation (a capture over io.BytesIO)
        stream.write(text)
        return
    data = text.encode(
        getattr(stream, "encoding", None) or "utf-8", getattr(stream, "errors", None) or "strict"
    )
    stream.flush()
    write_all(fd, data)


class WholeWrites:
    """A text file for :class:`rich.console.Console` whose every ``write`` reaches the stream
    whole (see the module docstring). Everything else (``isatty``, ``fileno``, ``encoding``) is
    the stream's, so rich detects the terminal as it would on the stream itself.

    Args:
        stream: The stream to write to; ``sys.stdout`` as it is when this is made, if None.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream: TextIO = stream if stream is not None else sys.stdout

    @property
    def encoding(self) -> str:
        """The stream's encoding (``"utf-8"`` when it names none)."""
        return getattr(self.stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        """Writes ``text`` whole; returns its length in characters."""
        write_whole(self.stream, text)
        return len(text)

    def flush(self) -> None:
        """Flushes the stream (a whole write leaves nothing buffered here)."""
        self.stream.flush()

    def isatty(self) -> bool:
        """Whether the stream is a terminal."""
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        """The stream's file descriptor.

        Raises:
            OSError: the stream has none (``io.UnsupportedOperation``).
        """
        return self.stream.fileno()


def whole_writes(stream: TextIO | None = None) -> TextIO:
    """:class:`WholeWrites` on ``stream`` (``sys.stdout`` if None), typed as the text file
    ``rich.console.Console(file=...)`` takes."""
    return cast(TextIO, WholeWrites(stream))


def stop_live(live: Live) -> None:
    """Stop a rich live display, leaving its final frame on screen whole: a Ctrl-C that comes
    while the frame is written is held and raised right after (raised inside the write, it
    would cut the frame mid-row, and the next line printed would continue that row); a write
    that a signal cuts short is finished by the console's file when it is :class:`WholeWrites`.

    Raises:
        KeyboardInterrupt: after the frame, if a Ctrl-C came while it was written.
    """
    with held_ctrl_c():
        live.stop()
