"""The coordinator of ringtrain.horovod: per-rank queues of submitted operations, matched across
ranks by name in exchange rounds (Horovod's coordinator, without its background thread).

Every operation is a :class:`Request` queued on its process set. A rank that needs progress (it
submits an operation, waits for one, polls one) runs an exchange round: one ``all_gather`` over
the set's group of each member's queue head (a second one only when some member has more than
one operation queued). :func:`~ringtrain.horovod.matching.plan_round` then decides, identically
on every member, which operations are ready; each member launches its ready operations' data
collectives in that order (so every rank issues the same collectives in the same order), fails
those the plan refuses, and contributes zeros to the allreduces of its peers once it has joined.

A submit runs one round (an operation whose peers already submitted it is launched at once, as
before); ``synchronize`` and the blocking collectives run rounds until their operation is
matched. Because the round is collective, a rank still needs its peers to reach *some*
``hvd`` call; what it no longer needs is for them to reach the *same* call in the same order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ringtrain.horovod import joiner
from ringtrain.horovod.errors import HorovodInternalError
from ringtrain.horovod.matching import JOIN_KEY, Member, Plan, plan_round, unnamed_key
from ringtrain.horovod.metadata import HEADER, NAME, metadata_row
from ringtrain.horovod.process_sets import SetView
from ringtrain.horovod.slot import runtime

if TYPE_CHECKING:
    from ringtrain.horovod.runtime import Runtime

__all__ = ["Match", "Request", "progress", "submit", "wait"]


@dataclass(frozen=True)
class Match:
    """What a launch is given once its operation is matched.

    Attributes:
        rows: every participant's row, in set order (every member's, unless some have joined).
        zero_fill: set ranks (indices) of the joined members that contribute zeros.
        src: the global rank of the first participant (it sends the layout to the zero-fillers).
    """

    rows: list[list[int]]
    zero_fill: tuple[int, ...]
    src: int


Launch = Callable[[Match], tuple[Callable[[], bool], Callable[[], Any]]]


@dataclass
class Request:
    """One submitted operation.

    Attributes:
        kind: the operation (``"allreduce"``...).
        name: the user's name (``None``: unnamed).
        row: its metadata row plus the alltoall splits.
        launch: starts its data collectives once matched; returns ``(is_completed, finish)``.
        view: its process set.
        state: ``"queued"``, ``"launched"`` or ``"failed"``.
    """

    kind: str
    name: str | None
    row: list[int]
    launch: Launch
    view: SetView
    state: str = "queued"
    is_completed: Callable[[], bool] = field(default=lambda: False)
    finish: Callable[[], Any] = field(default=lambda: None)
    error: BaseException | None = None

    @property
    def label(self) -> str:
        return self.kind + (f" {self.name!r}" if self.name else "")

    def fail(self, error: BaseException) -> None:
        self.state, self.error = "failed", error


def submit(
    kind: str,
    name: str | None,
    tensors: Sequence[torch.Tensor],
    launch: Launch,
    view: SetView,
    *,
    blocking: bool,
    vary_first_dim: bool = False,
    extra: int = 0,
    splits: Sequence[int] | None = None,
    payload: int = 0,
    signature: str | None = None,
) -> Request:
    """Queue an operation and run one exchange round (``blocking``: until it is matched).

    Raises:
        ValueError: on this rank only, at once, if an operation of the same ``name`` is in
            flight on this rank (submitted and not yet synchronized): Horovod's duplicate-name
            error. Nothing is sent.
        HorovodInternalError: if the exchange fails because a peer is gone.
    """
    rt = runtime()
    with rt.coord_lock:
        if name is not None and name in rt.inflight_names:
            raise ValueError(
                f"{kind} {name!r}: an operation named {name!r} is already in flight on this rank; "
                "synchronize() its handle before reusing the name, or give this one another name"
            )
        if kind == "join":
            key = JOIN_KEY
        elif name is not None:
            key = name
        else:
            key = unnamed_key(rt.seqs.get(view.process_set_id, 0))
            rt.seqs[view.process_set_id] = rt.seqs.get(view.process_set_id, 0) + 1
        row = metadata_row(kind, key, tensors, vary_first_dim, extra, payload, signature)
        row += list(splits) if splits is not None else [0] * view.size
        request = Request(kind=kind, name=name, row=row, launch=launch, view=view)
        if name is not None:
            rt.inflight_names.add(name)
        rt.queues.setdefault(view.process_set_id, []).append(request)
        progress(request, blocking=blocking)
    return request


def wait(request: Request) -> Any:
    """Run rounds until ``request`` is matched, then wait for its data and return its result;
    releases its name.

    Raises:
        RuntimeError: (or ``ValueError``, ``NotImplementedError``) the error the round plan or
            the launch gave the operation; every rank that submitted it raises the same type.
        HorovodInternalError: if a collective fails because a peer is gone.
    """
    rt = runtime()
    try:
        if request.state == "queued":
            progress(request, blocking=True)
        if request.error is not None:
            raise request.error
        return request.finish()
    finally:
        rt.release_name(request.name)


def progress(request: Request, *, blocking: bool) -> None:
    """Run exchange rounds on ``request``'s process set: one, or (``blocking``) until it is no
    longer queued."""
    rt = runtime()
    view = request.view
    with rt.coord_lock:
        while request.state == "queued":
            queue = rt.queues[view.process_set_id]
            members = _exchange(rt, view, queue, blocking)
            _apply(rt, view, members, plan_round(members))
            if not blocking:
                return


def _member(rt: Runtime, view: SetView, queue: Sequence[Request], blocking: bool) -> Member:
    return Member(
        rank=rt.rank,
        blocking=blocking,
        join_age=rt.join_age if view.process_set_id == 0 else -1,
        seq=rt.seqs.get(view.process_set_id, 0),
        rows=tuple(tuple(r.row) for r in queue),
    )


def _exchange(rt: Runtime, view: SetView, queue: Sequence[Request], blocking: bool) -> list[Member]:
    """Every member's queue: one ``all_gather`` of ``[count, blocking, join age, seq, first
    row]``, and one more of the other rows when some member has several queued."""
    me = _member(rt, view, queue, blocking)
    if view.size == 1 or not rt.check:
        return [me]
    width = HEADER + view.size
    head = [len(queue), int(blocking), me.join_age, me.seq, *queue[0].row]
    try:
        heads = _all_gather(head, view)
        longest = max(h[0] for h in heads)
        rests: list[list[int]] = [[] for _ in heads]
        if longest > 1:
            mine = [v for r in queue[1:] for v in r.row]
            mine += [0] * ((longest - 1) * width - len(mine))
            rests = _all_gather(mine, view)
    except RuntimeError as exc:
        raise HorovodInternalError(f"the exchange of queued operations failed: {exc}") from exc
    members = []
    for i, (h, rest) in enumerate(zip(heads, rests, strict=True)):
        rows = [tuple(h[4:])] + [tuple(rest[k * width : (k + 1) * width]) for k in range(h[0] - 1)]
        members.append(Member(view.ranks[i], bool(h[1]), h[2], h[3], tuple(rows)))
    return members


def _all_gather(values: list[int], view: SetView) -> list[list[int]]:
    mine = torch.tensor(values, dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(view.size)]
    dist.all_gather(out, mine, group=view.group)
    return [t.tolist() for t in out]


def _apply(rt: Runtime, view: SetView, members: Sequence[Member], plan: Plan) -> None:
    """Carry out ``plan`` on this member (every member applies the same plan)."""
    queue = rt.queues[view.process_set_id]
    me = view.rank if len(members) > 1 else 0
    for ready in plan.ready:
        if me in ready.participants:
            request = next(r for r in queue if r.row[NAME] == ready.key and r.kind != "join")
            queue.remove(request)
            if ready.error is not None:
                kind, text = ready.error
                request.fail(kind(f"{request.label}: {text}"))
                continue
            rows = [list(members[i].find(ready.key) or ()) for i in ready.participants]
            match = Match(rows, ready.zero_fill, members[ready.participants[0]].rank)
            try:
                request.is_completed, request.finish = request.launch(match)
                request.state = "launched"
            except Exception as exc:  # raised before any data moved, on every participant
                request.fail(exc)
        elif me in ready.zero_fill and ready.error is None:
            joiner.serve_zeros(view, members, ready)
    if plan.seq is not None:
        rt.seqs[view.process_set_id] = plan.seq
    if plan.deadlock is not None and not members[me].joined:
        for request in list(queue):
            request.fail(RuntimeError(f"{request.label}: {plan.deadlock}"))
        queue.clear()
    if plan.last_joined is not None:
        for request in [r for r in queue if r.kind == "join"]:
            queue.remove(request)
            request.is_completed, request.finish = _done(plan.last_joined)
            request.state = "launched"
        rt.join_age = -1
    elif rt.join_age >= 0 and view.process_set_id == 0:
        rt.join_age += 1


def _done(value: Any) -> tuple[Callable[[], bool], Callable[[], Any]]:
    """``(is_completed, finish)`` of an operation already finished with ``value``."""
    return (lambda: True), (lambda: value)
