"""The elastic subset of ``horovod.torch.elastic`` on ringtrain's restart machinery.

Horovod elastic keeps training alive in-process: a lost peer raises ``HorovodInternalError``,
``hvd.elastic.run`` rolls the state back to the last ``commit()`` held in memory, re-forms the
ring with the surviving hosts and continues. ringtrain instead restarts the *whole worker group*
(a process restart by the controller, ``FailureConfig(max_failures=...)``) and resumes from the
run's latest checkpoint. The mapping:

- ``state.commit()`` (called on every rank) saves the in-memory copy that ``restore()`` returns
  to (as Horovod) **and** writes a ringtrain checkpoint: ``ringtrain.report({"hvd_commit": n},
  checkpoint=TrainState(model, optimizer, <every Stateful kwarg>))`` with the plain kwargs
  (``epoch=``, ``batch=``...) as the TrainState's extras. Rank 0 writes the model, optimizer,
  samplers and extras once; every rank writes its RNG state. Before saving, the
  :class:`ElasticSampler` s' processed indices are unioned over all ranks (one
  ``all_gather_object``), so the checkpoint records the global position. A commit therefore
  costs a checkpoint: commit as often as you would checkpoint.
- ``@hvd.elastic.run`` (the wrapper) first loads the latest checkpoint of the run, if any, into
  the state (``TrainState.restore``: model, optimizer, samplers, extras, RNG), calls the reset
  callbacks when this is a restarted attempt (``get_context().attempt > 0``, the analogue of a
  membership change), then ``state.sync()`` (rank 0's state to every rank), then the function.
- ``HorovodInternalError`` (a peer died) is not retried in-process: it propagates, the worker
  exits, and the controller restarts the group, which resumes at the last commit.

Outside a ringtrain run (torchrun, a single process) there is no run directory: ``commit()``
then only keeps the in-memory copy (and ringtrain logs once that nothing is saved).
"""

from __future__ import annotations

import copy
import functools
import math
import random
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ringtrain.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ringtrain.horovod.runtime import HorovodInternalError, init, is_initialized, rank, size

__all__ = ["ElasticSampler", "ObjectState", "State", "TorchState", "run"]

_PREFIX = "hvd."


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


class State:
    """Base of the elastic states: reset callbacks, ``commit``, ``check_host_updates``."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call each of ``callbacks`` (no arguments) after a restart, before training resumes
        (e.g. to rescale the learning rate to the new ``hvd.size()``)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks."""
        for callback in self._reset_callbacks:
            callback()

    def check_host_updates(self) -> None:
        """No-op: membership changes are whole-group restarts under ringtrain."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def commit(self) -> None:
        """Save the state (in memory, and as a ringtrain checkpoint); call it on every rank."""
        self.save()
        self.check_host_updates()


class ObjectState(State):
    """Plain attributes (``ObjectState(epoch=0, batch=0)``) committed, restored and synced."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def save(self) -> None:
        self._saved = {n: copy.deepcopy(getattr(self, n)) for n in self._names}

    def restore(self) -> None:
        for name, value in self._saved.items():
            setattr(self, name, copy.deepcopy(value))

    def sync(self) -> None:
        if self._names:
            values = broadcast_object({n: getattr(self, n) for n in self._names}, 0)
            for name, value in values.items():
                setattr(self, name, value)


class TorchState(State):
    """Model, optimizer and any other values of an elastic job.

    Args:
        model: a ``torch.nn.Module`` (or ``None``).
        optimizer: a ``torch.optim.Optimizer`` (or ``None``), e.g. the ``DistributedOptimizer``.
        **kwargs: attributes kept in the state: Stateful objects (``ElasticSampler``, LR
            schedulers: anything with ``state_dict``/``load_state_dict``) or plain values
            (numbers, strings, lists/dicts of them); read and assign them as ``state.epoch``.

    Attributes:
        commits: how many commits this state has made in this process.
        resumed_from: the checkpoint loaded at start (``None`` on a fresh run).
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.model = model
        self.optimizer = optimizer
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self.commits = 0
        self.resumed_from: Any = None
        self._train_state: Any = None
        self._saved: dict[str, Any] = {}
        self.save()

    # -------------------------------------------------------------- in memory
    def save(self) -> None:
        """Keep a deep copy of the state in memory (what :meth:`restore` returns to)."""
        saved: dict[str, Any] = {}
        if self.model is not None:
            saved["model"] = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            saved["optimizer"] = copy.deepcopy(self.optimizer.state_dict())
        for name in self._names:
            value = getattr(self, name)
            saved[_PREFIX + name] = copy.deepcopy(
                value.state_dict() if _is_stateful(value) else value
            )
        self._saved = saved

    def restore(self) -> None:
        """Roll back to the last :meth:`commit` (or the construction) in memory."""
        saved = self._saved
        if self.model is not None:
            self.model.load_state_dict(saved["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(saved["optimizer"])
        for name in self._names:
            value = getattr(self, name)
            if _is_stateful(value):
                value.load_state_dict(copy.deepcopy(saved[_PREFIX + name]))
            else:
                setattr(self, name, copy.deepcopy(saved[_PREFIX + name]))

    def sync(self) -> None:
        """Make every rank's state rank 0's (parameters, optimizer, samplers, plain values)."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        plain = {}
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, ElasticSampler):
                value.sync()
            elif _is_stateful(value):
                value.load_state_dict(broadcast_object(value.state_dict(), 0))
            else:
                plain[name] = value
        if plain:
            for name, value in broadcast_object(plain, 0).items():
                setattr(self, name, value)

    # -------------------------------------------------------------- ringtrain checkpoints
    def _stateful(self) -> dict[str, Any]:
        return {
            _PREFIX + n: getattr(self, n) for n in self._names if _is_stateful(getattr(self, n))
        }

    def _get_train_state(self) -> Any:
        from ringtrain.worker.state import TrainState

        if self._train_state is None:
            self._train_state = TrainState(
                model=self.model, optimizer=self.optimizer, **self._stateful()
            )
        return self._train_state

    def commit(self) -> None:
        """Save in memory and write a ringtrain checkpoint of the state (on every rank)."""
        import ringtrain

        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, ElasticSampler):
                value.sync_processed()
        self.save()
        ts = self._get_train_state()
        metrics: dict[str, Any] = {"hvd_commit": self.commits}
        for name in self._names:
            value = getattr(self, name)
            if not _is_stateful(value):
                ts[_PREFIX + name] = value
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metrics[name] = value
        ts.step = self.commits
        self.commits += 1
        ringtrain.report(metrics, checkpoint=ts)
        self.check_host_updates()

    def load_checkpoint(self, checkpoint: Any = None) -> bool:
        """Load the run's latest checkpoint (or ``checkpoint``) written by :meth:`commit`.

        Returns:
            True if a checkpoint was loaded.
        """
        ts = self._get_train_state()
        if not ts.restore(checkpoint):
            return False
        for name in self._names:
            key = _PREFIX + name
            if not _is_stateful(getattr(self, name)) and key in ts.extras:
                setattr(self, name, ts.extras[key])
        self.commits = ts.step + 1
        self.resumed_from = ts.restored_from
        self.save()
        return True


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``func(state, *args, **kwargs)`` of an elastic job.

    Before calling it: ``hvd.init()`` if needed, load the run's latest checkpoint into ``state``
    (after a restart), run the reset callbacks on a restarted attempt, and ``state.sync()``.
    ``HorovodInternalError`` propagates: ringtrain's controller restarts the worker group, which
    resumes from the last commit.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        from ringtrain.worker.session import get_context

        if not is_initialized():
            init()
        if (
            isinstance(state, TorchState)
            and state.resumed_from is None
            and state.load_checkpoint()
            and get_context().attempt > 0
        ):
            state.on_reset()
        state.sync()
        try:
            return func(state, *args, **kwargs)
        except HorovodInternalError:
            # A peer is gone: this group cannot continue. The controller restarts every worker
            # from the last committed checkpoint (FailureConfig.max_failures).
            raise

    return wrapper


class ElasticSampler(torch.utils.data.Sampler[int]):
    """Shards a dataset over the ranks and skips the samples already processed this epoch, so
    that a resumed (or resized) job finishes the epoch without repeating or dropping samples.

    As Horovod's: call ``record_batch(batch_idx, batch_size)`` (or ``record_indices``) after each
    batch, ``set_epoch(epoch)`` at the start of each epoch; the state (epoch and processed
    indices) is committed with the :class:`TorchState`.

    Args:
        dataset: a map-style dataset (``len(dataset)`` samples).
        shuffle: shuffle the indices each epoch (seeded by ``seed + epoch``).
        seed: the shuffle seed, identical on every rank.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch``: forget the processed indices and reshuffle."""
        self.epoch = epoch
        self.processed_indices = set()
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark this rank's samples of batch ``batch_idx`` (of the current iteration) processed."""
        self.record_indices(self.get_indices(batch_idx, batch_size))

    def record_indices(self, indices: Iterable[int]) -> None:
        """Mark dataset ``indices`` processed."""
        self.processed_indices.update(int(i) for i in indices)

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's dataset indices of batch ``batch_idx``."""
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "processed_indices"}`` (indices as a sorted list)."""
        return {"epoch": self.epoch, "processed_indices": sorted(self.processed_indices)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        self.reset()

    def sync_processed(self) -> None:
        """Union the processed indices of every rank (one ``all_gather_object``)."""
        if is_initialized() and size() > 1:
            for part in allgather_object(sorted(self.processed_indices)):
                self.processed_indices.update(part)

    def sync(self) -> None:
        """Union the ranks' processed indices, then take rank 0's epoch; re-shard."""
        self.sync_processed()
        state = self.state_dict()
        if is_initialized() and size() > 1:
            state = broadcast_object(state, 0)
        self.load_state_dict(state)

    def reset(self) -> None:
        """Re-shard the unprocessed indices of this epoch over the current ranks."""
        if is_initialized():
            self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = [i for i in order if i not in self.processed_indices]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self.indices = self._shard()

    def _shard(self) -> list[int]:
        indices = self.remaining_indices[:]
        if indices:
            indices += (indices * math.ceil(self.total_size / len(indices)))[
                : self.total_size - len(indices)
            ]
        return indices[self.rank : self.total_size : self.num_replicas]

    def __iter__(self) -> Iterator[int]:
        self.indices = self._shard()
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples
