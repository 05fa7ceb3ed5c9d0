"""The user-facing checkpoint handle: a directory on any fsspec filesystem."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from ringtrain.checkpoint import storage
from ringtrain.checkpoint.storage import is_local_fs


class CheckpointLoadError(RuntimeError):
    """A checkpoint could not be loaded: a file is missing from its manifest, unsafe, does not
    match its SHA-256, or holds something ``torch.load(weights_only=True)`` refuses. The message
    starts with ``could not load checkpoint <uri>``; on a worker, the driver then sets that
    checkpoint aside and resumes from the one before (docs/security.md)."""

    def __init__(self, uri: str, why: str) -> None:
        super().__init__(f"could not load checkpoint {uri}: {why}")
        self.uri = uri


DICT_FILE = "dict.pt"
"""The one file of a :meth:`Checkpoint.from_dict` checkpoint."""


class Checkpoint:
    """A directory of files that together hold a training state.

    A worker builds one from a local directory it wrote (``Checkpoint.from_directory``) and passes
    it to ``report()``; the driver persists the files into the run directory. The ``Checkpoint``
    objects ringtrain hands back (``Result.checkpoint``, ``get_checkpoint()``) point there.

    Args:
        path: the directory, a local path or an fsspec URL (``memory://run/checkpoint_000003``).
        filesystem: the fsspec filesystem; inferred from ``path`` when omitted.
        signing_key: the key its manifest must be signed with (default: this user's key, see
            :mod:`ringtrain.checkpoint.signing`); only needed to read a checkpoint that another
            key signed.
        trust_unsigned: read it even when its manifest is not signed with the key (a warning is
            logged; paths, sizes and SHA-256 are still checked).

    Reading files through ringtrain (``TrainState.restore``, ``export_model``, ``as_directory``,
    the Lightning bridge) reads only files its manifest lists, hashing each as it is read.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        filesystem: Any = None,
        *,
        signing_key: bytes | str | None = None,
        trust_unsigned: bool = False,
    ) -> None:
        text = os.fspath(path)
        if filesystem is None:
            import fsspec

            filesystem, stripped = fsspec.core.url_to_fs(text)
            if is_local_fs(filesystem):
                text = os.path.abspath(stripped)
        self.path: str = text
        self.filesystem = filesystem
        self._signing = (signing_key, trust_unsigned)
        # The verified manifest's file table: handed over by the driver on workers, else read
        # (and its signature checked) on first use. ``_own``: the caller's own files
        # (from_directory), which have no manifest yet.
        self._files: dict[str, dict[str, Any]] | None = None
        self._own = False
        self._copies: dict[str, str] = {}

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

        ckpt = cls(os.path.abspath(path), LocalFileSystem())
        ckpt._own = True
        return ckpt

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Checkpoint:
        """A checkpoint of one dict (Ray AIR's ``Checkpoint.from_dict``): ``report(metrics,
        checkpoint=Checkpoint.from_dict({"model": model.state_dict(), "epoch": epoch}))``, read
        back with :meth:`to_dict`.

        The dict is written with ``torch.save`` to a private temporary directory (removed when
        the handle is garbage-collected; ``report`` copies it first) as the file ``dict.pt``,
        and read back with ``torch.load(weights_only=True)``, like every other checkpoint: it
        may hold tensors and plain data (numbers, strings, bytes, ``None``, dtypes and lists,
        tuples and dicts of them: any ``state_dict()``), never code. Every rank reporting one
        writes the same file name: with identical content (data-parallel replicas) that is one
        file; otherwise the last write wins.

        Args:
            data: a dict with str keys.

        Raises:
            TypeError: ``data`` is not a dict with str keys, or holds an object a weights-only
                load would refuse; the message names where (``data['model'] is a
                torch.nn.modules.linear.Linear``) and the fix.
        """
        from ringtrain.checkpoint.plain import find_unsavable

        if not isinstance(data, Mapping) or not all(isinstance(k, str) for k in data):
            raise TypeError(
                f"Checkpoint.from_dict(data) takes a dict with str keys, got {type(data).__name__}"
            )
        data = dict(data)
        found = find_unsavable(data, "data")
        if found:
            raise TypeError(
                f"Checkpoint.from_dict: {found}, which a checkpoint cannot hold (it is loaded "
                "without running code): save tensors and plain data, e.g. model.state_dict() "
                "instead of the model"
            )
        import torch

        tmp = tempfile.mkdtemp(prefix="ringtrain_dict_")
        torch.save(data, os.path.join(tmp, DICT_FILE))
        ckpt = cls.from_directory(tmp)
        weakref.finalize(ckpt, shutil.rmtree, tmp, ignore_errors=True)
        return ckpt

    def to_dict(self) -> dict[str, Any]:
        """The dict of a :meth:`from_dict` checkpoint (tensors on the CPU), read through the
        manifest (size and SHA-256 checked) and loaded with ``torch.load(weights_only=True)``.

        Raises:
            ValueError: the checkpoint was not made by ``from_dict`` (it has no ``dict.pt``):
                read its files with :meth:`as_directory`.
            CheckpointLoadError: the manifest is missing or unsigned, the file was altered, or
                it holds something a weights-only load refuses.
        """
        from ringtrain.checkpoint.plain import weights_only_refusal

        data = self.read_file(DICT_FILE)
        if data is None:
            raise ValueError(
                f"{self!r} was not made by Checkpoint.from_dict (it has no {DICT_FILE}): read "
                "its files with checkpoint.as_directory()"
            )
        import torch

        try:
            loaded = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        except Exception as exc:
            raise CheckpointLoadError(
                self.uri, f"{DICT_FILE}: {weights_only_refusal(exc)}"
            ) from exc
        if not isinstance(loaded, dict):
            raise CheckpointLoadError(self.uri, f"{DICT_FILE} does not hold a dict")
        return loaded

    # ------------------------------------------------------------------ verified reading
    def verified_files(self) -> dict[str, dict[str, Any]]:
        """The file table of this checkpoint's manifest, ``{relative path: {"size", "sha256"}}``,
        after its signature, paths and sizes were checked (cached).

        Raises:
            CheckpointLoadError: no valid, signed manifest.
        """
        if self._files is None:
            from ringtrain.checkpoint import signing

            try:
                signer = signing.resolve(self._signing[0], None, self._signing[1])
                manifest = storage.read_manifest(self.filesystem, self.path, signer=signer)
            except (ValueError, OSError) as exc:
                raise CheckpointLoadError(self.uri, str(exc)) from exc
            self._files = dict(manifest["files"])
        return self._files

    def set_verified_files(self, files: dict[str, dict[str, Any]] | None) -> None:
        """Adopt the file table of a manifest already verified elsewhere (the driver sends it
        to workers over the authenticated channel). ``None`` leaves it to be read."""
        self._files = None if files is None else dict(files)

    def has_file(self, name: str) -> bool:
        """Whether the manifest lists ``name``.

        Raises:
            CheckpointLoadError: no valid manifest; or ``name`` is not listed but a file of that
                name exists in the directory (never silently ignored).
        """
        if self._own:
            return bool(self.filesystem.exists(self.path.rstrip("/") + "/" + name))
        if name in self.verified_files():
            return True
        if self.filesystem.exists(self.path.rstrip("/") + "/" + name):
            raise CheckpointLoadError(self.uri, f"{name} is not listed in its manifest")
        return False

    def read_file(self, name: str) -> bytes | None:
        """The bytes of file ``name`` (``/``-separated relative path), read once and checked
        against the manifest's size and SHA-256; ``None`` when the manifest does not list it.

        Raises:
            CheckpointLoadError: see :meth:`has_file`; or the bytes differ from the manifest.
        """
        if not self.has_file(name):
            return None
        if self._own:
            with self.filesystem.open(self.path.rstrip("/") + "/" + name, "rb") as f:
                return bytes(f.read())
        try:
            return storage.read_verified(
                self.filesystem, self.path, name, self.verified_files()[name]
            )
        except (ValueError, OSError) as exc:
            raise CheckpointLoadError(self.uri, str(exc)) from exc

    def verified_fd(self, name: str) -> int | None:
        """A private, anonymous in-memory file (Linux ``memfd``) holding file ``name``, copied
        and hashed in one pass and checked against the manifest; ``None`` when the manifest does
        not list it. The caller closes it. Loading from it with ``mmap`` avoids holding the bytes
        twice (a buffer and the tensors made from it).

        Raises:
            CheckpointLoadError: see :meth:`read_file`.
            OSError: ``memfd_create`` is not available (use :meth:`read_file`).
        """
        if not self.has_file(name):
            return None
        fd = os.memfd_create("ringtrain-verified", os.MFD_CLOEXEC)
        try:
            if self._own:
                with self.filesystem.open(self.path.rstrip("/") + "/" + name, "rb") as f:
                    while chunk := f.read(1 << 23):
                        view = memoryview(chunk)
                        while view:
                            view = view[os.write(fd, view) :]
            else:
                info = self.verified_files()[name]
                storage.copy_verified(self.filesystem, self.path, name, info, fd)
        except (ValueError, OSError) as exc:
            os.close(fd)
            if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                raise CheckpointLoadError(self.uri, f"{name}: {exc}") from exc
            raise CheckpointLoadError(self.uri, str(exc)) from exc
        return fd

    def verified_copy(self, name: str) -> str:
        """A private local copy of file ``name``, or of every listed file under directory
        ``name`` (``dir/``: a sharded Lightning checkpoint), verified as copied (cached per
        checkpoint handle): for readers that want a path, such as Lightning.

        Raises:
            CheckpointLoadError: see :meth:`read_file`; ``name`` is not listed.
        """
        if name not in self._copies:
            prefix = name.rstrip("/") + "/"
            members = [name]
            if name.endswith("/"):
                members = [n for n in self.verified_files() if n.startswith(prefix)]
            blobs = {m: self.read_file(m) for m in members}
            if not blobs or any(data is None for data in blobs.values()):
                raise CheckpointLoadError(self.uri, f"{name} is not listed in its manifest")
            root = tempfile.mkdtemp(prefix="ringtrain_verified_")
            # .../checkpoint_NNNNNN/<name>: logs still say which checkpoint it came from.
            label = self.path.rstrip("/").rsplit("/", 1)[-1] or "checkpoint"
            target = os.path.join(root, label, prefix[:-1].replace("/", "_"))
            for member, data in blobs.items():
                path = target if member == name else os.path.join(target, member[len(prefix) :])
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data or b"")
            self._copies[name] = target
        return self._copies[name]

    def release_verified_copies(self) -> None:
        """Delete the private copies :meth:`verified_copy` made (once their reader is done)."""
        for path in self._copies.values():
            shutil.rmtree(os.path.dirname(os.path.dirname(path)), ignore_errors=True)
        self._copies.clear()

    @contextlib.contextmanager
    def verified_directory(self, select: Any = None) -> Iterator[str]:
        """A private local directory (mode 0700, removed on exit) holding the listed files
        (those ``select(name)`` accepts, default all), each verified as it was copied.

        Raises:
            CheckpointLoadError: see :meth:`read_file`.
        """
        tmp = tempfile.mkdtemp(prefix="ringtrain_ckpt_")
        try:
            names = (
                self.verified_files()
                if not self._own
                else {
                    os.path.relpath(os.path.join(r, n), self.path).replace(os.sep, "/"): {}
                    for r, _d, ns in os.walk(self.path)
                    for n in ns
                }
            )
            for name in names:
                if select is not None and not select(name):
                    continue
                data = self.read_file(name)
                assert data is not None
                target = os.path.join(tmp, *name.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

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
        and return that directory's path. A raw copy of whatever is there, manifest included,
        checked by nothing: to read the files, use :meth:`as_directory` (verified)."""
        dest = os.fspath(path) if path is not None else tempfile.mkdtemp(prefix="ringtrain_ckpt_")
        os.makedirs(dest, exist_ok=True)
        if self.is_local:
            shutil.copytree(self.path, dest, dirs_exist_ok=True)
        else:
            self.filesystem.get(self.path.rstrip("/") + "/", dest.rstrip("/") + "/", recursive=True)
        return dest

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory with the checkpoint's files, for reading.

        For a checkpoint with a manifest (every one ringtrain published): a private temporary
        copy of the files the manifest lists, each verified against its SHA-256 as copied,
        removed on exit. For a directory of your own files (``from_directory``): the directory
        itself when local, else a temporary copy.

        Raises:
            CheckpointLoadError: the manifest is missing, unsigned or does not match the files.
        """
        if not self._own:
            with self.verified_directory() as tmp:
                yield tmp
            return
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
