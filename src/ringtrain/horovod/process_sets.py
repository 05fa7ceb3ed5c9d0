"""Horovod process sets (``hvd.ProcessSet``, ``add_process_set``...) on ``torch.distributed``
subgroups.

A process set is a sorted list of global ranks with its own ``torch.distributed.new_group``;
every collective of ``ringtrain.horovod`` takes ``process_set=`` and then runs (metadata check
included) on that subgroup only. What we require, and why:

- ``add_process_set`` and ``remove_process_set`` are **collective over all ranks**, called in the
  same order with the same ranks (``torch.distributed.new_group`` must be called by every rank
  of the default group, members or not). Horovod requires the same in its dynamic mode
  (``HOROVOD_DYNAMIC_PROCESS_SETS=1``); ringtrain needs no switch. A rank that passes other ranks
  than its peers gets ``RuntimeError`` on every rank (the call is checked before the group is
  created).
- ``hvd.init(process_sets=[...])`` creates the listed sets in that order (Horovod's static sets).
- Process-set ids are given out in creation order (the global set is 0), so they agree across
  ranks.
- As in Horovod, ``root_rank`` of a broadcast is a *global* rank; ``ps.rank()`` is the rank
  inside the set (useful to index the result of an allgather).
- A rank outside the set that calls a collective on it gets ``ValueError`` at once (it is not a
  participant; the members are unaffected).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ringtrain.horovod.slot import runtime

__all__ = [
    "ProcessSet",
    "SetView",
    "add_process_set",
    "global_process_set",
    "remove_process_set",
]


class ProcessSet:
    """A set of ranks that run collectives together (Horovod's ``hvd.ProcessSet``).

    Args:
        ranks_or_comm: global ranks (any order, sorted here; duplicates refused). An mpi4py
            communicator is refused: there is no MPI (use a list of ranks).

    Attributes:
        process_set_id: ``None`` until registered (``hvd.init(process_sets=...)`` or
            :func:`add_process_set`), then an id equal on every rank; 0 is the global set.
        ranks: the sorted global ranks (for the global set: all ranks, once initialised).
        mpi_comm: always ``None``.

    Raises:
        ValueError: for non-integer or duplicate ranks.
        NotImplementedError: for an MPI communicator.
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        if not isinstance(ranks_or_comm, (list, tuple, range)) and not hasattr(
            ranks_or_comm, "__iter__"
        ):
            raise NotImplementedError(
                "ProcessSet(mpi_comm) needs MPI, which ringtrain.horovod does not use; pass the "
                "list of global ranks instead: hvd.ProcessSet([0, 1])"
            )
        ranks = sorted(ranks_or_comm)
        if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks):
            raise ValueError(
                "ProcessSet should be initialized with a list of process ranks (ints), got "
                f"{list(ranks_or_comm)!r}"
            )
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be distinct, got {ranks}")
        self.ranks = ranks

    def _view(self) -> SetView:
        return runtime().set_view(self)

    def size(self) -> int | None:
        """Number of ranks in the set (``None`` if not registered)."""
        if self.process_set_id is None:
            return None
        return self._view().size

    def rank(self) -> int | None:
        """This process's rank inside the set (``None`` if not registered or not a member).

        Collectives still take *global* ranks as ``root_rank`` (as Horovod)."""
        if self.process_set_id is None:
            return None
        view = self._view()
        return view.rank if view.included else None

    def included(self) -> bool | None:
        """Whether this process belongs to the set (``None`` if not registered)."""
        if self.process_set_id is None:
            return None
        return self._view().included

    def invalidate(self) -> None:
        """Forget the registration (done by :func:`remove_process_set`)."""
        self.process_set_id = None
        self.ranks = None

    def __str__(self) -> str:
        return (
            f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, "
            f"mpi_comm={self.mpi_comm})"
        )

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """All ranks (id 0). ``ranks`` is filled in by ``hvd.init()``."""

    def __init__(self) -> None:
        self.ranks = []
        self.process_set_id = 0

    def invalidate(self) -> None:  # the global set cannot be removed
        return


global_process_set: ProcessSet = _GlobalProcessSet()


@dataclass(frozen=True)
class SetView:
    """What a collective needs to know about a process set on this rank.

    Attributes:
        process_set_id: the set's id (0: global).
        ranks: its sorted global ranks.
        group: the ``torch.distributed`` group (``None``: the default group).
        size: ``len(ranks)``.
        rank: this process's index in ``ranks`` (``-1`` if not a member).
    """

    process_set_id: int
    ranks: tuple[int, ...]
    group: Any
    size: int
    rank: int

    @property
    def included(self) -> bool:
        return self.rank >= 0

    def require_member(self, what: str) -> None:
        """Raise ``ValueError`` if this process is not in the set."""
        if not self.included:
            raise ValueError(
                f"{what}: this rank is not a member of process set {self.process_set_id} "
                f"(ranks {list(self.ranks)}); call it on the members only, or pass a set that "
                "contains this rank"
            )

    def require_root(self, root_rank: int, what: str) -> None:
        """Raise ``ValueError`` if the global ``root_rank`` is not a member."""
        if root_rank not in self.ranks:
            raise ValueError(
                f"{what}: root_rank={root_rank} is not a member of process set "
                f"{self.process_set_id} (ranks {list(self.ranks)}); root_rank is a global rank "
                "(hvd.rank()), as in Horovod"
            )


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``hvd.init()`` and return it (collective: every rank calls
    it, in the same order, with the same ranks).

    Args:
        process_set: a :class:`ProcessSet` or a list of global ranks.

    Returns:
        The registered :class:`ProcessSet` (``process_set_id`` set).

    Raises:
        ValueError: on every rank, if a set with these ranks is already registered, or a rank is
            outside ``[0, size())``.
        RuntimeError: on every rank, if the ranks passed differ across ranks.
    """
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    runtime().register_set(ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (collective over all ranks); returns whether it was removed.

    The global set is never removed (returns ``False``). The set object is invalidated.

    Raises:
        RuntimeError: on every rank, if the ranks remove different sets.
    """
    return runtime().unregister_set(process_set)
