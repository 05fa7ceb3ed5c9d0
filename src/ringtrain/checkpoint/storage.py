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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CHUNK = 1 << 20
_CKPT_RE = re.compile(r"^checkpoint_(\d{6,})$")


def protocols(fs: Any) -> set[str]:
    """The protocol names of an fsspec filesystem (``{"file", "local"}`` for local disks)."""
    protocol = getattr(fs, "protocol", ())
    return {protocol} if isinstance(protocol, str) else set(protocol)


def is_local_fs(fs: Any) -> bool:
    """Whether ``fs`` is the local disk, without importing fsspec (workers import this module
    on every start; fsspec is loaded only when a checkpoint is actually written)."""
    return bool(protocols(fs) & {"file", "local"})


def checkpoint_dirname(round_: int) -> str:
    return f"checkpoint_{round_:06d}"


def staging_dirname(round_: int) -> str:
    return checkpoint_dirname(round_) + ".tmp"


def parse_round(dirname: str) -> int | None:
    m = _CKPT_RE.match(dirname)
    return int(m.group(1)) if m else None


def join(fs: Any, *parts: str) -> str:
    if is_local_fs(fs):
        return os.path.join(*parts)
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts))


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


def publish(
    fs: Any, run_path: str, round_: int, files: dict[str, dict[str, Any]], metrics: dict[str, Any]
) -> str:
    """Write the manifest into the staging directory of ``round_`` and rename it into place.

    Returns:
        The published checkpoint directory's path.
    """
    staging = join(fs, run_path, staging_dirname(round_))
    final = join(fs, run_path, checkpoint_dirname(round_))
    manifest = {
        "format": MANIFEST_FORMAT,
        "round": round_,
        "created": time.time(),
        "metrics": metrics,
        "files": files,
    }
    with fs.open(join(fs, staging, MANIFEST), "w") as f:
        f.write(json.dumps(manifest, indent=1, default=repr))
        _fsync(f)
    if fs.exists(final):  # a leftover of an earlier run with the same name and round
        fs.rm(final, recursive=True)
    if is_local_fs(fs):
        _fsync_dir(staging)
        os.replace(staging, final)
        _fsync_dir(run_path)
    else:
        fs.mv(staging, final, recursive=True)
    return final


def read_manifest(fs: Any, ckpt_path: str, verify_checksums: bool = False) -> dict[str, Any]:
    """Read and check a checkpoint's manifest.

    Raises:
        ValueError: if the manifest is missing or malformed, a file is missing, or a size (or with
            ``verify_checksums`` a SHA-256) differs from what the manifest records.
    """
    mpath = join(fs, ckpt_path, MANIFEST)
    try:
        with fs.open(mpath, "r") as f:
            manifest = json.loads(f.read())
    except FileNotFoundError as exc:
        raise ValueError(f"{ckpt_path}: no {MANIFEST} (an incomplete checkpoint)") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ckpt_path}: {MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{ckpt_path}: {MANIFEST} has no 'files' table")
    for rel, info in manifest["files"].items():
        path = join(fs, ckpt_path, rel)
        try:
            size = fs.size(path)
        except FileNotFoundError as exc:
            raise ValueError(f"{ckpt_path}: file {rel} listed in the manifest is missing") from exc
        if size != info.get("size"):
            raise ValueError(
                f"{ckpt_path}: file {rel} has {size} bytes, the manifest says {info.get('size')}"
            )
        if verify_checksums and file_digest(fs, path)["sha256"] != info.get("sha256"):
            raise ValueError(f"{ckpt_path}: file {rel} does not match its SHA-256 in the manifest")
    return manifest
