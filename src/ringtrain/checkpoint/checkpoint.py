"""The user-facing checkpoint handle: a directory on any fsspec filesystem."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from ringtrain.checkpoint.storage import is_local_fs


class Checkpoint:
    """A directory of files that together hold a training state.

    A worker builds one from a local directory it wrote (``Checkpoint.from_directory``) and passes
    it to ``report()``; the driver persists the files into the run directory. The ``Checkpoint``
    objects ringtrain hands back (``Result.checkpoint``, ``get_checkpoint()``) point there.

    Args:
        path: the directory, a local path or an fsspec URL (``memory://run/checkpoint_000003``).
        filesystem: the fsspec filesystem; inferred from ``path`` when omitted.
    """

    def __init__(self, path: str | os.PathLike[str], filesystem: Any = None) -> None:
        text = os.fspath(path)
        if filesystem is None:
            import fsspec

            filesystem, stripped = fsspec.core.url_to_fs(text)
            if is_local_fs(filesystem):
                text = os.path.abspath(stripped)
        self.path: str = text
        self.filesystem = filesystem

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """A checkpoint of the files under a local directory.

        Raises:
            FileNotFoundError: if ``path`` is not an existing directory.
        """
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"Checkpoint.from_directory: {path!r} is not a directory")
        from fsspec.implementations.local import LocalFileSystem

        return cls(os.path.abspath(path), LocalFileSystem())

    @property
    def is_local(self) -> bool:
        return is_local_fs(self.filesystem)

    @property
    def uri(self) -> str:
        """The path with its protocol, usable with ``fsspec.open``."""
        if self.is_local:
            return self.path
        return str(self.filesystem.unstrip_protocol(self.path))

    def to_directory(self, path: str | os.PathLike[str] | None = None) -> str:
        """Copy the checkpoint into a local directory (a new temporary one when ``path`` is None)
        and return that directory's path."""
        dest = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="ringtrain_ckpt_")
        os.makedirs(dest, exist_ok=True)
        if self.is_local:
            shutil.copytree(self.path, dest, dirs_exist_ok=True)
        else:
            self.filesystem.get(self.path.rstrip("/") + "/", dest.rstrip("/") + "/", recursive=True)
        return dest

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory with the checkpoint's files, for reading. No copy when the checkpoint
        is already local; otherwise a temporary copy removed on exit."""
        if self.is_local:
            yield self.path
            return
        tmp = self.to_directory()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def __repr__(self) -> str:
        return f"Checkpoint({self.uri!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Checkpoint) and self.uri == other.uri

    def __hash__(self) -> int:
        return hash(self.uri)
