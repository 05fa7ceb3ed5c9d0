"""The checkpoint half of the Lightning bridge (:mod:`ringtrain.integrations.lightning`):
:class:`RingtrainCallback` reports Lightning's metrics with a checkpoint, and
:func:`get_ckpt_path` hands a restarted Trainer the run's latest one.

A checkpoint of this integration holds ``lightning.ckpt`` (``Trainer.save_checkpoint``, written
by rank 0) and one ``lightning_rng_rank_NNNNN.pt`` per rank (its RNG states, which Lightning's
checkpoint does not hold). This module imports ``lightning``; ``import ringtrain`` never does.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch

from ringtrain.checkpoint.checkpoint import Checkpoint, CheckpointLoadError
from ringtrain.worker.session import get_checkpoint, get_context, report
from ringtrain.worker.state import capture_rng, load_file, restore_rng

__all__ = ["CHECKPOINT_FILE", "RingtrainCallback", "get_ckpt_path", "own_files", "rng_file"]

logger = logging.getLogger("ringtrain")

CHECKPOINT_FILE = "lightning.ckpt"
"""The file ``Trainer.save_checkpoint`` writes in each checkpoint of this integration."""


def rng_file(rank: int) -> str:
    """The per-rank RNG file of ``rank`` in a checkpoint of this integration."""
    return f"lightning_rng_rank_{rank:05d}.pt"


def get_ckpt_path(checkpoint: Checkpoint | None = None) -> str | None:
    """The ``lightning.ckpt`` of the run's latest checkpoint, for ``trainer.fit(ckpt_path=...)``.

    :func:`prepare_trainer` calls it; call it yourself only to resume a Trainer that does not go
    through ``prepare_trainer``.

    Args:
        checkpoint: the checkpoint to resume from (default: :func:`ringtrain.get_checkpoint`).

    Returns:
        A private local copy of the file, verified against the checkpoint's signed manifest,
        or ``None`` on a fresh run.

    Raises:
        FileNotFoundError: if the checkpoint has no ``lightning.ckpt`` (it was not written by
            :class:`RingtrainCallback`).
    """
    ckpt = checkpoint if checkpoint is not None else get_checkpoint()
    if ckpt is None:
        return None
    if _is_directory(ckpt):
        # A sharded strategy's directory (FSDP, ModelParallel, DeepSpeed): every rank gets a
        # private verified copy of all of it (DCP reads other ranks' shards too).
        return ckpt.verified_copy(CHECKPOINT_FILE + "/")
    if not ckpt.has_file(CHECKPOINT_FILE):
        raise FileNotFoundError(
            f"{ckpt.uri} has no {CHECKPOINT_FILE}: it was not written by RingtrainCallback, so a "
            "Lightning Trainer cannot resume from it (start a new run with another "
            "RunConfig(name=...))"
        )
    # Lightning reads a path: it gets a private copy, checked against the manifest's SHA-256
    # as it was copied (the same path for every call on this checkpoint handle).
    return ckpt.verified_copy(CHECKPOINT_FILE)


def _is_directory(ckpt: Checkpoint) -> bool:
    """Whether ``lightning.ckpt`` is a directory of listed files in ``ckpt``."""
    try:
        listed = ckpt.verified_files()
    except CheckpointLoadError:
        return False  # a checkpoint of local files (Checkpoint.from_directory): no manifest
    return any(name.startswith(CHECKPOINT_FILE + "/") for name in listed)


def _load_rng(ckpt: Checkpoint, rank: int) -> dict[str, Any] | None:
    state: dict[str, Any] | None = load_file(ckpt, rng_file(rank))
    return state


# --------------------------------------------------------------------------------------- callback


class RingtrainCallback(pl.Callback):
    """Report Lightning's metrics and checkpoints to ringtrain.

    At the end of every training epoch (after that epoch's validation), and every
    ``every_n_steps`` optimizer steps if given, every rank calls :func:`ringtrain.report` with its
    ``trainer.callback_metrics`` (0-d tensors become floats; ``epoch`` and ``step``, the global
    step, are added) and a checkpoint: ``trainer.save_checkpoint`` writes ``lightning.ckpt``
    (Lightning's DDP writes it on global rank 0 only) and every rank its RNG states, into a
    temporary directory that ``report`` copies into the run's ``checkpoint_NNNNNN`` and that is
    then deleted. Every rank reports at the same points, as ``report`` requires.

    On a restarted attempt, :func:`prepare_trainer` points Lightning at that checkpoint; this
    callback then restores the rank's RNG states in its ``setup`` hook. The resumed run continues
    exactly where the checkpoint was taken: at an epoch's end with any data loader; mid-epoch (a
    checkpoint of ``every_n_steps``) when the training data loader is stateful (has
    ``state_dict``/``load_state_dict``, as ``rt.prepare_data_loader``'s loader and torchdata's
    ``StatefulDataLoader`` do; Lightning saves rank 0's loader state). With a plain
    ``DataLoader``, Lightning restarts a resumed epoch's data from its first batch.

    Outside a ringtrain run (no run directory) only the metrics are reported.

    Args:
        every_n_steps: also report (with a checkpoint) every this many optimizer steps
            (``trainer.global_step``); ``None``: only at epoch ends.
        checkpoint: attach checkpoints (``False``: metrics only, nothing to resume from).

    Raises:
        ValueError: if ``every_n_steps`` is not a positive int or None.
    """

    def __init__(self, every_n_steps: int | None = None, checkpoint: bool = True) -> None:
        if every_n_steps is not None and (
            isinstance(every_n_steps, bool)
            or not isinstance(every_n_steps, int)
            or every_n_steps < 1
        ):
            raise ValueError(
                f"RingtrainCallback.every_n_steps must be a positive int or None, got "
                f"{every_n_steps!r} (use None to report only at the end of each epoch)"
            )
        self.every_n_steps = every_n_steps
        self.checkpoint = checkpoint
        self._last_step_reported: int | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # The RNG states are restored here, at the same point of Lightning's start-up relative to
        # the training data loader's first iter() (which draws a seed from the global torch RNG)
        # as the one where they were captured: after this hook Lightning builds the loader and
        # calls iter() once before the first batch, as the uninterrupted run did after the
        # checkpoint at an epoch's end. A resumed run skips the sanity-check validation.
        if stage != "fit":
            return
        ckpt = get_checkpoint()
        if ckpt is None or trainer.ckpt_path is None or trainer.ckpt_path != get_ckpt_path(ckpt):
            return
        rank = trainer.global_rank
        state = _load_rng(ckpt, rank)
        if state is None:
            logger.warning(
                "rank %d: %s has no %s (written at another world size?); the RNG streams start "
                "afresh",
                rank,
                ckpt.uri,
                rng_file(rank),
            )
            return
        restore_rng(state)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning has restored the checkpoint by now: its private verified copy can go.
        ckpt = get_checkpoint()
        if ckpt is not None:
            ckpt.release_verified_copies()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.on_train_start(trainer, pl_module)  # a fit that had nothing left to train

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self.on_train_start(trainer, pl_module)  # a load that failed leaves no private copy

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        n = self.every_n_steps
        step = trainer.global_step
        if n is None or step == 0 or step % n or step == self._last_step_reported:
            return
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            return  # the epoch-end report follows right away
        self._last_step_reported = step
        self._report(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report(trainer)

    def _report(self, trainer: pl.Trainer) -> None:
        metrics = _to_python(trainer.callback_metrics)
        metrics.setdefault("epoch", trainer.current_epoch)
        metrics.setdefault("step", trainer.global_step)
        if not self.checkpoint or get_context().run_dir is None:
            report(metrics)
            return
        strategy = trainer.strategy
        # One directory name on every rank (rank 0's): sharded strategies write their parts
        # into the path rank 0 gives (they broadcast it), on each node's own disk; each rank
        # then reports only the files it owns (own_files), so that a node's shards reach the
        # run's storage from that node and no file is reported twice.
        shared = strategy.broadcast(
            tempfile.mkdtemp(prefix="ringtrain_lightning_") if trainer.global_rank == 0 else ""
        )
        mine = tempfile.mkdtemp(prefix="ringtrain_lightning_rank_")
        try:
            os.makedirs(shared, exist_ok=True)
            # Every rank calls save_checkpoint: it is collective (a barrier; sharded strategies
            # write a part on every rank). Under DDP only global rank 0 writes the file.
            trainer.save_checkpoint(os.path.join(shared, CHECKPOINT_FILE), weights_only=False)
            torch.save(capture_rng(), os.path.join(mine, rng_file(trainer.global_rank)))
            for name in own_files(shared, trainer.global_rank):
                os.makedirs(os.path.dirname(os.path.join(mine, name)), exist_ok=True)
                _link_or_copy(os.path.join(shared, name), os.path.join(mine, name))
            report(metrics, checkpoint=Checkpoint.from_directory(mine))
        finally:
            shutil.rmtree(mine, ignore_errors=True)
            strategy.barrier("ringtrain_lightning_checkpoint")  # all copied: remove the parts
            shutil.rmtree(shared, ignore_errors=True)

    def state_dict(self) -> dict[str, Any]:
        return {"last_step_reported": self._last_step_reported}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_step_reported = state_dict.get("last_step_reported")


_RANK_FILE = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|zero_pp_rank_(\d+)_[^/]*)$")
"""Files that name the rank that writes them: DCP's ``__{rank}_{n}.distcp`` (FSDP and
ModelParallel sharded checkpoints) and DeepSpeed's ``zero_pp_rank_{rank}_...``."""


def own_files(directory: str, rank: int) -> list[str]:
    """The ``/``-separated paths under ``directory`` that ``rank`` reports: those whose name
    carries its rank (:data:`_RANK_FILE`), and on rank 0 every file that names no rank
    (Lightning's single-file checkpoint, DCP's ``.metadata``, Lightning's ``meta.pt``)."""
    out = []
    for root, _dirs, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), directory).replace(os.sep, "/")
            match = _RANK_FILE.search(rel)
            owner = int(match.group(1) or match.group(2)) if match else 0
            if owner == rank:
                out.append(rel)
    return sorted(out)


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copyfile(source, target)


def _to_python(metrics: Any) -> dict[str, Any]:
    """``trainer.callback_metrics`` with tensors as Python numbers (or lists)."""
    out: dict[str, Any] = {}
    for key, value in dict(metrics).items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            value = value.item() if value.numel() == 1 else value.tolist()
        out[str(key)] = value
    return out
