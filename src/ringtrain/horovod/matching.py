"""Which queued operations every rank of a process set is ready for: the decision half of
:mod:`ringtrain.horovod.coordinator`, pure (no process group).

As in Horovod, operations are matched across ranks **by name**: each rank keeps a queue of the
operations it has submitted and that are not matched yet, and every exchange round (one
``all_gather``) shows each rank every member's queue. An operation whose key (its name, or
``noname.<n>`` for the n-th unnamed operation of the set, Horovod's auto-generated names) is
queued on every member is *ready*; ready operations are launched in the order of the first
member's queue, the same order on every rank. What Horovod would leave hanging, ringtrain
refuses on every rank instead:

- two members queue the same key with different operations, dtypes or shapes: every member that
  queued it gets ``RuntimeError`` (Horovod's coordinator raises it too);
- every member is blocked (in ``synchronize``, a blocking collective, ``barrier``, ``join``) and
  no key is queued on all of them: the ranks wait for operations that will never meet (Horovod
  hangs here); every member's queued operations fail with ``RuntimeError``.

``hvd.join()`` is a queue entry too. A member that has joined counts as ready for any allreduce:
it contributes zeros (Horovod's semantics; ``Average`` still divides by the set's size); any other
operation ready on the members that have not joined fails on them with ``RuntimeError`` ("not
supported with Join", as Horovod). When every member has joined, ``join()`` returns on all of
them the rank that joined last.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ringtrain.horovod.metadata import DTYPES, EXTRA, KIND, NAME, hash63, mismatches

#: Every operation kind a queue may hold (for error messages: rows carry 63-bit hashes).
KINDS = (
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "alltoall",
    "reducescatter",
    "grouped_reducescatter",
    "barrier",
    "join",
    "broadcast_parameters",
    "broadcast_object",
    "allgather_object",
    "DistributedOptimizer",
    "add_process_set",
    "remove_process_set",
)
KIND_NAMES = {hash63(k): k for k in KINDS}
JOIN = hash63("join")
#: The key of a ``join()`` entry (never matched by name: see :func:`plan_round`).
JOIN_KEY = "\x00join"
#: Operations a joined member can serve (with zeros).
ZERO_FILLABLE = {hash63("allreduce"), hash63("grouped_allreduce")}
#: Operations whose first dimension may differ across ranks.
VARY_FIRST_DIM = {hash63("allgather"), hash63("grouped_allgather"), hash63("alltoall")}
#: Operations that compare a signature (parameter names) in their shape hash.
SIGNED = {hash63("broadcast_parameters"), hash63("DistributedOptimizer")}
ADASUM = 2  # ReduceOp.Adasum: its code in a row's EXTRA field (op + 16 * process set id)


def unnamed_key(seq: int) -> str:
    """The key of the ``seq``-th unnamed operation of a process set (Horovod names unnamed
    operations ``<op>.noname.<handle>``; here the kind is compared separately)."""
    return f"\x00noname.{seq}"


def kind_name(code: int) -> str:
    """The operation a row's ``KIND`` field names."""
    return KIND_NAMES.get(code, f"operation #{code}")


@dataclass(frozen=True)
class Member:
    """What one member showed in an exchange round.

    Attributes:
        rank: its global rank.
        blocking: it waits for one of its queued operations (it cannot submit more until then).
        join_age: rounds it has spent in ``join()`` before this one (-1: not joined).
        seq: the sequence number its next unnamed operation will take.
        rows: its queued operations' rows (oldest first), each
            :func:`~ringtrain.horovod.metadata.metadata_row` plus the alltoall splits.
    """

    rank: int
    blocking: bool
    join_age: int
    seq: int
    rows: tuple[tuple[int, ...], ...]

    @property
    def joined(self) -> bool:
        return self.join_age >= 0

    def find(self, key: int) -> tuple[int, ...] | None:
        """The row queued under ``key`` (a ``NAME`` hash), if any."""
        for row in self.rows:
            if row[NAME] == key and row[KIND] != JOIN:
                return row
        return None


@dataclass(frozen=True)
class Ready:
    """An operation every member that has not joined queued.

    Attributes:
        key: its ``NAME`` hash.
        participants: indices of the members that queued it (they launch it, or all raise
            ``error``).
        zero_fill: indices of joined members that did not queue it (they contribute zeros).
        error: ``(exception type, text)`` every participant raises instead of launching it.
    """

    key: int
    participants: tuple[int, ...]
    zero_fill: tuple[int, ...]
    error: tuple[type[Exception], str] | None


@dataclass(frozen=True)
class Plan:
    """What every member does after a round (the same on every member).

    Attributes:
        ready: operations to launch (or fail), in order.
        deadlock: set when every member waits and nothing is ready: the text each member that
            has not joined raises for all its queued operations.
        last_joined: set when every member has joined: ``join()``'s return value on all.
        seq: the unnamed sequence number every member continues from after a deadlock or a
            completed join (the largest shown), so that unnamed keys line up again.
    """

    ready: tuple[Ready, ...] = ()
    deadlock: str | None = None
    last_joined: int | None = None
    seq: int | None = None


def _check(members: Sequence[Member], ready: Ready) -> tuple[type[Exception], str] | None:
    rows = [members[i].find(ready.key) for i in ready.participants]
    full = [r for r in rows if r is not None]
    ranks = [members[i].rank for i in ready.participants]
    kinds = {r[KIND] for r in full}
    kind = full[0][KIND]
    signed = "" if kind in SIGNED else None
    problems = mismatches(full, ranks, len(kinds) == 1 and kind in VARY_FIRST_DIM, signed)
    if problems:
        return RuntimeError, "mismatched calls across ranks (" + "; ".join(problems) + ")"
    if ready.zero_fill:
        joined = [members[i].rank for i in ready.zero_fill]
        if kind not in ZERO_FILLABLE:
            return RuntimeError, (
                f"{kind_name(kind)} is not supported with Join at this time (rank(s) {joined} "
                "have called hvd.join()); only allreduce is: the joined ranks contribute zeros"
            )
        if full[0][EXTRA] % 16 == ADASUM:
            return NotImplementedError, "Adasum is not supported by ringtrain.horovod"
    return None


def _deadlock(members: Sequence[Member], active: Sequence[int]) -> str:
    waits = []
    for i in active:
        m = members[i]
        waits.append(f"rank {m.rank} waits in {kind_name(m.rows[-1][KIND])}")
    return (
        "no operation is queued on every rank of the process set (" + ", ".join(waits) + "): "
        "Horovod would hang here. Operations are matched by name, unnamed ones by their order; "
        "every rank must submit each operation (hvd.join() stands in only for allreduce)"
    )


def plan_round(members: Sequence[Member]) -> Plan:
    """Decide a round from every member's queue (see the module docstring).

    Args:
        members: every member of the process set, in set order; each has at least one row.

    Returns:
        The :class:`Plan` every member applies.
    """
    seq = max(m.seq for m in members)
    if all(m.joined for m in members):
        youngest = min(m.join_age for m in members)
        last = max(m.rank for m in members if m.join_age == youngest)
        return Plan(last_joined=last, seq=seq)
    active = [i for i, m in enumerate(members) if not m.joined]
    joined = [i for i, m in enumerate(members) if m.joined]
    ready: list[Ready] = []
    for row in members[active[0]].rows:
        key = row[NAME]
        if row[KIND] == JOIN or any(members[i].find(key) is None for i in active):
            continue
        participants = tuple(i for i, m in enumerate(members) if m.find(key) is not None)
        zero_fill = tuple(i for i in joined if i not in participants)
        candidate = Ready(key, participants, zero_fill, None)
        ready.append(Ready(key, participants, zero_fill, _check(members, candidate)))
    if not ready and all(m.blocking for m in members):
        return Plan(deadlock=_deadlock(members, active), seq=seq)
    return Plan(ready=tuple(ready))


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype a row's ``DTYPE`` code names (``None`` for a hashed, unknown dtype)."""
    return DTYPES[code] if 0 <= code < len(DTYPES) else None
