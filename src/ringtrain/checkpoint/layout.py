"""The names and layout of a checkpoint directory: ``checkpoint_{r:06d}`` (and its staging
``.tmp``), ``manifest.json`` and the canonical bytes its HMAC signs, path joining on local and
remote fsspec filesystems. No I/O; :mod:`ringtrain.checkpoint.storage` writes and verifies.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from typing import Any

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
CHUNK = 1 << 20
MAX_MANIFEST_BYTES = 64 << 20
_CKPT_RE = re.compile(r"^checkpoint_(\d{6,})$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_DRIVE_RE = re.compile(r"^[A-Za-z]:")  # C:x is absolute-ish on Windows


class ManifestError(ValueError):
    """A checkpoint's manifest is missing, unsigned, malformed, or does not match the files."""


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


def manifest_body(manifest: dict[str, Any]) -> bytes:
    """The canonical bytes the manifest's ``hmac`` signs: every field but ``hmac``, as sorted,
    compact JSON (floats round-trip exactly, so a parsed manifest gives the same bytes)."""
    body = {k: v for k, v in manifest.items() if k != "hmac"}
    normal = json.loads(json.dumps(body, default=repr, allow_nan=True))
    return json.dumps(normal, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def run_name(run_path: str) -> str:
    """The run's name: the last component of its directory."""
    return run_path.rstrip("/").replace(os.sep, "/").rsplit("/", 1)[-1]


def check_relpath(rel: Any, ckpt_path: str = "") -> str:
    """``rel`` if it is a safe path of a file inside a checkpoint directory: a non-empty
    relative POSIX path, already normalised, without ``..``, ``.``, empty or absolute parts,
    backslashes, NUL or a drive letter (``C:``), and not the manifest itself.

    Raises:
        ManifestError: naming the path.
    """
    if not isinstance(rel, str) or not rel or len(rel) > 4096:
        raise ManifestError(f"{ckpt_path}: {MANIFEST} lists a file with an invalid name {rel!r}")
    bad = (
        rel.startswith("/")
        or "\\" in rel
        or "\0" in rel
        or _DRIVE_RE.match(rel) is not None
        or posixpath.normpath(rel) != rel
        or any(part in ("", ".", "..") for part in rel.split("/"))
        or rel == MANIFEST
    )
    if bad:
        raise ManifestError(
            f"{ckpt_path}: {MANIFEST} lists {rel!r}, which is not a plain relative path inside "
            "the checkpoint directory: refusing the checkpoint"
        )
    return rel
