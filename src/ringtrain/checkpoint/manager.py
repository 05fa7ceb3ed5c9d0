"""Driver-side checkpoint bookkeeping: publication and retention."""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from ringtrain.checkpoint import storage
from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.checkpoint.signing import Signer
from ringtrain.config import CheckpointConfig

logger = logging.getLogger("ringtrain")


@dataclass(frozen=True)
class SetAside:
    """A checkpoint that failed verification (or that worker ``rank`` could not load), renamed
    ``set_aside_as``; the run resumes from ``resumed_from`` (a checkpoint's directory name), or
    from step 0 when it is None (``CheckpointConfig.from_scratch_if_invalid``)."""

    checkpoint: str
    set_aside_as: str
    reason: str
    resumed_from: str | None
    rank: int | None = None

    def __str__(self) -> str:
        fallback = (
            f"resuming from {self.resumed_from}"
            if self.resumed_from is not None
            else "no valid checkpoint is left: starting from scratch"
        )
        return (
            f"checkpoint {self.checkpoint} is invalid ({self.reason}); "
            f"set aside as {self.set_aside_as}; {fallback}"
        )


class NoValidCheckpointError(RuntimeError):
    """The run directory holds checkpoints, none verifies, and starting from step 0 was not
    asked for (``CheckpointConfig.from_scratch_if_invalid``)."""

    def __init__(self, run_path: str, failed: list[tuple[int, str, str, int | None]]) -> None:
        self.run_path = run_path
        self.failed = [(storage.checkpoint_dirname(r), why) for r, _, why, _ in sorted(failed)]
        listed = "; ".join(f"{name}: {why}" for name, why in self.failed)
        super().__init__(
            f"no checkpoint of run {run_path} verifies ({listed}); refusing to start it again "
            "from step 0. Look at them (a wrong signing key? RunConfig.signing_key / "
            "signing_key_file), or, to set them aside (renamed checkpoint_NNNNNN.corrupt) and "
            "start from step 0, pass "
            "RunConfig(checkpoint_config=CheckpointConfig(from_scratch_if_invalid=True)) "
            "(ringtrain run: --from-scratch-if-invalid)"
        )


@dataclass
class TrackedCheckpoint:
    round: int
    checkpoint: Checkpoint
    metrics: dict[str, Any] = field(default_factory=dict)
    files: dict[str, dict[str, Any]] | None = None  # the verified manifest's file table


class CheckpointManager:
    """Publishes checkpoints of completed rounds and applies ``CheckpointConfig`` retention.

    Retention keeps the ``num_to_keep`` best checkpoints by ``checkpoint_score_attribute`` (by
    recency when no attribute is set) and always the latest one, which a restart resumes from and
    ``Result.checkpoint`` points to; so up to ``num_to_keep + 1`` directories can exist. A
    checkpoint whose metrics lack the score attribute ranks below every scored one.

    Args:
        fs: fsspec filesystem of the run directory.
        run_path: the run directory on ``fs``.
        config: retention settings.
        staging_dir: a local directory where workers stage their files instead of the run
            directory, for storage the worker processes cannot reach (``memory://`` lives inside
            the driver process). The driver then copies each completed round to ``fs`` before
            publishing it, and hands workers a local copy of the checkpoint to resume from.
        signer: signs every manifest and checks it on reading (default: this user's key,
            :func:`ringtrain.checkpoint.signing.resolve`). A checkpoint must also name this run
            and its own round, so that one cannot be copied in from another run or renamed.
    """

    def __init__(
        self,
        fs: Any,
        run_path: str,
        config: CheckpointConfig,
        staging_dir: str | None = None,
        signer: Signer | None = None,
    ) -> None:
        from ringtrain.checkpoint import signing

        self.fs = fs
        self.run_path = run_path
        self.config = config
        self.staging_dir = staging_dir
        self.signer = signer or signing.resolve()
        self.run_name = storage.run_name(run_path)
        # The file table of the checkpoint last handed to workers (worker_uri), for their Start.
        self.resume_files: dict[str, dict[str, Any]] | None = None
        self.checkpoints: list[TrackedCheckpoint] = []  # oldest first
        self.deleted: list[tuple[str, str]] = []  # (path, reason), for the event log
        self.notes: list[str] = []  # what latest_verified() set aside, in words
        self.set_aside: list[SetAside] = []  # the same, as records (for the event log)
        # Checkpoints found invalid (or unloadable on ``rank``) and not yet set aside:
        # (round, path, why, rank).
        self._failed: list[tuple[int, str, str, int | None]] = []
        self._warned_missing_score = False

    # ------------------------------------------------------------------ discovery
    def scan(self) -> list[str]:
        """Load the valid checkpoints already in the run directory (a run started again with the
        same name); remove stale staging directories. Returns messages about skipped ones."""
        notes: list[str] = []
        if not self.fs.exists(self.run_path):
            return notes
        found: list[TrackedCheckpoint] = []
        invalid: list[tuple[int, str, Exception]] = []
        for entry in self.fs.ls(self.run_path, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".tmp") and name.startswith("checkpoint_"):
                self.fs.rm(entry, recursive=True)
                notes.append(f"removed incomplete checkpoint {name} (its round never completed)")
                continue
            round_ = storage.parse_round(name)
            if round_ is None:
                continue
            try:
                manifest = self._read(entry, round_, verify_checksums=False)
            except (ValueError, OSError) as bad:
                invalid.append((round_, entry, bad))
                continue
            ckpt = _handle(entry, self.fs, manifest["files"])
            found.append(
                TrackedCheckpoint(
                    round_, ckpt, dict(manifest.get("metrics") or {}), dict(manifest["files"])
                )
            )
        self.checkpoints = sorted(found, key=lambda t: t.round)
        failed = [(r, entry, str(why), None) for r, entry, why in sorted(invalid)]
        if not self.checkpoints:
            # latest_verified() refuses to start from scratch (renaming nothing) or, when asked
            # to, sets them aside.
            self._failed += failed
            return notes
        resume = storage.checkpoint_dirname(self.checkpoints[-1].round)
        for round_, entry, why, rank in failed:
            self._set_aside(round_, entry, why, resume, rank)
        return notes

    @property
    def workers_run_dir(self) -> str | None:
        """Where workers write their checkpoint files, when not in the run directory itself."""
        return self.staging_dir

    def staging_path(self, round_: int) -> tuple[Any, str]:
        """``(filesystem, path)`` of the directory where workers stage round ``round_``."""
        if self.staging_dir is not None:
            return _local_fs(), os.path.join(self.staging_dir, storage.staging_dirname(round_))
        return self.fs, storage.join(self.fs, self.run_path, storage.staging_dirname(round_))

    def fence_location(self) -> tuple[Any, str]:
        """``(filesystem, directory)`` where the workers read the run's fence
        (:mod:`ringtrain.checkpoint.fence`): the directory they write to."""
        if self.staging_dir is not None:
            return _local_fs(), self.staging_dir
        return self.fs, self.run_path

    def settle_staging(self, round_: int, files: dict[str, dict[str, Any]]) -> str | None:
        """Make round ``round_``'s staging directory hold exactly ``files`` (what the current
        ranks reported) before it is published, while a worker declared lost may still write:
        files nobody reported are removed, and every reported file must have the reported size
        and SHA-256. Returns why the round must not be published (a file that differs), or
        ``None``."""
        fs, staging = self.staging_path(round_)
        for path in fs.find(staging) if fs.exists(staging) else []:
            rel = str(path)[len(str(staging)) :].strip("/").replace(os.sep, "/")
            if rel not in files:
                fs.rm(path)
        for rel, info in sorted(files.items()):
            try:
                found = storage.file_digest(fs, storage.join(fs, staging, rel))
            except FileNotFoundError:
                return f"{rel} is missing"
            if (found.get("size"), found.get("sha256")) != (info.get("size"), info.get("sha256")):
                return f"{rel} differs from what its rank wrote"
        return None

    def remove_staging(self) -> None:
        """Delete every staging directory (``checkpoint_NNNNNN.tmp``): only call it while no
        worker is writing."""
        places = [(self.fs, self.run_path)]
        if self.staging_dir is not None:
            places.append((_local_fs(), self.staging_dir))
        for fs, root in places:
            if not fs.exists(root):
                continue
            for entry in fs.ls(root, detail=False):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if name.startswith("checkpoint_") and name.endswith(".tmp"):
                    fs.rm(entry, recursive=True)

    def discard_staging(self, round_: int) -> None:
        """Delete the staging directory of ``round_`` (its checkpoint will not be published)."""
        fs, path = self.staging_path(round_)
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def _read(self, path: str, round_: int, verify_checksums: bool) -> dict[str, Any]:
        return storage.read_manifest(
            self.fs,
            path,
            verify_checksums,
            signer=self.signer,
            run=self.run_name,
            round_=round_,
        )

    def worker_uri(self, tracked: TrackedCheckpoint) -> str:
        """The location workers resume ``tracked`` from: the checkpoint itself, or with a
        ``staging_dir`` a local copy of it. Its verified file table becomes ``resume_files``
        (workers read only those files, hashing each as they read it)."""
        self.resume_files = dict(tracked.files) if tracked.files is not None else None
        if self.staging_dir is None:
            return tracked.checkpoint.uri
        dest = os.path.join(self.staging_dir, "resume", storage.checkpoint_dirname(tracked.round))
        if os.path.isdir(dest):
            shutil.rmtree(dest)
        return tracked.checkpoint.to_directory(dest)

    def latest_verified(self) -> TrackedCheckpoint | None:
        """The newest checkpoint whose manifest is signed for this run and round and whose every
        file matches it byte for byte (size and SHA-256), with nothing unlisted beside them.

        Each invalid one (met on the way, found by :meth:`scan`, or refused by a worker:
        :meth:`set_aside_unloadable`) is renamed ``checkpoint_NNNNNN.corrupt`` (kept for
        inspection, never loaded), dropped from the list, and described in ``notes`` and
        ``set_aside`` (a :class:`SetAside` each, naming the checkpoint resumed from instead).

        Raises:
            NoValidCheckpointError: checkpoints were found invalid and none is left that
                verifies, and ``CheckpointConfig.from_scratch_if_invalid`` is False: the run
                would silently start again from step 0. Nothing is renamed then.
        """
        failed, self._failed = self._failed, []
        chosen: TrackedCheckpoint | None = None
        while self.checkpoints and chosen is None:
            tracked = self.checkpoints[-1]
            try:
                manifest = self._read(tracked.checkpoint.path, tracked.round, True)
            except (ValueError, OSError) as exc:
                self.checkpoints.pop()
                failed.append((tracked.round, tracked.checkpoint.path, str(exc), None))
                continue
            tracked.files = dict(manifest["files"])
            chosen = tracked
        if failed and chosen is None and not self.config.from_scratch_if_invalid:
            raise NoValidCheckpointError(self.run_path, failed)
        resume = storage.checkpoint_dirname(chosen.round) if chosen is not None else None
        for round_, path, why, rank in sorted(failed):
            self._set_aside(round_, path, why, resume, rank)
        return chosen

    def set_aside_unloadable(self, tracked: TrackedCheckpoint, why: str, rank: int | None) -> bool:
        """Set aside ``tracked`` (verified, but a worker, ``rank``, could not load it) like a
        corrupt one, so that the next attempt resumes from the checkpoint before it (it is
        renamed by the next :meth:`latest_verified`). Returns False if it is no longer
        tracked."""
        if tracked not in self.checkpoints:
            return False
        self.checkpoints.remove(tracked)
        self._failed.append((tracked.round, tracked.checkpoint.path, why, rank))
        return True

    def set_aside_after(self, round_: int, why: str) -> list[int]:
        """Set aside every checkpoint newer than round ``round_`` (``-1``: all), like a corrupt
        one (renamed ``.corrupt`` by the next :meth:`latest_verified`, with ``why``): a replica
        check found corrupted state after the newest checkpoint at or before ``round_``.
        Returns the rounds set aside."""
        newer = [t for t in self.checkpoints if t.round > round_]
        for tracked in newer:
            self.checkpoints.remove(tracked)
            self._failed.append((tracked.round, tracked.checkpoint.path, why, None))
        return [t.round for t in newer]

    def _set_aside(
        self, round_: int, path: str, why: str, resume: str | None, rank: int | None
    ) -> None:
        """Rename an invalid checkpoint ``checkpoint_NNNNNN.corrupt`` (kept for inspection, never
        loaded) and say so in ``notes``."""
        quarantine = path.rstrip("/") + ".corrupt"
        try:
            if self.fs.exists(quarantine):
                self.fs.rm(quarantine, recursive=True)
            self.fs.mv(path, quarantine, recursive=True)
        except OSError:
            pass
        name = storage.checkpoint_dirname(round_)
        note = SetAside(name, quarantine.rsplit("/", 1)[-1], why, resume, rank)
        self.set_aside.append(note)
        self.notes.append(str(note))

    @property
    def next_round(self) -> int:
        return self.checkpoints[-1].round + 1 if self.checkpoints else 0

    @property
    def latest(self) -> TrackedCheckpoint | None:
        return self.checkpoints[-1] if self.checkpoints else None

    # ------------------------------------------------------------------ publication
    def publish(
        self, round_: int, files: dict[str, dict[str, Any]], metrics: dict[str, Any]
    ) -> TrackedCheckpoint:
        """Publish the staged files of ``round_`` as a checkpoint and apply retention."""
        if self.staging_dir is not None:
            local = self.staging_path(round_)[1]
            remote = storage.join(self.fs, self.run_path, storage.staging_dirname(round_))
            for rel in files:
                with open(os.path.join(local, *rel.split("/")), "rb") as f:
                    data = f.read()
                target = storage.join(self.fs, remote, rel)
                self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
                self.fs.pipe_file(target, data)
            shutil.rmtree(local, ignore_errors=True)
        path = storage.publish(self.fs, self.run_path, round_, files, metrics, self.signer)
        ckpt = _handle(path, self.fs, files)
        tracked = TrackedCheckpoint(round_, ckpt, dict(metrics), dict(files))
        self.checkpoints = [t for t in self.checkpoints if t.round != round_] + [tracked]
        self.checkpoints.sort(key=lambda t: t.round)
        self._apply_retention()
        return tracked

    # ------------------------------------------------------------------ retention
    def _score(self, tracked: TrackedCheckpoint) -> float:
        attr = self.config.checkpoint_score_attribute
        if attr is None:
            return float(tracked.round)
        value = tracked.metrics.get(attr)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            if not self._warned_missing_score:
                logger.warning(
                    "checkpoint of round %d has no numeric metric %r "
                    "(CheckpointConfig.checkpoint_score_attribute); it ranks last for retention",
                    tracked.round,
                    attr,
                )
                self._warned_missing_score = True
            return -math.inf
        return float(value) if self.config.checkpoint_score_order == "max" else -float(value)

    def ranked(self) -> list[TrackedCheckpoint]:
        """Checkpoints best first (ties: newer first)."""
        return sorted(self.checkpoints, key=lambda t: (self._score(t), t.round), reverse=True)

    def _apply_retention(self) -> None:
        keep_n = self.config.num_to_keep
        if keep_n is None or len(self.checkpoints) <= keep_n:
            return
        latest = self.checkpoints[-1]
        keep = {t.round for t in self.ranked()[:keep_n]} | {latest.round}
        survivors = []
        for tracked in self.checkpoints:
            if tracked.round in keep:
                survivors.append(tracked)
                continue
            reason = (
                f"retention: not among the {keep_n} best by "
                f"{self.config.checkpoint_score_attribute or 'recency'}"
            )
            try:
                self.fs.rm(tracked.checkpoint.path, recursive=True)
            except FileNotFoundError:
                pass
            self.deleted.append((tracked.checkpoint.path, reason))
        self.checkpoints = survivors


def _handle(path: str, fs: Any, files: dict[str, dict[str, Any]]) -> Checkpoint:
    """A handle of a checkpoint this driver verified (or wrote), carrying its file table: reads
    through it (``Result.checkpoint``, ``export_model``) are checked against the table, whatever
    key the run was signed with."""
    ckpt = Checkpoint(path, fs)
    ckpt.set_verified_files(files)
    return ckpt


def _local_fs() -> Any:
    from fsspec.implementations.local import LocalFileSystem

    return LocalFileSystem()
