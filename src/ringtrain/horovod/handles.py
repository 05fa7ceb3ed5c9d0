"""What every Horovod collective shares: argument checks and the asynchronous handles.

An operation is launched through :func:`_submit`, which registers a
:class:`~ringtrain.horovod.runtime.Pending` under an integer handle; :func:`poll` and
:func:`synchronize` are Horovod's way to test and wait for it. A ``RuntimeError`` raised because a
peer is gone becomes :class:`~ringtrain.horovod.runtime.HorovodInternalError` (what
``hvd.elastic.run`` catches). The ``_parse_op``/``_view``/wire helpers turn Horovod's arguments
(op codes, process sets, int16 tensors) into what ``torch.distributed`` takes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.comm.fusion import (
    ReduceOp,
    check_op,
)
from ringtrain.horovod.process_sets import ProcessSet, SetView
from ringtrain.horovod.runtime import HorovodInternalError, Pending, runtime


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
    name: str | None, kind: str, launch: Callable[[], tuple[Callable[[], bool], Callable[[], Any]]]
) -> int:
    """Launch an operation under ``name`` and register it; returns its handle."""
    rt = runtime()
    # A duplicate name is not refused here: the flag travels in the metadata exchange and
    # every rank of the operation raises the same ValueError (Horovod's coordinator does too).
    rt.duplicate_pending = rt.name_in_flight(name)
    try:
        is_completed, finish = launch()
    except RuntimeError as exc:
        if _is_peer_failure(exc) and not isinstance(exc, HorovodInternalError):
            raise HorovodInternalError(f"{kind} failed: {exc}") from exc
        raise
    finally:
        rt.duplicate_pending = False
    rt.claim_name(name)
    return rt.add(Pending(name=name, is_completed=is_completed, finish=finish))


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` has finished (``synchronize`` will not block)."""
    if callable(handle):  # sparse_allreduce_async's handle (as in Horovod)
        return True
    return bool(runtime().take(handle).is_completed())


def synchronize(handle: int) -> Any:
    """Wait for the operation of ``handle`` and return its output.

    Raises:
        HorovodInternalError: if the collective failed because a peer is gone.
        ValueError: for an unknown (or already synchronized) handle.
    """
    if callable(handle):  # sparse_allreduce_async returns a function (as in Horovod)
        return handle()
    rt = runtime()
    pending = rt.take(handle)
    try:
        result = pending.finish()
    except RuntimeError as exc:
        if _is_peer_failure(exc) and not isinstance(exc, HorovodInternalError):
            raise HorovodInternalError(f"operation {pending.name or handle} failed: {exc}") from exc
        raise
    finally:
        with rt.lock:
            rt.handles.pop(handle, None)
        rt.release_name(pending.name)
    return result


def _as_1d(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(1) if tensor.dim() == 0 else tensor
