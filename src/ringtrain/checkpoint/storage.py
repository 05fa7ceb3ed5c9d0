"""Checkpoint files on fsspec storage: checksummed upload, manifest, atomic publication.

Protocol (one checkpoint, one report round ``r``):

1. Each rank that attached files copies them into ``checkpoint_{r:06d}.tmp/`` under the run
   directory, computing each file's size and SHA-256 while copying, and sends that list with its
   report.
2. When every rank has reported round ``r``, the driver writes ``manifest.json`` (every file, its
   size and checksum) into the temporary directory and renames it to ``checkpoint_{r:06d}``.

A directory without a valid manifest is not a checkpoint. On a local filesystem the rename is
atomic; on object stores (no directory rename) the manifest is written last, after the files
are copied, so the rule still holds.

Trust (docs/security.md): the manifest carries an HMAC-SHA256 (:mod:`ringtrain.checkpoint.
signing`) over its content, which names the run and the round; every path in it is relative,
normalised and confined to the checkpoint directory; every file in the directory must be listed;
files are regular files (no symlinks, devices or FIFOs); and loaders read each file once, hash
those bytes and compare them with the manifest before ``torch.load`` sees them
(:func:`read_verified`).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from typing import Any

from ringtrain.checkpoint.layout import (
    _SHA256_RE,
    CHUNK,
    MANIFEST,
    MANIFEST_FORMAT,
    MAX_MANIFEST_BYTES,
    ManifestError,
    check_relpath,
    checkpoint_dirname,
    is_local_fs,
    join,
    manifest_body,
    parse_round,
    protocols,
    run_name,
    staging_dirname,
)
from ringtrain.checkpoint.signing import Signer


def upload_directory(local_dir: str, fs: Any, dest: str) -> dict[str, dict[str, Any]]:
    """Copy every file under ``local_dir`` to ``dest`` on ``fs``.

    Returns:
        ``{relative_path: {"size": bytes, "sha256": hex}}`` for every file copied (relative paths
        use ``/``).
    """
    files: dict[str, dict[str, Any]] = {}
    fs.makedirs(dest, exist_ok=True)
    for root, _dirs, names in os.walk(local_dir):
        for name in sorted(names):
            src = os.path.join(root, name)
            rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
            target = join(fs, dest, rel)
            parent = target.rsplit("/", 1)[0] if "/" in target else dest
            fs.makedirs(parent, exist_ok=True)
            digest = hashlib.sha256()
            size = 0
            with open(src, "rb") as fin, fs.open(target, "wb") as fout:
                while chunk := fin.read(CHUNK):
                    digest.update(chunk)
                    fout.write(chunk)
                    size += len(chunk)
                _fsync(fout)
            files[rel] = {"size": size, "sha256": digest.hexdigest()}
    return files


def file_digest(fs: Any, path: str) -> dict[str, Any]:
    digest = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": digest.hexdigest()}


def _fsync(f: Any) -> None:
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, ValueError, NotImplementedError):
        pass  # not a local file: the object store commits on close


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_manifest(
    fs: Any,
    ckpt_path: str,
    files: dict[str, dict[str, Any]],
    signer: Signer,
    *,
    run: str,
    round_: int,
    metrics: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write a signed ``manifest.json`` for ``files`` into directory ``ckpt_path``.

    Raises:
        ManifestError: a path in ``files`` is not a safe relative path.
    """
    for rel in files:
        check_relpath(rel, ckpt_path)
    manifest: dict[str, Any] = {
        "format": MANIFEST_FORMAT,
        "run": run,
        "round": round_,
        "created": time.time(),
        "metrics": metrics or {},
        "files": files,
        "key": signer.fingerprint,
    }
    manifest = json.loads(json.dumps(manifest, default=repr, allow_nan=True))
    manifest["hmac"] = signer.sign(manifest_body(manifest), "manifest", run)
    with fs.open(join(fs, ckpt_path, MANIFEST), "w") as f:
        f.write(json.dumps(manifest, indent=1))
        _fsync(f)
    return manifest


def publish(
    fs: Any,
    run_path: str,
    round_: int,
    files: dict[str, dict[str, Any]],
    metrics: dict[str, Any],
    signer: Signer | None = None,
) -> str:
    """Write the signed manifest into the staging directory of ``round_`` and rename it into
    place.

    Args:
        signer: the key that signs the manifest (default: this user's,
            :func:`ringtrain.checkpoint.signing.resolve`).

    Returns:
        The published checkpoint directory's path.
    """
    from ringtrain.checkpoint import signing

    signer = signer or signing.resolve()
    staging = join(fs, run_path, staging_dirname(round_))
    final = join(fs, run_path, checkpoint_dirname(round_))
    write_manifest(
        fs, staging, files, signer, run=run_name(run_path), round_=round_, metrics=metrics
    )
    if fs.exists(final):  # a leftover of an earlier run with the same name and round
        fs.rm(final, recursive=True)
    if is_local_fs(fs):
        _fsync_dir(staging)
        os.replace(staging, final)
        _fsync_dir(run_path)
    else:
        fs.mv(staging, final, recursive=True)
    return final


# ------------------------------------------------------------------------------ verification


def _check_entry(rel: str, info: Any, ckpt_path: str) -> tuple[int, str]:
    check_relpath(rel, ckpt_path)
    if not isinstance(info, dict):
        raise ManifestError(f"{ckpt_path}: {MANIFEST} entry of {rel} is not a table")
    size, sha = info.get("size"), info.get("sha256")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ManifestError(f"{ckpt_path}: {MANIFEST} gives {rel} an invalid size {size!r}")
    if not isinstance(sha, str) or not _SHA256_RE.match(sha):
        raise ManifestError(f"{ckpt_path}: {MANIFEST} gives {rel} an invalid sha256 {sha!r}")
    return size, sha


def _local_target(ckpt_path: str, rel: str) -> str:
    """The local path of ``rel`` in ``ckpt_path``, after checking that no directory on the way
    is a symlink leading out of the checkpoint."""
    root = os.path.realpath(ckpt_path)
    target = os.path.join(ckpt_path, *rel.split("/"))
    parent = os.path.realpath(os.path.dirname(target))
    if parent != root and not parent.startswith(root + os.sep):
        raise ManifestError(f"{ckpt_path}: {rel} lies outside the checkpoint directory")
    return target


def _open_local(ckpt_path: str, rel: str) -> int:
    """A file descriptor of the regular file ``rel``: never follows a symlink, never blocks on
    a FIFO, refuses devices."""
    target = _local_target(ckpt_path, rel)
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(target, flags)
    except FileNotFoundError as exc:
        raise ManifestError(f"{ckpt_path}: file {rel} listed in the manifest is missing") from exc
    except OSError as exc:  # ELOOP: a symlink
        raise ManifestError(
            f"{ckpt_path}: {rel} is not a regular file ({exc.strerror}): refusing the checkpoint"
        ) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ManifestError(f"{ckpt_path}: {rel} is not a regular file: refusing the checkpoint")
    return fd


def _listed_everything(fs: Any, ckpt_path: str, files: dict[str, Any]) -> None:
    """Refuse a checkpoint directory holding anything its manifest does not list (a file a
    loader might pick up), or any symlink."""
    found: list[str] = []
    if is_local_fs(fs):
        for root, dirs, names in os.walk(ckpt_path):
            for name in [*dirs, *names]:
                full = os.path.join(root, name)
                rel = os.path.relpath(full, ckpt_path).replace(os.sep, "/")
                if os.path.islink(full):
                    raise ManifestError(f"{ckpt_path}: {rel} is a symlink: refusing the checkpoint")
                if name in names:
                    found.append(rel)
    else:
        base = ckpt_path.rstrip("/")
        for entry in fs.find(base):
            found.append(entry[len(base) :].lstrip("/"))
    extra = sorted(set(found) - set(files) - {MANIFEST})
    if extra:
        raise ManifestError(
            f"{ckpt_path}: {', '.join(extra[:5])} {'is' if len(extra) == 1 else 'are'} not listed "
            f"in its {MANIFEST}: refusing the checkpoint (never load an unlisted file)"
        )


def read_manifest(
    fs: Any,
    ckpt_path: str,
    verify_checksums: bool = False,
    *,
    signer: Signer | None = None,
    run: str | None = None,
    round_: int | None = None,
) -> dict[str, Any]:
    """Read and check a checkpoint's manifest, before any listed file is opened.

    Checks the manifest's HMAC (``signer``, default: this user's key), that it names run ``run``
    and round ``round_`` (when given), that every path is safe (:func:`check_relpath`), that every
    listed file is a regular file of the recorded size (with ``verify_checksums``: SHA-256) and
    that nothing unlisted is in the directory.

    Raises:
        ManifestError (a ValueError): naming the checkpoint and what is wrong.
        SignatureError (a ValueError): the manifest is not signed with the key (unless the
            signer trusts unsigned data).
    """
    from ringtrain.checkpoint import signing

    signer = signer or signing.resolve()
    manifest = _load_manifest(fs, ckpt_path)
    files = manifest["files"]
    signed_run = manifest.get("run")
    signer.check(
        manifest_body(manifest),
        "manifest",
        str(signed_run),
        manifest.get("hmac"),
        f"checkpoint {ckpt_path}: {MANIFEST}",
    )
    if run is not None and signed_run != run:
        raise ManifestError(
            f"{ckpt_path}: {MANIFEST} belongs to run {signed_run!r}, not {run!r} (copied from "
            "another run?): refusing the checkpoint"
        )
    if round_ is not None and manifest.get("round") != round_:
        raise ManifestError(
            f"{ckpt_path}: {MANIFEST} is for round {manifest.get('round')!r}, not {round_} (an "
            "older checkpoint renamed?): refusing the checkpoint"
        )
    for rel, info in files.items():
        size, sha = _check_entry(rel, info, ckpt_path)
        if is_local_fs(fs):
            fd = _open_local(ckpt_path, rel)
            try:
                actual = os.fstat(fd).st_size
                if actual == size and verify_checksums:
                    digest = _digest_fd(fd, size)
            finally:
                os.close(fd)
        else:
            try:
                entry = fs.info(join(fs, ckpt_path, rel))
            except FileNotFoundError as exc:
                raise ManifestError(
                    f"{ckpt_path}: file {rel} listed in the manifest is missing"
                ) from exc
            if entry.get("type") != "file":
                raise ManifestError(f"{ckpt_path}: {rel} is not a file: refusing the checkpoint")
            actual = entry.get("size")
            if actual == size and verify_checksums:
                data = _read_remote(fs, join(fs, ckpt_path, rel), size)
                digest = hashlib.sha256(data).hexdigest()
        if actual != size:
            raise ManifestError(
                f"{ckpt_path}: file {rel} has {actual} bytes, the manifest says {size}"
            )
        if verify_checksums and digest != sha:
            raise ManifestError(
                f"{ckpt_path}: file {rel} does not match its SHA-256 in the manifest"
            )
    _listed_everything(fs, ckpt_path, files)
    return manifest


def _load_manifest(fs: Any, ckpt_path: str) -> dict[str, Any]:
    mpath = join(fs, ckpt_path, MANIFEST)
    try:
        if is_local_fs(fs):
            if os.path.islink(ckpt_path.rstrip("/")):
                raise ManifestError(f"{ckpt_path} is a symlink: refusing the checkpoint")
            fd = _open_local(ckpt_path, MANIFEST)
            try:
                with os.fdopen(fd, "rb", closefd=False) as f:
                    raw = f.read(MAX_MANIFEST_BYTES + 1)
            finally:
                os.close(fd)
        else:
            with fs.open(mpath, "rb") as f:
                raw = f.read(MAX_MANIFEST_BYTES + 1)
    except (FileNotFoundError, ManifestError) as exc:
        if isinstance(exc, ManifestError) and "missing" not in str(exc):
            raise
        raise ManifestError(f"{ckpt_path}: no {MANIFEST} (an incomplete checkpoint)") from exc
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{ckpt_path}: {MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{ckpt_path}: {MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ManifestError(f"{ckpt_path}: {MANIFEST} has no 'files' table")
    return manifest


def _digest_fd(fd: int, size: int) -> str:
    digest = hashlib.sha256()
    left = size
    os.lseek(fd, 0, os.SEEK_SET)
    while left > 0:
        chunk = os.read(fd, min(CHUNK * 8, left))
        if not chunk:
            break
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def _read_remote(fs: Any, path: str, size: int) -> bytes:
    with fs.open(path, "rb") as f:
        return bytes(f.read(size + 1))


def read_verified(fs: Any, ckpt_path: str, rel: str, info: Any) -> bytes:
    """The bytes of file ``rel`` of a checkpoint, read once and checked against its manifest
    entry ``info`` (size and SHA-256) before anything else sees them: no gap between the check
    and the use.

    Raises:
        ManifestError: the path is unsafe, the file is not a regular file, or its bytes differ
            from the manifest.
    """
    size, sha = _check_entry(rel, info, ckpt_path)
    if is_local_fs(fs):
        fd = _open_local(ckpt_path, rel)
        with os.fdopen(fd, "rb") as f:  # closes fd
            data = f.read(size + 1)
    else:
        data = _read_remote(fs, join(fs, ckpt_path, rel), size)
    if len(data) != size:
        got = str(len(data)) if len(data) <= size else f"more than {size}"
        raise ManifestError(f"{ckpt_path}: file {rel} has {got} bytes, the manifest says {size}")
    if hashlib.sha256(data).hexdigest() != sha:
        raise ManifestError(f"{ckpt_path}: file {rel} does not match its SHA-256 in the manifest")
    return data


def copy_verified(fs: Any, ckpt_path: str, rel: str, info: Any, out_fd: int) -> None:
    """Copy file ``rel`` of a checkpoint into the open file descriptor ``out_fd`` (a private
    ``memfd`` or temporary file), hashing each chunk as it is copied, and check size and SHA-256
    against the manifest entry ``info``: what was checked is exactly what ``out_fd`` holds.

    Raises:
        ManifestError: as :func:`read_verified`; ``out_fd`` then holds partial data.
    """
    size, sha = _check_entry(rel, info, ckpt_path)
    digest = hashlib.sha256()
    copied = 0
    if is_local_fs(fs):
        src: Any = os.fdopen(_open_local(ckpt_path, rel), "rb", buffering=0)
    else:
        src = fs.open(join(fs, ckpt_path, rel), "rb")
    with src:
        while copied <= size:
            chunk = src.read(min(CHUNK * 8, size + 1 - copied))
            if not chunk:
                break
            digest.update(chunk)
            copied += len(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(out_fd, view) :]
    if copied != size:
        got = str(copied) if copied <= size else f"more than {size}"
        raise ManifestError(f"{ckpt_path}: file {rel} has {got} bytes, the manifest says {size}")
    if digest.hexdigest() != sha:
        raise ManifestError(f"{ckpt_path}: file {rel} does not match its SHA-256 in the manifest")


__all__ = [
    "CHUNK",
    "MANIFEST",
    "MANIFEST_FORMAT",
    "MAX_MANIFEST_BYTES",
    "ManifestError",
    "check_relpath",
    "checkpoint_dirname",
    "copy_verified",
    "file_digest",
    "is_local_fs",
    "join",
    "manifest_body",
    "parse_round",
    "protocols",
    "publish",
    "read_manifest",
    "read_verified",
    "run_name",
    "staging_dirname",
    "upload_directory",
    "write_manifest",
]
