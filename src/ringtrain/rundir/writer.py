"""The one writer of the run directory (layout and schema: docs/run-directory.md and
:mod:`ringtrain.rundir.schema`)."""

from __future__ import annotations

import json
import os
from typing import Any

import fsspec

from ringtrain.checkpoint.storage import is_local_fs, join
from ringtrain.rundir.reader import read_events
from ringtrain.rundir.run_records import ResultRecord
from ringtrain.rundir.schema import EVENTS_FILE, RESULT_FILE, EventRecord


def _json(obj: Any) -> str:
    return json.dumps(obj, default=repr, allow_nan=True)


class RunDirectory:
    """The driver's writer for ``{storage_path}/{name}/``.

    Args:
        storage_path: local directory or fsspec URL.
        name: the run's name (a directory name).
    """

    def __init__(self, storage_path: str, name: str) -> None:
        self.fs, base = fsspec.core.url_to_fs(storage_path)
        if is_local_fs(self.fs):
            base = os.path.abspath(base)
        self.path: str = join(self.fs, base, name)
        self.uri: str = self.path if self.is_local else str(self.fs.unstrip_protocol(self.path))
        self.name = name
        self._events: Any = None
        self._buffer: list[str] = []

    @property
    def is_local(self) -> bool:
        return is_local_fs(self.fs)

    def create(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def write_json(self, filename: str, obj: Any) -> None:
        """Write ``obj`` to ``filename`` atomically on local disks (temp file + rename)."""
        self.write_bytes(filename, json.dumps(obj, indent=2, default=repr, allow_nan=True).encode())

    def write_result(self, record: ResultRecord) -> None:
        """Rewrite ``result.json`` atomically on local disks."""
        self.write_json(RESULT_FILE, record.to_json())

    def write_bytes(self, filename: str, data: bytes) -> None:
        """Write ``data`` to ``filename`` atomically on local disks (temp file + rename)."""
        target = join(self.fs, self.path, filename)
        if self.is_local:
            tmp = target + ".tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        else:
            with self.fs.open(target, "wb") as f:
                f.write(data)

    def read_bytes(self, filename: str) -> bytes | None:
        """The content of ``filename``, or None when it does not exist."""
        target = join(self.fs, self.path, filename)
        try:
            return bytes(self.fs.cat_file(target))
        except FileNotFoundError:
            return None

    def events(self) -> list[EventRecord]:
        """The records of ``events.jsonl`` written so far (unreadable lines and kinds this
        version does not know skipped); empty when there is none."""
        self.flush()
        return read_events(self.fs, join(self.fs, self.path, EVENTS_FILE))[0]

    def write(self, record: EventRecord) -> None:
        """Append ``record`` as one line of ``events.jsonl`` (flushed at once on local disks)."""
        line = _json(record.to_json()) + "\n"
        if self.is_local:
            if self._events is None:
                self._events = open(join(self.fs, self.path, EVENTS_FILE), "a")  # noqa: SIM115
            self._events.write(line)
            self._events.flush()
        else:
            # Object stores cannot append: keep the lines and rewrite the file (see flush()).
            self._buffer.append(line)

    def flush(self) -> None:
        if self.is_local:
            if self._events is not None:
                self._events.flush()
            return
        if self._buffer:
            target = join(self.fs, self.path, EVENTS_FILE)
            previous = self.fs.cat_file(target).decode() if self.fs.exists(target) else ""
            with self.fs.open(target, "w") as f:
                f.write(previous + "".join(self._buffer))
            self._buffer.clear()

    def close(self) -> None:
        self.flush()
        if self._events is not None:
            self._events.close()
            self._events = None
