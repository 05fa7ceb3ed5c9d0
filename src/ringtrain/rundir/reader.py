"""The one reader of ``events.jsonl``: incremental, tolerant of a run still being written.

:class:`EventTail` keeps a byte offset and parses only the lines appended since its last read
(the dashboard polls a growing run this way); :class:`EventReader` turns those lines into the typed
records of :mod:`ringtrain.rundir.schema`. ``ringtrain ls``/``show``, the dashboard, sweeps and
the benchmark runner all read through them.

A line is parsed once it is complete; a torn last line (the driver mid-write) waits for the next
read, or, when the caller says the file is final (``final=True``), counts as skipped. Lines that
are not JSON objects with a string ``type`` are skipped and counted; kinds this version does not
know are skipped without being counted (a newer ringtrain wrote them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

from ringtrain.rundir.schema import EVENTS_FILE, EventRecord, parse_event

__all__ = ["EventReader", "EventTail", "ReadableFS", "read_events", "read_json", "run_events"]

_CHUNK_BYTES = 8 << 20


class ReadableFS(Protocol):
    """What the readers need of an fsspec filesystem."""

    def info(self, path: str) -> dict[str, Any]: ...

    def open(self, path: str, mode: str = "rb") -> Any: ...


class EventTail:
    """Reads ``events.jsonl`` incrementally as raw JSON objects, from the byte offset the last
    read stopped at. A file that shrank or was replaced (another inode) is read again from the
    start (see :meth:`check`).

    Args:
        fs: The fsspec filesystem.
        path: The file's path on ``fs``.
    """

    def __init__(self, fs: ReadableFS, path: str) -> None:
        self._fs = fs
        self._path = path
        self._identity: Any = None
        self._partial = b""
        self.offset = 0
        """Bytes of the file consumed so far."""
        self.skipped = 0
        """Lines that were not a JSON object with a ``type``."""

    def check(self) -> bool:
        """Looks at the file; True when it was replaced or truncated and must be read again from
        the start (the offset is then reset to 0)."""
        try:
            info = self._fs.info(self._path)
        except (OSError, ValueError):
            return False
        size = int(info.get("size") or 0)
        identity = info.get("ino")
        reset = size < self.offset or (
            self._identity is not None and identity is not None and identity != self._identity
        )
        self._identity = identity
        if reset:
            self.offset, self._partial, self.skipped = 0, b"", 0
        return reset

    def read_new(self, *, final: bool = False) -> Iterator[dict[str, Any]]:
        """Yields the JSON objects appended since the last read, in file order.

        Args:
            final: The file is complete (a one-shot read): an unparseable last line without its
                newline is counted as skipped instead of waiting for the rest.
        """
        try:
            f = self._fs.open(self._path, "rb")
        except (OSError, ValueError):
            return
        with f:
            f.seek(self.offset)
            while chunk := f.read(_CHUNK_BYTES):
                self.offset += len(chunk)
                # Split on b"\n" only: JSON strings may hold U+2028, which splitlines splits.
                lines = (self._partial + chunk).split(b"\n")
                self._partial = lines.pop()
                for raw in lines:
                    event = self._parse(raw)
                    if event is not None:
                        yield event
        yield from self._last_line(final)

    def _last_line(self, final: bool) -> Iterator[dict[str, Any]]:
        """A last line without its newline: complete if it parses (a strict prefix of a JSON
        object never does), else still being written (or garbage, when ``final``)."""
        if not self._partial.strip():
            return
        try:
            obj = json.loads(self._partial.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            if final:
                self._partial = b""
                self.skipped += 1
            return
        self._partial = b""
        if isinstance(obj, dict) and isinstance(obj.get("type"), str):
            yield obj
        else:
            self.skipped += 1

    def _parse(self, raw: bytes) -> dict[str, Any] | None:
        if not raw.strip():
            return None
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            self.skipped += 1
            return None
        if isinstance(obj, dict) and isinstance(obj.get("type"), str):
            return obj
        self.skipped += 1
        return None


class EventReader:
    """Typed records of ``events.jsonl``, read incrementally (an :class:`EventTail` underneath).

    Args:
        fs: The fsspec filesystem.
        path: The file's path on ``fs``.
    """

    def __init__(self, fs: ReadableFS, path: str) -> None:
        self.tail = EventTail(fs, path)

    @property
    def skipped(self) -> int:
        """Lines that could not be parsed (see :attr:`EventTail.skipped`)."""
        return self.tail.skipped

    def check(self) -> bool:
        """True when the file was replaced or truncated: read again from the start."""
        return self.tail.check()

    def read_new(self, *, final: bool = False) -> list[EventRecord]:
        """The records appended since the last read, in file order; unknown kinds skipped.

        Args:
            final: See :meth:`EventTail.read_new`.
        """
        records = (parse_event(obj) for obj in self.tail.read_new(final=final))
        return [r for r in records if r is not None]


def read_events(fs: ReadableFS, path: str) -> tuple[list[EventRecord], int]:
    """The whole of a (possibly growing) ``events.jsonl``: its records and the number of lines
    skipped as unreadable (a torn last line included). A missing file has none."""
    reader = EventReader(fs, path)
    return reader.read_new(final=True), reader.skipped


def run_events(run_dir: str) -> list[EventRecord]:
    """The records of the ``events.jsonl`` of ``run_dir`` (a local path or fsspec URL), read
    once; empty when there is none."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(run_dir)
    return read_events(fs, path.rstrip("/") + "/" + EVENTS_FILE)[0]


def read_json(fs: ReadableFS, path: str) -> dict[str, Any] | None:
    """A JSON object file (``config.json``, ``result.json``, a manifest); None if it is missing,
    unreadable, invalid or not an object (``result.json`` caught half-written, say)."""
    try:
        with fs.open(path, "rb") as f:
            data = f.read()
        obj = json.loads(bytes(data).decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return obj if isinstance(obj, dict) else None
