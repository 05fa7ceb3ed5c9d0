"""``TrainState``: what a bit-exact resume needs, saved by ``report(..., checkpoint=state)``.

A checkpoint of a TrainState is two kinds of file in the round's checkpoint directory:

- ``train_state.pt``, written by rank 0 only: the state dicts of the model (unwrapped from DDP, so
  it loads at any world size), optimizer, LR scheduler, gradient scaler and any other registered
  Stateful object, plus ``step``, ``epoch`` and the user's plain extras. Under data parallelism
  these are identical on every rank, so they are stored once.
- ``rank_NNNNN.pt``, one per rank: that rank's RNG states (Python ``random``, NumPy's legacy global
  generator, torch CPU, and every CUDA device when CUDA is initialised), its data loader
  position, and the per-rank state attached to the prepared model (:func:`attach_rank_state`:
  PowerSGD's error feedback, a gradient accumulation counter with the partial gradients).

For a model sharded with ``prepare_model(parallel_strategy="fsdp")``, the model and its optimizer
are not in ``train_state.pt``: every rank writes its shards with ``torch.distributed.checkpoint``
(``__R_0.distcp`` per rank, ``.metadata`` from rank 0; :mod:`ringtrain.checkpoint.sharded`), into
the same staging directory, manifest and atomic rename. They load at any world size (resharding).

Resuming at another world size (a sharded or unsharded model alike) is supported but not
bit-exact: the data loader's global sample position is converted to the new world size and batch
size (rounded down to a whole global batch, replaying at most one global batch), ranks that
existed before get back their RNG streams, new ranks keep theirs, and a warning says so.

The same two payloads, as ``{file name: content}``, are the state's public form:
:meth:`TrainState.to_payload` builds them and :meth:`TrainState.load_payload` loads them, for a
disk checkpoint (one ``torch.save`` per entry) and an in-memory elastic snapshot alike. The file
layout, staging and safe loading are in :mod:`ringtrain.worker.state_files`.

Both are loaded with ``torch.load(weights_only=True)``: a checkpoint file can never run code. The
contract: restore, then continue, and the parameters are bit-identical to never having stopped
(on CPU, or on GPU with deterministic kernels), because every source of nondeterminism between two
steps is in the state: parameters, optimizer moments, schedule, the RNG streams and data order
(randomness inside DataLoader worker processes is seeded per sample by ``prepare_data_loader``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.checkpoint import deepspeed_io
from ringtrain.checkpoint import sharded as sharded_io
from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.worker.session import (
    get_checkpoint,
    get_context,
    installed_session,
    note_epoch,
    step_taken,
)
from ringtrain.worker.state_files import (
    FORMAT,
    PENDING_ATTR,
    RANK_STATE_ATTR,
    STATE_FILE,
    PayloadCheckpoint,
    attach_rank_state,
    capture_rng,
    find_unsavable,
    is_dcp_file,
    is_stateful,
    load_file,
    model_rank_state,
    rank_file,
    registration_problem,
    require_layout,
    restore_rng,
    stage,
    torch_writer,
    unwrap,
)
from ringtrain.worker.state_resume import PayloadReader, payload_reader, rank_part

__all__ = [
    "RANK_STATE_ATTR",
    "STATE_FILE",
    "PayloadReader",
    "TrainState",
    "attach_rank_state",
    "capture_rng",
    "rank_file",
    "restore_rng",
]

logger = logging.getLogger("ringtrain")

_NAMED = ("model", "optimizer", "lr_scheduler", "grad_scaler", "data_loader")


class TrainState:
    """The training state that a restart restores bit-exactly.

    Args:
        model: the model (DDP-wrapped or not; saved unwrapped).
        optimizer: a ``torch.optim.Optimizer``.
        lr_scheduler: a ``torch.optim.lr_scheduler.LRScheduler``.
        grad_scaler: a ``torch.amp.GradScaler`` (default: the one of an optimizer returned by
            :func:`ringtrain.prepare_optimizer` under ``precision="16-mixed"``).
        data_loader: the loader returned by :func:`ringtrain.prepare_data_loader` (or any object
            with ``state_dict``/``load_state_dict``, e.g. torchdata's ``StatefulDataLoader``); its
            position is saved per rank.
        step: the optimizer step counter (steps).
        epoch: the epoch counter (epochs).
        **extras: more Stateful objects (anything with ``state_dict``/``load_state_dict``: an EMA
            model, a second optimizer...) or plain values (numbers, strings, tensors, and lists,
            tuples and dicts of them), read and written as ``state["name"]``.

    Raises:
        TypeError: naming every object that cannot be saved: not Stateful and not a plain value, a
            plain ``DataLoader`` (it has no position; use ``prepare_data_loader``), or a state dict
            holding something a ``weights_only`` checkpoint cannot hold (a function, a custom
            class).
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
        data_loader: Any = None,
        *,
        step: int = 0,
        epoch: int = 0,
        **extras: Any,
    ) -> None:
        objects: dict[str, Any] = {}
        plain: dict[str, Any] = {}
        problems: list[str] = []
        if grad_scaler is None:
            # rt.prepare_optimizer(...) under precision="16-mixed" carries its GradScaler.
            grad_scaler = getattr(optimizer, "grad_scaler", None)
        named = dict(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            grad_scaler=grad_scaler,
            data_loader=data_loader,
        )
        # A DeepSpeed engine (and its optimizer, scheduler) is saved by DeepSpeed itself.
        self._deepspeed = deepspeed_io.engine_names(named)
        for name, obj in [*named.items(), *extras.items()]:
            if obj is None and name in _NAMED:
                continue
            if name in self._deepspeed:
                objects[name] = obj
                continue
            problem = registration_problem(name, obj, _NAMED)
            if problem:
                problems.append(problem)
            if is_stateful(obj) and not isinstance(obj, torch.utils.data.DataLoader):
                objects[name] = obj
            elif name not in _NAMED and not isinstance(obj, torch.utils.data.DataLoader):
                plain[name] = obj
        self._sharded, sharded_problems = sharded_io.sharded_objects(objects)
        problems += sharded_problems
        if problems:
            raise TypeError("TrainState cannot save:\n  " + "\n  ".join(problems))
        self._objects = objects
        self.extras = plain
        self._step = int(step)
        self.epoch = int(epoch)
        self.restored_from: Checkpoint | None = None
        self._staged: dict[str, Any] = {}
        self._dcp_group: Any = None  # gloo group for dcp.async_save's background collectives

    # ------------------------------------------------------------------ counters
    @property
    def step(self) -> int:
        """The step counter (an ``int``); setting it marks the step boundary.

        Setting it counts as progress for hang detection and runs the session's step hooks
        (:meth:`ringtrain.worker.hooks.WorkerPlugin.on_step`): in a ringtrain-launched worker
        that includes the **preemption agreement**, a small allreduce of every rank on a process
        group of its own (:mod:`ringtrain.worker.preempt`: whether any rank must stop for a
        preemption notice, and at which step), and an elastic run's in-memory snapshots.

        So every rank must set it at the same steps, the same way (``state.step += 1`` after
        each optimizer step on every rank). A rank that sets it while the others do not waits
        for them at its next boundary for half of ``FailureConfig.worker_timeout_s`` (at least
        5 s; 1800 s without a timeout) and fails with
        :class:`~ringtrain.worker.preempt.StepAgreementError`, naming the step; ranks whose
        values differ at the same boundary fail with it at once.
        """
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = int(value)
        step_taken(self)

    @property
    def data_loader(self) -> Any:
        """The registered data loader (``None``: none)."""
        return self._objects.get("data_loader")

    @property
    def sharded(self) -> frozenset[str]:
        """The names of the objects saved with ``torch.distributed.checkpoint`` (FSDP)."""
        return frozenset(self._sharded)

    def __getitem__(self, name: str) -> Any:
        if name in self.extras:
            return self.extras[name]
        return self._objects[name]

    def __contains__(self, name: object) -> bool:
        return name in self.extras or name in self._objects

    def __setitem__(self, name: str, value: Any) -> None:
        if name in self._objects:
            raise KeyError(f"{name!r} is a registered Stateful object; it cannot be replaced")
        found = find_unsavable(value, name)
        if found:
            raise TypeError(f"TrainState[{name!r}]: {found}, which a checkpoint cannot hold")
        self.extras[name] = value

    def epochs(self, num_epochs: int) -> Iterator[int]:
        """Yield the epochs from the current (restored) one up to ``num_epochs - 1``.

        Before each epoch the data loader is set to it (a restored position within that epoch is
        kept); after the body of an epoch, ``epoch`` advances.
        """
        while self.epoch < num_epochs:
            loader = self.data_loader
            if loader is not None and hasattr(loader, "set_epoch"):
                loader.set_epoch(self.epoch)
            note_epoch(self.epoch, num_epochs, loader)  # the driver's progress bar and ETA
            yield self.epoch
            self.epoch += 1

    # ------------------------------------------------------------------ the payload
    def _shared_payload(self) -> dict[str, Any]:
        objects = {}
        for name, obj in self._objects.items():
            if name == "data_loader" or name in self._sharded or name in self._deepspeed:
                continue
            objects[name] = (unwrap(obj) if name == "model" else obj).state_dict()
        return {
            "format": FORMAT,
            "step": self._step,
            "epoch": self.epoch,
            "world_size": get_context().world_size,
            "sharded": sorted(self._sharded),  # saved with torch.distributed.checkpoint
            "deepspeed": sorted(self._deepspeed),  # in DeepSpeed's own files (deepspeed__*)
            "objects": objects,
            "extras": dict(self.extras),
        }

    def _rank_payload(self) -> dict[str, Any]:
        loader = self.data_loader
        return {
            "format": FORMAT,
            "rank": get_context().world_rank,
            "step": self._step,
            "epoch": self.epoch,
            "rng": capture_rng(),
            "data_loader": loader.state_dict() if loader is not None else None,
            "model_rank_state": {
                name: obj.state_dict()
                for name, obj in model_rank_state(self._objects.get("model")).items()
            },
        }

    def to_payload(
        self,
        *,
        shared: bool | None = None,
        staged: bool = False,
        reuse: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """This rank's state as ``{file name: content}``: what a disk checkpoint writes (one
        ``torch.save`` per entry) and an elastic snapshot keeps in memory.

        Args:
            shared: include :data:`~ringtrain.worker.state_files.STATE_FILE` (model, optimizer, LR
                scheduler, ..., step, epoch, extras; identical on every data-parallel rank);
                default: on rank 0 only. ``rank_NNNNN.pt`` (this rank's RNG states, data position
                and per-rank model state) is always included. FSDP-sharded objects are not in it
                (:attr:`sharded`; a disk checkpoint saves them with DCP).
            staged: copy every tensor into host memory the payload owns (safe to write from
                another thread while training mutates the originals); otherwise the contents
                share the live tensors.
            reuse: a previous staged payload whose write is over: tensors of the same shape and
                dtype are copied into its buffers instead of fresh ones.

        Returns:
            The payload; :meth:`load_payload` loads it back.
        """
        rank = get_context().world_rank
        payload = {rank_file(rank): self._rank_payload()}
        if shared if shared is not None else rank == 0:
            payload[STATE_FILE] = self._shared_payload()
        if staged:
            previous = reuse or {}
            payload = {name: stage(obj, previous.get(name)) for name, obj in payload.items()}
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
        return payload

    def checkpoint_writers(self, staged: bool) -> dict[str, Callable[[Any], None]]:
        """This rank's files of a checkpoint, as ``name -> writer``. With ``staged``, every
        tensor is first copied to host memory (reusing the previous save's buffers), so the
        writers may run on another thread while training continues."""
        payload = self.to_payload(staged=staged, reuse=self._staged)
        if staged:
            self._staged = payload
        writers = {name: torch_writer(obj) for name, obj in payload.items()}
        if self._sharded:
            writers.update(self._sharded_writers(get_context().world_rank, staged))
        if self._deepspeed:  # collective, synchronous: engine.save_checkpoint
            model = self._objects["model"]
            writers.update(deepspeed_io.save_writers(model, get_context().world_rank))
        return writers

    _checkpoint_writers = checkpoint_writers  # the name session.report and tests used

    def _sharded_writers(self, rank: int, staged: bool) -> dict[str, Callable[[Any], None]]:
        """Save the FSDP model and optimizer with DCP (collective) into a local temporary
        directory, and return writers that copy this rank's files from there. With ``staged``,
        ``dcp.async_save`` copies the shards to host memory and returns; the writers wait for
        its files."""
        group = None
        if staged:
            if self._dcp_group is None:  # every rank saves at the same report: collective
                self._dcp_group = dist.new_group(backend="gloo")
            group = self._dcp_group
        state = sharded_io.state_dict_of(
            self._objects["model"],
            self._objects.get("optimizer") if "optimizer" in self._sharded else None,
        )
        directory, wait = sharded_io.save_to_local(state, rank, async_group=group)
        return sharded_io.file_writers(directory, rank, wait)

    # ------------------------------------------------------------------ restoring
    def restore(self, checkpoint: Checkpoint | None = None) -> bool:
        """Load the state of ``checkpoint`` (default: the run's latest, ``get_checkpoint()``).

        A no-op returning False on a fresh run. Reads only files the checkpoint's signed manifest
        lists, hashing each as it is read, and loads them with ``weights_only=True``
        (docs/security.md). Then runs the session's restore hooks
        (:meth:`ringtrain.worker.hooks.WorkerPlugin.on_restore`).

        Returns:
            True if a checkpoint was restored.

        Raises:
            ValueError: if the checkpoint holds no TrainState, lacks an object registered here,
                or its data position does not fit this run (another world size or batch size).
            CheckpointLoadError: a file is unlisted, unsafe or altered, the manifest is not
                signed with the key, or a file's content is refused (on a worker, the driver
                then sets the checkpoint aside and resumes from the one before).
        """
        ckpt = checkpoint if checkpoint is not None else get_checkpoint()
        if ckpt is None:
            return False
        if isinstance(ckpt, PayloadCheckpoint):
            restore_sharded = getattr(ckpt, "restore_sharded", None)  # an elastic snapshot's
            self.load_payload(
                ckpt.in_memory_files,
                source=ckpt.uri,
                sharded=None if restore_sharded is None else lambda: restore_sharded(self),
            )
        else:
            self.load_payload(
                lambda name: load_file(ckpt, name),
                source=ckpt.uri,
                sharded=lambda: self._restore_sharded(ckpt),
            )
        self.restored_from = ckpt
        session = installed_session()
        if session is not None:
            session.hooks.on_restore(self, ckpt)
        logger.info("restored step %d, epoch %d from %s", self._step, self.epoch, ckpt.uri)
        return True

    def _restore_sharded(self, ckpt: Checkpoint) -> None:
        if self._deepspeed:  # DeepSpeed reads a private copy of the verified files
            with ckpt.verified_directory(deepspeed_io.is_deepspeed_file) as local:
                deepspeed_io.restore_engine(self._objects["model"], local, ckpt.uri)
        if not self._sharded:
            return
        optimizer = self._objects["optimizer"] if "optimizer" in self._sharded else None
        # DCP reads whichever files hold this rank's slices: it gets a private copy of the
        # verified files, never the storage itself.
        with ckpt.verified_directory(is_dcp_file) as local:
            sharded_io.restore_objects(self._objects["model"], optimizer, local, None)

    def load_payload(
        self,
        payload: Mapping[str, Any] | PayloadReader,
        *,
        source: str = "the payload",
        sharded: Callable[[], None] | None = None,
    ) -> None:
        """Load a payload :meth:`to_payload` made (on this or another world size): the shared
        objects, step, epoch and extras, then this rank's RNG states, data position and per-rank
        model state. At another world size the data position is converted (not bit-exact: a
        warning says so, unless the shared file is marked ``"elastic"``).

        Args:
            payload: ``{file name: content}``, or a function reading one file by name (``None``
                when absent), as :meth:`restore` passes for a checkpoint on storage.
            source: names the payload in errors and logs (a checkpoint's URI).
            sharded: loads the FSDP-sharded objects (:attr:`sharded`), called after the others;
                required when there are any.

        Raises:
            ValueError: see :meth:`restore`.
            CheckpointLoadError: a file does not have a TrainState file's layout.
        """
        read = payload_reader(payload)
        shared = read(STATE_FILE)
        if shared is None:
            raise ValueError(
                f"{source} holds no {STATE_FILE}: it was not saved from a TrainState "
                "(report(..., checkpoint=state))"
            )
        require_layout(source, STATE_FILE, shared, ("objects", "step", "epoch"))
        self._load_shared(shared, source)
        if self._sharded or self._deepspeed:
            if sharded is None:  # pragma: no cover - a payload without its restore_sharded
                raise ValueError(f"{source}: the FSDP-sharded state is not in an in-memory payload")
            sharded()
        self.extras.update(shared.get("extras") or {})
        self._step = int(shared["step"])
        self.epoch = int(shared["epoch"])
        per_rank, loader_state = self._rank_part(read, shared, source)
        self._load_rank_part(per_rank, loader_state)

    def _load_shared(self, shared: Mapping[str, Any], source: str) -> None:
        saved = shared["objects"]
        saved_sharded = set(shared.get("sharded") or ())
        if saved_sharded != self._sharded:
            then = ", ".join(sorted(saved_sharded)) or "nothing"
            now = ", ".join(sorted(self._sharded)) or "nothing"
            raise ValueError(
                f"{source} was saved with {then} sharded (FSDP), this TrainState has {now}"
                " sharded: resume with the same prepare_model(parallel_strategy=...), or turn the "
                "checkpoint into a plain state dict with ringtrain.export_model"
            )
        missing = [
            n
            for n in self._objects
            if n != "data_loader"
            and n not in saved
            and n not in saved_sharded
            and n not in self._deepspeed
        ]
        if missing:
            raise ValueError(
                f"{source} has no state for {', '.join(missing)} (registered in this "
                "TrainState, absent when the checkpoint was saved)"
            )
        for name, obj in self._objects.items():
            if name == "data_loader" or name in self._sharded or name in self._deepspeed:
                continue
            (unwrap(obj) if name == "model" else obj).load_state_dict(saved[name])
        extra_saved = [n for n in saved if n not in self._objects]
        if extra_saved:
            logger.warning("checkpoint state for %s ignored (not registered)", extra_saved)

    def _rank_part(
        self, read: PayloadReader, shared: Mapping[str, Any], source: str
    ) -> tuple[dict[str, Any], Any]:
        """This rank's payload and the data position to load (:func:`rank_part`)."""
        return rank_part(read, shared, source, self.data_loader)

    def _load_rank_part(self, per_rank: dict[str, Any], loader_state: Any) -> None:
        loader = self.data_loader
        if loader is not None and loader_state is not None:
            loader.load_state_dict(loader_state)
            # A checkpoint taken after the loader ran off the end of an epoch (but before the
            # epoch loop advanced) resumes at the next epoch, not at a replay of this one.
            if getattr(loader, "batch", None) == 0 and getattr(loader, "epoch", 0) > self.epoch:
                self.epoch = int(loader.epoch)
        saved_rank_state = dict(per_rank.get("model_rank_state") or {})
        model = self._objects.get("model")
        for name, obj in model_rank_state(model).items():
            if name in saved_rank_state:
                obj.load_state_dict(saved_rank_state.pop(name))
            else:
                logger.warning("checkpoint has no per-rank %s state; it starts afresh", name)
        if model is not None and saved_rank_state:  # for objects attached later
            unwrap(model).__dict__[PENDING_ATTR] = saved_rank_state
        if per_rank["rng"] is not None:
            restore_rng(per_rank["rng"])
