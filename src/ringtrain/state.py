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

Both are loaded with ``torch.load(weights_only=True)``: a checkpoint file can never run code. The
contract: restore, then continue, and the parameters are bit-identical to never having stopped
(on CPU, or on GPU with deterministic kernels), because every source of nondeterminism between two
steps is in the state: parameters, optimizer moments, schedule, the RNG streams and data order
(randomness inside DataLoader worker processes is seeded per sample by ``prepare_data_loader``).
"""

from __future__ import annotations

import io
import logging
import os
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ringtrain.checkpoint.checkpoint import Checkpoint, CheckpointLoadError
from ringtrain.session import get_checkpoint, get_context, mark_progress, note_epoch

logger = logging.getLogger("ringtrain")

STATE_FILE = "train_state.pt"
FORMAT = 1
_NAMED = ("model", "optimizer", "lr_scheduler", "grad_scaler", "data_loader")
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def rank_file(rank: int) -> str:
    """The per-rank file of ``rank`` in a TrainState checkpoint."""
    return f"rank_{rank:05d}.pt"


def _find_unsavable(value: Any, where: str, depth: int = 0) -> str | None:
    """The first place in ``value`` that ``torch.load(weights_only=True)`` could not read back.

    Types are checked exactly: a subclass of ``float`` (``np.float64``), of ``int`` (an
    ``IntEnum``), of ``tuple`` (a namedtuple) or of ``dict`` (``defaultdict``) pickles as its own
    class, which a weights-only load refuses.
    """
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _PLAIN:
        return None
    if depth > 64:
        return f"{where} is nested too deeply"
    if kind in (dict, OrderedDict):
        for k, v in value.items():
            if type(k) not in (str, int, float, bool, type(None)):
                return f"{where} has a key of type {type(k).__name__}"
            found = _find_unsavable(v, f"{where}[{k!r}]", depth + 1)
            if found:
                return found
        return None
    if kind in (list, tuple, set):
        for i, v in enumerate(value):
            found = _find_unsavable(v, f"{where}[{i}]", depth + 1)
            if found:
                return found
        return None
    hint = " (convert it with float()/int())" if isinstance(value, (int, float)) else ""
    return f"{where} is a {kind.__module__}.{kind.__qualname__}{hint}"


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


RANK_STATE_ATTR = "_ringtrain_rank_state"
_PENDING_ATTR = "_ringtrain_pending_rank_state"


def attach_rank_state(model: Any, name: str, obj: Any) -> None:
    """Attach a Stateful ``obj`` that differs across ranks to a prepared ``model`` (a
    communication hook's state, a gradient accumulation counter): a TrainState holding the model
    saves ``obj.state_dict()`` in each rank's file and restores it on resume. An object attached
    after ``TrainState.restore()`` gets the restored state when it is attached."""
    target = _unwrap(model)
    target.__dict__.setdefault(RANK_STATE_ATTR, {})[name] = obj
    pending = target.__dict__.get(_PENDING_ATTR) or {}
    if name in pending:
        obj.load_state_dict(pending.pop(name))


def _model_rank_state(model: Any) -> dict[str, Any]:
    if model is None:
        return {}
    return dict(getattr(_unwrap(model), RANK_STATE_ATTR, None) or {})


def _unwrap(model: Any) -> Any:
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def _stage(value: Any, reuse: Any = None) -> Any:
    """A copy of ``value`` whose tensors live in host memory the caller owns: safe to write from
    another thread while training goes on mutating the originals.

    ``reuse`` is the previous staged copy (its write has finished): a tensor of the same shape and
    dtype is copied into in place instead of allocated, which is most of the cost of staging
    (fresh pages must be faulted in and zeroed). CUDA tensors are copied into pinned buffers with
    ``non_blocking=True``; the caller synchronises once at the end.
    """
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == t.shape
            and reuse.dtype == t.dtype
            and reuse.device.type == "cpu"
            and reuse.layout == t.layout == torch.strided
        ):
            return reuse.copy_(t, non_blocking=t.is_cuda)
        if t.device.type == "cpu":
            return t.clone()
        if t.is_cuda and t.layout == torch.strided:
            buffer = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return buffer.copy_(t, non_blocking=True)
        return t.to("cpu")
    if isinstance(value, OrderedDict):
        old = reuse if isinstance(reuse, dict) else {}
        staged = OrderedDict((k, _stage(v, old.get(k))) for k, v in value.items())
        metadata = getattr(value, "_metadata", None)
        if metadata is not None:  # module versions, kept by a module's state_dict()
            staged._metadata = metadata  # type: ignore[attr-defined]
        return staged
    if isinstance(value, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: _stage(v, old.get(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        old_seq = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(value) else None
        items = [_stage(v, old_seq[i] if old_seq else None) for i, v in enumerate(value)]
        return items if isinstance(value, list) else tuple(items)
    return value


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: Python, NumPy (legacy global), torch CPU, CUDA (if used)."""
    np_state = np.random.get_state(legacy=False)
    assert isinstance(np_state, dict)
    key = np_state["state"]["key"]
    rng: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict[str, Any]) -> None:
    """Set the RNG states :func:`capture_rng` returned."""
    random.setstate(_as_tuple(rng["python"]))
    n = rng["numpy"]
    np.random.set_state(
        {
            "bit_generator": n["bit_generator"],
            "state": {"key": n["key"].numpy().astype(np.uint32), "pos": int(n["pos"])},
            "has_gauss": int(n["has_gauss"]),
            "gauss": float(n["gauss"]),
        }
    )
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
        else:
            logger.warning(
                "checkpoint has CUDA RNG states for %d devices, this process sees %d; "
                "CUDA RNG not restored",
                len(states),
                torch.cuda.device_count(),
            )


def _as_tuple(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_as_tuple(v) for v in value)
    return value


def _torch_writer(obj: Any) -> Callable[[Any], None]:
    return lambda f: torch.save(obj, f)


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
        for name, obj in [*named.items(), *extras.items()]:
            if obj is None and name in _NAMED:
                continue
            if isinstance(obj, torch.utils.data.DataLoader):
                problems.append(
                    f"{name}: a torch DataLoader has no saved position; pass the loader "
                    "returned by ringtrain.prepare_data_loader()"
                )
            elif _is_stateful(obj):
                target = _unwrap(obj) if name == "model" else obj
                try:
                    found = _find_unsavable(target.state_dict(), f"{name}.state_dict()")
                except Exception as exc:  # a state_dict() that cannot even be built
                    found = f"{name}.state_dict() raised {type(exc).__name__}: {exc}"
                if found:
                    problems.append(f"{name}: {found}, which a weights_only checkpoint cannot hold")
                objects[name] = obj
            elif name in _NAMED:
                problems.append(
                    f"{name}: a {type(obj).__name__} has no state_dict()/load_state_dict()"
                )
            else:
                found = _find_unsavable(obj, name)
                if found:
                    problems.append(
                        f"{name}: {found}; extras must be Stateful (state_dict/load_state_dict) "
                        "or plain values (numbers, strings, tensors, lists and dicts of them)"
                    )
                plain[name] = obj
        from ringtrain.checkpoint.sharded import sharded_objects

        self._sharded, sharded_problems = sharded_objects(objects)
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
        """The step counter; setting it counts as progress for hang detection."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = int(value)
        mark_progress(self._step)
        elastic = _elastic_runtime()
        if elastic is not None:  # elastic runs: in-memory snapshots at step boundaries
            elastic.on_step(self)

    @property
    def data_loader(self) -> Any:
        return self._objects.get("data_loader")

    def __getitem__(self, name: str) -> Any:
        if name in self.extras:
            return self.extras[name]
        return self._objects[name]

    def __setitem__(self, name: str, value: Any) -> None:
        if name in self._objects:
            raise KeyError(f"{name!r} is a registered Stateful object; it cannot be replaced")
        found = _find_unsavable(value, name)
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

    # ------------------------------------------------------------------ saving
    def _shared_payload(self) -> dict[str, Any]:
        objects = {}
        for name, obj in self._objects.items():
            if name == "data_loader" or name in self._sharded:
                continue
            objects[name] = (_unwrap(obj) if name == "model" else obj).state_dict()
        return {
            "format": FORMAT,
            "step": self._step,
            "epoch": self.epoch,
            "world_size": get_context().world_size,
            "sharded": sorted(self._sharded),  # saved with torch.distributed.checkpoint
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
                for name, obj in _model_rank_state(self._objects.get("model")).items()
            },
        }

    def _checkpoint_writers(self, stage: bool) -> dict[str, Callable[[Any], None]]:
        """This rank's files of a checkpoint, as ``name -> writer``. With ``stage``, every tensor
        is first copied to fresh host memory, so the writers may run on another thread while
        training continues."""
        rank = get_context().world_rank
        payloads = {rank_file(rank): self._rank_payload()}
        if rank == 0:
            payloads[STATE_FILE] = self._shared_payload()
        if stage:
            # The previous staged copy is free (its write finished before this save began):
            # copy into its buffers rather than allocating new ones.
            previous = self._staged
            payloads = {name: _stage(obj, previous.get(name)) for name, obj in payloads.items()}
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()
            self._staged = payloads
        writers = {name: _torch_writer(obj) for name, obj in payloads.items()}
        if self._sharded:
            writers.update(self._sharded_writers(rank, stage))
        return writers

    def _sharded_writers(self, rank: int, stage: bool) -> dict[str, Callable[[Any], None]]:
        """Save the FSDP model and optimizer with DCP (collective) into a local temporary
        directory, and return writers that copy this rank's files from there. With ``stage``,
        ``dcp.async_save`` copies the shards to host memory and returns; the writers wait for
        its files."""
        from ringtrain.checkpoint import sharded

        group = None
        if stage:
            import torch.distributed as dist

            if self._dcp_group is None:  # every rank saves at the same report: collective
                self._dcp_group = dist.new_group(backend="gloo")
            group = self._dcp_group
        state = sharded.state_dict_of(
            self._objects["model"],
            self._objects.get("optimizer") if "optimizer" in self._sharded else None,
        )
        directory, wait = sharded.save_to_local(state, rank, async_group=group)
        return sharded.file_writers(directory, rank, wait)

    # ------------------------------------------------------------------ restoring
    def restore(self, checkpoint: Checkpoint | None = None) -> bool:
        """Load the state of ``checkpoint`` (default: the run's latest, ``get_checkpoint()``).

        A no-op returning False on a fresh run. Reads only files the checkpoint's signed manifest
        lists, hashing each as it is read, and loads them with ``weights_only=True``
        (docs/security.md).

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
        rank = get_context().world_rank
        shared = _load(ckpt, STATE_FILE)
        if shared is None:
            raise ValueError(
                f"{ckpt.uri} holds no {STATE_FILE}: it was not saved from a TrainState "
                "(report(..., checkpoint=state))"
            )
        _require(ckpt, STATE_FILE, shared, ("objects", "step", "epoch"))
        saved = shared["objects"]
        saved_sharded = set(shared.get("sharded") or ())
        if saved_sharded != self._sharded:
            then = ", ".join(sorted(saved_sharded)) or "nothing"
            now = ", ".join(sorted(self._sharded)) or "nothing"
            raise ValueError(
                f"{ckpt.uri} was saved with {then} sharded (FSDP), this TrainState has {now}"
                " sharded: resume with the same prepare_model(parallel_strategy=...), or turn the "
                "checkpoint into a plain state dict with ringtrain.export_model"
            )
        missing = [
            n
            for n in self._objects
            if n != "data_loader" and n not in saved and n not in saved_sharded
        ]
        if missing:
            raise ValueError(
                f"{ckpt.uri} has no state for {', '.join(missing)} (registered in this "
                "TrainState, absent when the checkpoint was saved)"
            )
        for name, obj in self._objects.items():
            if name == "data_loader" or name in self._sharded:
                continue
            (_unwrap(obj) if name == "model" else obj).load_state_dict(saved[name])
        if "model" in self._objects and "model" not in self._sharded:
            from ringtrain.elastic.worker import mark_restored

            mark_restored(_unwrap(self._objects["model"]), ckpt)
        if self._sharded:
            from ringtrain.checkpoint.sharded import restore_objects

            optimizer = self._objects["optimizer"] if "optimizer" in self._sharded else None
            in_memory = getattr(ckpt, "in_memory_files", None) is not None
            if in_memory:  # pragma: no cover - elastic snapshots never hold sharded state
                restore_objects(self._objects["model"], optimizer, ckpt.path, ckpt.filesystem)
            else:
                # DCP reads whichever files hold this rank's slices: it gets a private copy of
                # the verified files, never the storage itself.
                with ckpt.verified_directory(_is_dcp_file) as local:
                    restore_objects(self._objects["model"], optimizer, local, None)
        extra_saved = [n for n in saved if n not in self._objects]
        if extra_saved:
            logger.warning("checkpoint state for %s ignored (not registered)", extra_saved)
        self.extras.update(shared.get("extras") or {})
        self._step = int(shared["step"])
        self.epoch = int(shared["epoch"])
        per_rank = _load(ckpt, rank_file(rank))
        if per_rank is not None:
            _require(ckpt, rank_file(rank), per_rank, ("rng",))
        saved_world = int(shared.get("world_size") or 1)
        world = get_context().world_size
        if per_rank is None and saved_world == world:
            raise ValueError(
                f"{ckpt.uri} has no {rank_file(rank)}: it was saved by "
                f"{shared.get('world_size')} workers, this run has {get_context().world_size}"
            )
        loader_state = (per_rank or {}).get("data_loader")
        if saved_world != world and not shared.get("elastic"):
            logger.warning(
                "resuming a checkpoint of %d workers with %d: not bit-exact (the data position "
                "is converted to the new world size; ranks >= %d keep their own RNG streams)",
                saved_world,
                world,
                saved_world,
            )
        if saved_world != world:
            if loader_state is None:  # a new rank: every rank has consumed the same samples
                loader_state = (_load(ckpt, rank_file(0)) or {}).get("data_loader")
            if loader_state is not None and self.data_loader is not None:
                loader_state = _reshard_loader_state(loader_state, self.data_loader)
            per_rank = per_rank or {"rng": None}
        loader = self.data_loader
        if loader is not None and loader_state is not None:
            loader.load_state_dict(loader_state)
            # A checkpoint taken after the loader ran off the end of an epoch (but before the
            # epoch loop advanced) resumes at the next epoch, not at a replay of this one.
            if getattr(loader, "batch", None) == 0 and getattr(loader, "epoch", 0) > self.epoch:
                self.epoch = int(loader.epoch)
        saved_rank_state = dict(per_rank.get("model_rank_state") or {})
        model = self._objects.get("model")
        for name, obj in _model_rank_state(model).items():
            if name in saved_rank_state:
                obj.load_state_dict(saved_rank_state.pop(name))
            else:
                logger.warning("checkpoint has no per-rank %s state; it starts afresh", name)
        if model is not None and saved_rank_state:  # for objects attached later
            _unwrap(model).__dict__[_PENDING_ATTR] = saved_rank_state
        if per_rank["rng"] is not None:
            restore_rng(per_rank["rng"])
        self.restored_from = ckpt
        logger.info("restored step %d, epoch %d from %s", self._step, self.epoch, ckpt.uri)
        return True


def _is_dcp_file(name: str) -> bool:
    from ringtrain.checkpoint.sharded import METADATA

    return name == METADATA or name.endswith(".distcp")


def _reshard_loader_state(state: dict[str, Any], loader: Any) -> dict[str, Any]:
    """A data loader position saved at another world size (or per-rank batch size), converted
    for ``loader``: the same global sample offset into the same epoch's shuffle order (which
    depends only on the seed and the epoch), rounded down to a whole global batch of the new
    run. A loader that is not a ringtrain ``PreparedDataLoader`` gets ``state`` unchanged.
    """
    world = getattr(loader, "world_size", None)
    batch_size = getattr(loader, "batch_size", None)
    if world is None or not batch_size or "samples" not in state:
        return state
    per_step = world * batch_size
    samples = int(state["samples"])
    if samples >= len(loader.dataset):  # the saved epoch was consumed to its end
        batch = len(loader)
    else:
        batch = samples // per_step
        if samples % per_step:
            logger.warning(
                "data position %d is not a multiple of the new global batch (%d workers x %d): "
                "resuming at sample %d of the epoch (%d samples are seen again)",
                samples,
                world,
                batch_size,
                batch * per_step,
                samples - batch * per_step,
            )
    return {
        **state,
        "batch": batch,
        "samples": min(batch * per_step, samples),
        "world_size": world,
        "batch_size": batch_size,
    }


def _elastic_runtime() -> Any:
    from ringtrain import session

    current = session._session
    return current.elastic if current is not None else None


def _load(ckpt: Checkpoint, name: str) -> Any:
    """File ``name`` of ``ckpt``, or None when its manifest does not list it.

    The bytes are read once, checked against the manifest's size and SHA-256, and only then
    given to ``torch.load(weights_only=True)``: nothing can change between the check and the
    load, and a file that is not listed is never read.

    Raises:
        CheckpointLoadError: the manifest is missing or unsigned, the file is listed but unsafe
            or altered, or ``torch.load`` refuses its content.
    """
    in_memory = getattr(ckpt, "in_memory_files", None)
    if in_memory is not None:  # an elastic snapshot (ringtrain.elastic.snapshot)
        return in_memory.get(name)
    try:
        if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
            # Copied and hashed in one pass into a private in-memory file, then memory-mapped:
            # the bytes are held once (no buffer beside the tensors made from it).
            fd = ckpt.verified_fd(name)
            if fd is None:
                return None
            try:
                return torch.load(
                    f"/proc/self/fd/{fd}", weights_only=True, map_location="cpu", mmap=True
                )
            finally:
                os.close(fd)
        data = ckpt.read_file(name)
        if data is None:
            return None
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except CheckpointLoadError:
        raise
    except Exception as exc:
        lines = str(exc).strip().splitlines() or [""]
        # torch's weights_only refusal is a page of advice; the line naming the global is it.
        why = next((ln.strip() for ln in lines if "WeightsUnpickler error" in ln), lines[0])
        raise CheckpointLoadError(ckpt.uri, f"{name}: {type(exc).__name__}: {why}") from exc


def _require(ckpt: Checkpoint, name: str, payload: Any, keys: tuple[str, ...]) -> None:
    """Refuse a loaded file whose layout is not a TrainState file's: a checkpoint that loads
    but holds the wrong thing is as unloadable as a corrupt one."""
    if not isinstance(payload, dict) or any(k not in payload for k in keys):
        raise CheckpointLoadError(
            ckpt.uri, f"{name} does not hold a TrainState (expected a dict with {list(keys)})"
        )
