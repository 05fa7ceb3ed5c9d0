"""Tests for ringtrain.monitor.console_io: terminal writes are never cut short.

The bug they guard against: under ``PYTHONUNBUFFERED=1`` a write to ``sys.stdout`` that a signal
cut short (Linux stops a tty write between two 2048-byte chunks when a signal is pending) lost
the rest of the text silently; the live panel's final frame was left cut mid-row.
"""

from __future__ import annotations

import contextlib
import io
import os
import pty
import select
import signal
import threading
import time
import tty
from typing import Any

import pytest
from rich.console import Console
from rich.file_proxy import FileProxy

from ringtrain.monitor import console_io
from ringtrain.monitor.console_io import WholeWrites, write_all, write_whole


def test_write_all_finishes_partial_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that takes at most 1000 bytes per write(2): every byte still arrives, in order."""
    taken: list[bytes] = []

    def short_write(fd: int, data: Any) -> int:
        chunk = bytes(data[:1000])
        taken.append(chunk)
        return len(chunk)

    monkeypatch.setattr(console_io.os, "write", short_write)
    data = bytes(range(256)) * 40  # 10240 bytes
    write_all(99, data)
    assert b"".join(taken) == data and len(taken) == 11


def test_write_all_waits_for_a_full_non_blocking_pipe() -> None:
    """A non-blocking pipe that fills up (EAGAIN): the writer waits for room instead of
    dropping the rest or raising BlockingIOError."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    data = os.urandom(1 << 20)  # 16 times a pipe's default 64 KiB
    got = bytearray()

    def read_slowly() -> None:
        while len(got) < len(data):
            chunk = os.read(r, 65536)
            if not chunk:
                break
            got.extend(chunk)
            time.sleep(0.001)

    reader = threading.Thread(target=read_slowly)
    reader.start()
    try:
        write_all(w, data)
    finally:
        os.close(w)
        reader.join(timeout=60)
        os.close(r)
    assert bytes(got) == data


def _unbuffered_stdout(fd: int) -> io.TextIOWrapper:
    """What ``sys.stdout`` is under ``PYTHONUNBUFFERED=1``: a text layer over an unbuffered file."""
    return io.TextIOWrapper(
        io.FileIO(fd, "w", closefd=False), encoding="utf-8", line_buffering=True, write_through=True
    )


def test_a_terminal_write_interrupted_by_signals_arrives_whole() -> None:
    """A real pseudo-terminal read slowly, and a signal sent to the writing thread every
    millisecond while it writes 256 KiB through WholeWrites: the reader gets every byte, in
    order (the signals did arrive during the write)."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no newline translation: bytes out == bytes in
    stream = _unbuffered_stdout(slave)
    text = "".join(f"{i:07d}\n" for i in range(32768))  # 256 KiB: far more than the pty holds
    got = bytearray()
    done = threading.Event()
    delivered: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: delivered.append(signum))

    def read_slowly() -> None:  # until the writer is done and nothing more comes
        while len(got) < len(text):
            if select.select([master], [], [], 0.2)[0]:
                got.extend(os.read(master, 4096))
                time.sleep(0.0005)
            elif done.is_set():
                break

    def write() -> None:
        try:
            WholeWrites(stream).write(text)
        finally:
            done.set()

    writer = threading.Thread(target=write)
    reader = threading.Thread(target=read_slowly)
    try:
        writer.start()
        reader.start()
        assert writer.ident is not None
        while not done.is_set():
            signal.pthread_kill(writer.ident, signal.SIGUSR1)
            time.sleep(0.001)
        writer.join(timeout=60)
        reader.join(timeout=60)
    finally:
        signal.signal(signal.SIGUSR1, previous)
        os.close(slave)
        os.close(master)
    assert delivered, "no signal reached the writer during its write: the test proved nothing"
    assert got.decode() == text


def test_write_whole_goes_through_the_descriptor_after_what_the_stream_holds(
    tmp_path: Any,
) -> None:
    """Buffered text first, then the whole write, in the stream's encoding; stderr's
    ``backslashreplace`` is kept for characters the encoding lacks."""
    path = tmp_path / "out.txt"
    with open(path, "w", encoding="ascii", errors="backslashreplace") as stream:
        stream.write("held in the buffer; ")
        write_whole(stream, "then whole: \u2501\n")
    assert path.read_text() == "held in the buffer; then whole: \\u2501\n"


def test_streams_without_a_descriptor_and_live_proxies_get_plain_writes() -> None:
    """A StringIO has no descriptor; rich's FileProxy (a live display's sys.stdout) has the
    terminal's, but must draw the text itself (above the display), so it gets ``write``."""
    buf = io.StringIO()
    write_whole(buf, "plain\n")
    assert buf.getvalue() == "plain\n"

    r, w = os.pipe()
    try:
        behind = io.TextIOWrapper(io.FileIO(w, "w", closefd=False), write_through=True)
        printed = io.StringIO()
        proxy = FileProxy(Console(file=printed, width=40), behind)
        assert proxy.fileno() == w  # it would have been written past the display otherwise
        write_whole(proxy, "from a worker\n")  # type: ignore[arg-type]
        assert "from a worker" in printed.getvalue()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 100)  # nothing went to the descriptor directly
    finally:
        os.close(r)
        os.close(w)


def test_a_stream_whose_descriptor_is_elsewhere_gets_its_own_write() -> None:
    """Like a Jupyter kernel's ``OutStream``: a text stream (not a TextIOWrapper) whose
    ``fileno()`` is the kernel's terminal while its ``write`` goes to the notebook cell. The
    text must go where ``write`` sends it."""
    r, w = os.pipe()

    class CellStream(io.TextIOBase):
        def __init__(self) -> None:
            self.cell: list[str] = []

        def write(self, text: str) -> int:
            self.cell.append(text)
            return len(text)

        def fileno(self) -> int:
            return w  # the terminal the kernel was started from

    try:
        stream = CellStream()
        write_whole(stream, "(rank 0) epoch 1\n")  # type: ignore[arg-type]
        WholeWrites(stream).write("a frame\n")  # type: ignore[arg-type]
        assert stream.cell == ["(rank 0) epoch 1\n", "a frame\n"]
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 100)
    finally:
        os.close(r)
        os.close(w)


def test_a_console_on_whole_writes_sees_the_streams_terminal() -> None:
    """rich detects a terminal, its encoding and descriptor through WholeWrites as it would on
    the stream itself (the live panel still starts on a terminal, plain lines elsewhere)."""
    master, slave = pty.openpty()
    try:
        on_tty = _unbuffered_stdout(slave)
        assert Console(file=WholeWrites(on_tty)).is_terminal
        assert WholeWrites(on_tty).fileno() == slave and WholeWrites(on_tty).encoding == "utf-8"
        assert not Console(file=WholeWrites(io.StringIO())).is_terminal
    finally:
        os.close(slave)
        os.close(master)


def test_the_final_panel_frame_arrives_whole_while_signals_arrive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CI failure this module fixes, end to end: the live panel (as ``make_progress``
    makes it) on a 200-column pseudo-terminal that is read slowly, stdout unbuffered as under
    ``PYTHONUNBUFFERED=1``, signals arriving at the main thread while ``close`` writes the
    final frame: the frame arrives whole (its bottom border, then the newline) and nothing of
    it is lost."""
    from ringtrain.monitor.progress import RichProgress, make_progress

    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("LINES", "50")
    master, slave = pty.openpty()
    tty.setraw(slave)
    stream = _unbuffered_stdout(slave)
    got = bytearray()
    closed = threading.Event()
    stop_reading = threading.Event()
    delivered: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: delivered.append(signum))
    main = threading.main_thread().ident
    assert main is not None

    def read_slowly() -> None:  # a terminal too busy to keep up: 256 bytes per millisecond
        time.sleep(0.3)  # close() is blocked on the full terminal by then
        while not stop_reading.is_set():
            if select.select([master], [], [], 0.05)[0]:
                got.extend(os.read(master, 256))
                time.sleep(0.001)

    def signal_main() -> None:
        while not closed.is_set():
            signal.pthread_kill(main, signal.SIGUSR1)
            time.sleep(0.0002)

    # make_progress's console, in a panel that does not redraw by itself meanwhile (a redraw
    # blocked on the full terminal would hold the panel, and the write under test would be its).
    made = make_progress("rich", stream)
    assert isinstance(made, RichProgress)
    progress = RichProgress(made.console, refresh_per_second=0.01)
    reader = threading.Thread(target=read_slowly)
    signaller = threading.Thread(target=signal_main)
    try:
        progress.start("w200", 16, "runs/w200")  # 16 rows: a frame of ~6 KB, three tty chunks
        for rank in range(16):
            progress.worker_state(rank, "running")
            progress.report(rank, 0, {"loss": 1.25})
        os.set_blocking(slave, False)  # fill the terminal, so that the final frame must wait
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(slave, b"." * 1024)
        os.set_blocking(slave, True)
        reader.start()
        signaller.start()
        progress.close("ABORTED")
        closed.set()
        signaller.join(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not got.endswith(b"\x1b[?25h"):
            time.sleep(0.05)  # the reader catches up with the last frame
    finally:
        closed.set()
        stop_reading.set()
        signal.signal(signal.SIGUSR1, previous)
        reader.join(timeout=10)
        os.close(slave)
        os.close(master)
    assert delivered, "no signal arrived during close(): the test proved nothing"
    last = bytes(got).decode("utf-8", errors="replace").rsplit("\r\x1b[2K", 1)[-1]
    assert "ABORTED" in last and "16 stopped" in last, last[-2000:]
    assert last.count("\u256d") == 1 and last.count("\u2570") == 1, last[-2000:]  # ╭ and ╰
    assert last.endswith("\n\x1b[?25h"), repr(last[-300:])  # the line after it, cursor shown


def _chaos_line(stream: Any, plan: list[str]) -> str:
    """``ringtrain chaos``'s display prints a run's planned faults; returns the expected end."""
    from ringtrain.chaos.display import Display
    from ringtrain.chaos.report import RunReport

    Display("plain", file=stream).run_started(RunReport(2, 1, "0:2:1", []), plan)
    return f"{plan[-1]} (seed 0:2:1)"


def _sweep_line(stream: Any, plan: list[str]) -> str:
    """``ringtrain tune``'s plain display prints one line per trial event."""
    from ringtrain.tune.progress import SweepDisplay

    text = "; ".join(plan)
    SweepDisplay("sweep", "loss", "min", [], mode_display="plain", stream=stream).line(text)
    return plan[-1]


def _cli_say(stream: Any, plan: list[str]) -> str:
    """The other lines of the ``ringtrain`` commands (``run``'s last words, ``export``, the best
    trial of ``tune``, usage errors) go through ``cli.common.say`` to stdout and stderr."""
    import sys

    from ringtrain.cli.common import say

    text = "; ".join(plan)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = stream
    try:
        say(text[: len(text) // 2])
        say(text[len(text) // 2 :], err=True)
    finally:
        sys.stdout, sys.stderr = saved
    return plan[-1]


@pytest.mark.parametrize(
    "display", [_chaos_line, _sweep_line, _cli_say], ids=["chaos", "tune", "say"]
)
@pytest.mark.parametrize("buffered", [True, False], ids=["stdout", "PYTHONUNBUFFERED"])
def test_cli_displays_reach_a_full_non_blocking_pipe_whole(buffered: bool, display: Any) -> None:
    """``ringtrain chaos``'s and ``ringtrain tune``'s displays (as ``ls``/``show``/``bench``:
    tests/e2e/test_cli.py) write whole into a non-blocking pipe whose reader has not read yet:
    before, what did not fit in the pipe was lost, and nothing said so."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    if buffered:
        stream: Any = open(w, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    else:
        stream = _unbuffered_stdout(w)
    plan = [f"kill rank {i % 4} at step {i}" for i in range(6000)]  # ~130 KB: 2 pipes full
    got = bytearray()
    written = threading.Event()
    probe = os.dup(w)  # the reader's own view of the write end (w is closed under it)

    def read_once_full() -> None:
        # until the pipe has less room than one atomic write (PIPE_BUF): full for any writer
        while not written.is_set() and select.select([], [probe], [], 0)[1]:
            time.sleep(0.01)
        os.close(probe)
        while chunk := os.read(r, 65536):
            got.extend(chunk)

    reader = threading.Thread(target=read_once_full, daemon=True)
    reader.start()
    try:
        end = display(stream, plan)
        stream.flush()
    finally:
        written.set()
        with contextlib.suppress(OSError):  # a writer that failed may fail again at close
            stream.close()
        os.close(w)
        reader.join(timeout=60)
        os.close(r)
    text = got.decode()
    assert "kill rank 0 at step 0; kill rank 1 at step 1" in text[:200], text[:200]
    assert text.rstrip().endswith(end), text[-200:]
