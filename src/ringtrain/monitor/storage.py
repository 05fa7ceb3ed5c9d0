"""Reading run directories on any fsspec filesystem: paths, listings, JSON files and checkpoint
manifests, for ``ringtrain ls``/``show`` (:mod:`ringtrain.monitor.runs`), sweeps and the
dashboard. Everything here only reads, and tolerates a run that is still being written."""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ringtrain.monitor.records import CheckpointInfo
from ringtrain.rundir.reader import read_json
from ringtrain.rundir.schema import MANIFEST_FILE

__all__ = [
    "CHECKPOINT_RE",
    "as_dict",
    "as_float",
    "as_int",
    "basename",
    "file_names",
    "invalidate",
    "is_local",
    "join_fs",
    "join_user",
    "list_checkpoints",
    "ls",
    "read_json",
]

CHECKPOINT_RE = re.compile(r"^checkpoint_(\d+)$")
"""A complete checkpoint's directory name (``checkpoint_NNNNNN``, NNNNNN the round)."""


def as_int(value: Any) -> int | None:
    """``value`` as an int (a digit string or an integral float too), else None (bools too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def as_float(value: Any) -> float | None:
    """``value`` as a finite float, else None (bools too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    return None


def as_dict(value: Any) -> dict[str, Any]:
    """A copy of ``value`` if it is a dict, else an empty dict."""
    return dict(value) if isinstance(value, dict) else {}


def join_user(base: str, name: str) -> str:
    """Joins a name onto a user-facing path or URL."""
    if "://" in base:
        return base.rstrip("/") + "/" + name
    return os.path.join(base, name)


def join_fs(base: str, name: str) -> str:
    """Joins a name onto a filesystem-internal (protocol-less, '/'-separated) path."""
    return base.rstrip("/") + "/" + name


def basename(path: str) -> str:
    """The last component of a path or URL."""
    return path.rstrip("/").rsplit("/", 1)[-1]


def is_local(fs: Any) -> bool:
    """Whether ``fs`` is the local disk."""
    return isinstance(fs, LocalFileSystem)


def ls(fs: Any, path: str) -> list[dict[str, Any]]:
    """``fs.ls(path, detail=True)``; empty when ``path`` is missing or not a directory."""
    try:
        entries = fs.ls(path, detail=True)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [e for e in entries if isinstance(e, dict) and "name" in e]


def file_names(entries: list[dict[str, Any]]) -> set[str]:
    """The names of the plain files among a listing's entries."""
    return {basename(str(e["name"])) for e in entries if e.get("type") == "file"}


def invalidate(fs: Any) -> None:
    """Drops cached listings, so a run that is still being written is read as it is now."""
    with contextlib.suppress(Exception):  # best effort
        fs.invalidate_cache()


def _checkpoint_size(fs: Any, path: str, files: Mapping[str, Any]) -> int:
    sizes = [as_int(v.get("size")) if isinstance(v, dict) else None for v in files.values()]
    if files and all(s is not None for s in sizes):
        return sum(s for s in sizes if s is not None)
    try:
        total = fs.du(path, total=True)
    except (OSError, ValueError):
        return 0
    return int(total) if isinstance(total, int | float) else 0


def list_checkpoints(
    fs: Any, fs_run_dir: str, run_dir: str, entries: list[dict[str, Any]]
) -> list[CheckpointInfo]:
    """The complete checkpoints among a run directory's listing ``entries``, by round.

    Args:
        fs: The filesystem.
        fs_run_dir: The run directory on ``fs``.
        run_dir: The run directory as the user gave it (paths of the results are under it).
        entries: ``ls(fs, fs_run_dir)``, or a part of it.

    Returns:
        One :class:`CheckpointInfo` per ``checkpoint_NNNNNN`` directory with a readable
        ``manifest.json`` (one without does not exist).
    """
    checkpoints: list[CheckpointInfo] = []
    for entry in entries:
        name = basename(str(entry["name"]))
        match = CHECKPOINT_RE.match(name)
        if entry.get("type") != "directory" or match is None:
            continue
        fs_path = join_fs(fs_run_dir, name)
        manifest = read_json(fs, join_fs(fs_path, MANIFEST_FILE))
        if manifest is None:
            continue  # no valid manifest: the checkpoint does not exist
        rnd = as_int(manifest.get("round"))
        files = as_dict(manifest.get("files"))
        checkpoints.append(
            CheckpointInfo(
                name=name,
                path=join_user(run_dir, name),
                round=rnd if rnd is not None else int(match.group(1)),
                metrics=as_dict(manifest.get("metrics")),
                size_bytes=_checkpoint_size(fs, fs_path, files),
                created=as_float(manifest.get("created")),
                files=files,
            )
        )
    checkpoints.sort(key=lambda c: (c.round, c.name))
    return checkpoints
