"""What a run directory says about how it started, and whether its name may be used now.

``config.json`` and ``payload.pkl`` are what ``Trainer.restore(path)`` and ``ringtrain run
--resume`` start again after the driver itself died; they decide which code runs, so they are
signed and checked before anything is unpickled (docs/security.md). A run directory whose driver
is alive cannot be started a second time (:class:`RunNameTaken`); starting one that FINISHED
continues it, with a :class:`RunContinuedWarning`.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import time
from typing import Any

from ringtrain.checkpoint.signing import SIG_SUFFIX, Signer
from ringtrain.checkpoint.signing import resolve as resolve_signer
from ringtrain.checkpoint.storage import is_local_fs
from ringtrain.cluster import slurm
from ringtrain.config import RunConfig, ScalingConfig
from ringtrain.rundir import RunDirectory
from ringtrain.rundir.run_records import ConfigRecord
from ringtrain.rundir.schema import CONFIG_FILE, PAYLOAD_FILE, RESULT_FILE


def installed_version() -> str:
    """The installed ringtrain's version (its package metadata: ``pyproject.toml``'s), or
    ``"unknown"`` when ringtrain runs from a source tree that was never installed."""
    try:
        return importlib.metadata.version("ringtrain")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, but belongs to someone else
    except OSError:
        return False
    return True


def check_signed(run_dir: RunDirectory, filename: str, data: bytes, signer: Signer) -> None:
    """Check ``data`` (the content of ``filename`` in ``run_dir``) against ``filename.sig``.

    Raises:
        SignatureError: not signed for this run with ``signer``'s key (unless it trusts
            unsigned data).
    """
    sidecar = run_dir.read_bytes(filename + SIG_SUFFIX)
    signer.check_sidecar(data, sidecar, filename, run_dir.name, f"{run_dir.uri}/{filename}")


def write_signed(run_dir: RunDirectory, filename: str, data: bytes, signer: Signer) -> None:
    """Write ``data`` to ``filename`` and its signature to ``filename.sig``."""
    run_dir.write_bytes(filename, data)
    run_dir.write_bytes(filename + SIG_SUFFIX, signer.sidecar(data, filename, run_dir.name))


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """What a run directory's ``config.json`` (and ``payload.pkl``) say about how it started."""

    name: str
    storage_path: str
    scaling_config: ScalingConfig
    run_config: RunConfig
    entrypoint: str
    script: str | None
    script_args: tuple[str, ...]
    train_loop_config: dict[str, Any] | None
    payload: bytes | None


def _from_dict(cls: Any, data: Any) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in dict(data or {}).items() if k in known})


def load_saved_run(path: str, signer: Signer | None = None) -> SavedRun:
    """Read the configuration a run directory was started with, after checking the signatures
    of its ``config.json`` and ``payload.pkl`` (``signer``, default: this user's key): they
    decide which code runs (``payload.pkl`` is unpickled, ``config.json`` names the script).

    Raises:
        FileNotFoundError: if ``path`` holds no ``config.json``.
        SignatureError (a ValueError): a file is not signed for this run with the key (unless
            the signer trusts unsigned data).
    """
    import fsspec

    from ringtrain.config import CheckpointConfig, FailureConfig, MonitorConfig

    fs, stripped = fsspec.core.url_to_fs(path)
    local = is_local_fs(fs)
    run_path = os.path.abspath(stripped) if local else stripped.rstrip("/")
    parent, _, name = run_path.rstrip("/").rpartition("/")
    storage_path = parent if local else str(fs.unstrip_protocol(parent))
    run_dir = RunDirectory(storage_path, name)
    raw = run_dir.read_bytes(CONFIG_FILE)
    if raw is None:
        raise FileNotFoundError(f"{path} is not a run directory (no config.json)")
    signer = signer or resolve_signer()
    check_signed(run_dir, CONFIG_FILE, raw, signer)
    payload = run_dir.read_bytes(PAYLOAD_FILE)
    if payload is not None:
        check_signed(run_dir, PAYLOAD_FILE, payload, signer)
    config = json.loads(raw)
    rc = dict(config.get("run_config") or {})
    run_config = RunConfig(
        name=name,
        storage_path=storage_path,
        checkpoint_config=_from_dict(CheckpointConfig, rc.get("checkpoint_config")),
        failure_config=_from_dict(FailureConfig, rc.get("failure_config")),
        progress=rc.get("progress", "auto"),
        monitor_config=_from_dict(MonitorConfig, rc.get("monitor_config")),
        signing_key=signer.key,
        trust_unsigned=signer.trust_unsigned,
    )
    return SavedRun(
        name=name,
        storage_path=storage_path,
        scaling_config=_from_dict(ScalingConfig, config.get("scaling_config")),
        run_config=run_config,
        entrypoint=config.get("entrypoint") or name,
        script=config.get("script"),
        script_args=tuple(config.get("script_args") or ()),
        train_loop_config=config.get("train_loop_config"),
        payload=payload,
    )


def refuse_if_running(run_dir: RunDirectory) -> None:
    """Two drivers writing one run directory would interleave rounds and overwrite each other's
    checkpoints; a run whose driver is still alive on this host cannot be started again."""
    if not run_dir.is_local:
        return  # no way to see another host's processes; object stores are on the user
    path = os.path.join(run_dir.path, RESULT_FILE)
    try:
        with open(path) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return
    pid = previous.get("driver_pid")
    if previous.get("status") != "RUNNING" or not isinstance(pid, int) or pid == os.getpid():
        return
    if not pid_alive(pid):
        return  # that driver died: resuming its run is what the user wants
    raise RunNameTaken(
        f"run {run_dir.name!r} is already running (driver pid {pid}, {run_dir.uri}); "
        "wait for it, stop it, or use another RunConfig(name=...)"
    )


class RunNameTaken(RuntimeError):
    """``RunConfig.name`` names a run that is running now, or that already finished. The
    message names the fix for the Python API (``RunConfig(name=...)``); ``ringtrain run``
    translates it to its flags."""


class RunContinuedWarning(UserWarning):
    """A run was started with the name of a run that had FINISHED: it continues that run from
    its latest checkpoint (its earlier rounds stay in ``Result.metrics_history``)."""


def finished_note(storage_path: str, name: str) -> str | None:
    """What to tell a user who starts a run under the name of one that FINISHED: by the run
    directory contract it continues that run from its latest valid checkpoint, with the new
    settings, after the rounds it already has; in a notebook, running a cell again with more
    epochs does exactly that, which must not happen silently. ``None`` for any other name
    (new, failed, stopped, or whose driver died: resuming those is what the user wants).
    The message names the Python fix (``RunConfig(name=...)``); ``ringtrain run`` translates
    it to ``--name``."""
    run_dir = RunDirectory(storage_path, name)
    if not run_dir.is_local:
        return None
    try:
        with open(os.path.join(run_dir.path, RESULT_FILE)) as f:
            previous = json.load(f)
        status, rounds = previous.get("status"), previous.get("rounds")
    except (OSError, ValueError, AttributeError):
        return None
    if status != "FINISHED":
        return None
    done = f", {rounds} rounds" if isinstance(rounds, int) else ""
    return (
        f"run {name!r} already finished ({run_dir.uri}{done}): continuing it from its latest "
        f"checkpoint, after the rounds it has (they stay in metrics_history); for a fresh run "
        f"give a new RunConfig(name=...) (None: a fresh timestamped name)"
    )


def write_run_config(
    run_dir: RunDirectory,
    signer: Signer,
    *,
    entrypoint: str,
    scaling_config: ScalingConfig,
    run_config: RunConfig,
    script: str | None = None,
    script_args: tuple[str, ...] = (),
    train_loop_config: dict[str, Any] | None = None,
    payload: bytes | None = None,
) -> None:
    """Write ``config.json`` (the resolved configuration, what :func:`load_saved_run` reads
    back) and, in function mode, ``payload.pkl`` (the cloudpickled train function), each with
    its signature: they are what ``Trainer.restore(path)`` and ``ringtrain run --resume`` start
    again after the driver itself died, so they decide which code runs (docs/security.md)."""
    record = ConfigRecord(
        name=run_dir.name,
        storage_path=run_config.storage_path,
        entrypoint=entrypoint,
        script=script,
        script_args=list(script_args),
        ringtrain_version=installed_version(),
        created=time.time(),
        scaling_config=scaling_config.to_dict(),
        run_config={**run_config.to_dict(), "name": run_dir.name},
        train_loop_config=train_loop_config,
    )
    config_json = json.dumps(
        record.to_json(),
        indent=2,
        default=repr,
        allow_nan=True,
    ).encode()
    write_signed(run_dir, CONFIG_FILE, config_json, signer)
    if payload is not None:
        write_signed(run_dir, PAYLOAD_FILE, payload, signer)


def default_run_name(entrypoint: str) -> str:
    """``{entrypoint}_{YYYY-mm-dd_HH-MM-SS}``; inside a SLURM job ``{entrypoint}_slurm{JOB_ID}``,
    the same for the requeued job, which so resumes the run (:mod:`ringtrain.cluster.slurm`)."""
    safe = (
        "".join(c if c.isalnum() or c in "_.-" else "_" for c in entrypoint).strip("_.-") or "run"
    )
    return slurm.default_run_name(safe) or f"{safe}_{time.strftime('%Y-%m-%d_%H-%M-%S')}"
