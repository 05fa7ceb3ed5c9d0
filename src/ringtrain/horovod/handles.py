"""What every Horovod collective shares: argument checks and the asynchronous handles.

An operation is submitted through :func:`_submit` (a
:class:`~ringtrain.horovod.coordinator.Request`, matched across ranks by name) and registered
under an integer handle; :func:`poll` and :func:`synchronize` are Horovod's way to test and wait
for it. A ``RuntimeError`` raised because a
peer is gone becomes :class:`~ringtrain.horovod.runtime.HorovodInternalError` (what
``hvd.elastic.run`` catches). The ``_parse_op``/``_view``/wire helpers turn Horovod's arguments
(op codes, process sets, int16 tensors) into what ``torch.distributed`` takes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.fusion import (
    ReduceOp,
    check_op,
)
from ringtrain.horovod.coordinator import Launch, progress, submit, wait
from ringtrain.horovod.process_sets import ProcessSet, SetView
from ringtrain.horovod.runtime import HorovodInternalError, runtime


def _parse_op(op: Any) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`; Adasum passes here and is refused by :func:`_negotiate_op`
    after the metadata exchange, so that every rank raises."""
    try:
        return ReduceOp(int(op))
    except (ValueError, TypeError):
        return check_op(op)  # raises ValueError naming the valid ops


def _resolve_op(average: bool | None, op: Any) -> ReduceOp:
    if average is not None and op is not None:
        raise ValueError("pass either average= (deprecated) or op=, not both")
    if op is None:
        return ReduceOp.Average if average is None or average else ReduceOp.Sum
    return _parse_op(op)


def _view(process_set: ProcessSet | None, what: str) -> SetView:
    """The set an operation runs on; ``ValueError`` (on this rank only: it is no participant)
    if this rank is not a member."""
    view = runtime().set_view(None if process_set is None else process_set)
    view.require_member(what)
    return view


def _check_process_set(process_set: ProcessSet | None) -> None:
    """Validate ``process_set`` (registered, this rank a member)."""
    _view(process_set, "collective")


#: gloo and NCCL have no 16-bit integer type: such tensors travel as int32 (exact).
_TRANSPORT = {torch.int16: torch.int32}


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    wire = _TRANSPORT.get(t.dtype)
    return t if wire is None else t.to(wire)


def _from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _is_peer_failure(exc: BaseException) -> bool:
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return any(s in text for s in ("Connection closed", "Connection reset", "gloo", "NCCL"))


def _submit(
    kind: str,
    name: str | None,
    tensors: Sequence[torch.Tensor],
    launch: Launch,
    view: SetView,
    **row: Any,
) -> int:
    """Submit an operation (one exchange round: launched at once if every member already
    submitted it) and register it; returns its handle. ``row`` is passed to
    :func:`~ringtrain.horovod.coordinator.submit` (``vary_first_dim``, ``extra``, ``splits``,
    ``payload``).

    Raises:
        ValueError: at once, on this rank only, if an operation named ``name`` is in flight.
        HorovodInternalError: if a peer is gone.
    """
    request = submit(kind, name, tensors, launch, view, blocking=False, **row)
    return runtime().add(request)


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` will not block).

    An operation not yet matched across ranks runs one exchange round first (so a rank that
    polls in a loop lets its peers match it).
    """
    if callable(handle):  # sparse_allreduce_async's handle (as in Horovod)
        return True
    request = runtime().take(handle)
    if request.state == "queued":
        progress(request, blocking=False)
    return request.state == "failed" or (request.state == "launched" and request.is_completed())


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output.

    Raises:
        RuntimeError: on every rank that submitted it, if the ranks' calls did not match (or
            can never meet, or it is not allreduce and a rank has joined).
        HorovodInternalError: if the collective failed because a peer is gone.
        ValueError: for an unknown (or already synchronized) handle.
    """
    if callable(handle):  # sparse_allreduce_async returns a function (as in Horovod)
        return handle()
    rt = runtime()
    request = rt.take(handle)
    try:
        return wait(request)
    except RuntimeError as exc:
        if _is_peer_failure(exc) and not isinstance(exc, HorovodInternalError):
            raise HorovodInternalError(f"{request.label} failed: {exc}") from exc
        raise
    finally:
        with rt.lock:
            rt.handles.pop(handle, None)


def _as_1d(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor
