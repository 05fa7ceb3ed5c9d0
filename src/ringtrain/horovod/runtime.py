"""``hvd.init()`` and what it sets up: ranks and sizes, the in-flight handle table, the cross-rank
metadata check, and the build probes.

Horovod's API is process-global (``hvd.rank()`` takes no context argument), so this module keeps
one :class:`Runtime` in a single slot, created by :func:`init` and dropped by :func:`shutdown`;
everything else in ringtrain passes its context explicitly. The rank information itself comes
from :func:`ringtrain.session.get_context` (the ringtrain launcher, torchrun, SLURM, or a single
process), and the process group from :func:`ringtrain.distributed.init_process_group` (gloo on CPU,
NCCL with one GPU per rank): there is no MPI and no Horovod background thread.
"""

from __future__ import annotations

import atexit
import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.env import DistributedContext

__all__ = [
    "HorovodInternalError",
    "Runtime",
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "runtime",
    "shutdown",
    "size",
]


class HorovodInternalError(RuntimeError):
    """A collective failed because a peer is gone (the process group broke).

    Under ringtrain the controller then restarts the whole worker group from the last
    checkpoint (see :mod:`ringtrain.horovod.elastic`); the error is not retried in-process.
    """


@dataclass
class Pending:
    """An in-flight operation: ``finish()`` waits and returns its result."""

    name: str | None
    is_completed: Callable[[], bool]
    finish: Callable[[], Any]
    result: Any = None
    done: bool = False


@dataclass
class Runtime:
    """The state ``hvd.init()`` creates.

    Attributes:
        ctx: the worker's context (ranks, sizes, device).
        owns_group: whether ``init`` created the default process group (``shutdown`` then
            destroys it; a group made by ringtrain's worker or by the user is left alone).
        handles: in-flight operations by handle.
        inflight_names: names of the in-flight operations (a duplicate raises ``ValueError``).
    """

    ctx: DistributedContext
    owns_group: bool
    handles: dict[int, Pending] = field(default_factory=dict)
    inflight_names: set[str] = field(default_factory=set)
    next_handle: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def size(self) -> int:
        return self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.world_rank

    def add(self, pending: Pending) -> int:
        """Register an in-flight operation; returns its handle."""
        with self.lock:
            handle = self.next_handle
            self.next_handle += 1
            self.handles[handle] = pending
            return handle

    def claim_name(self, name: str | None) -> None:
        """Reserve ``name`` for an operation about to be launched.

        Raises:
            ValueError: if an in-flight operation already has this name.
        """
        if name is None:
            return
        with self.lock:
            if name in self.inflight_names:
                raise ValueError(
                    f"an operation named {name!r} is already in flight: synchronize() its handle "
                    "before reusing the name, or give this one another name"
                )
            self.inflight_names.add(name)

    def release_name(self, name: str | None) -> None:
        if name is not None:
            with self.lock:
                self.inflight_names.discard(name)

    def take(self, handle: int) -> Pending:
        with self.lock:
            pending = self.handles.get(handle)
        if pending is None:
            raise ValueError(
                f"handle {handle!r} is not an in-flight operation (already synchronized?)"
            )
        return pending


_runtime: Runtime | None = None
_slot_lock = threading.Lock()


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initialise ringtrain.horovod (``hvd.init()``); a second call does nothing.

    Reads the rank information ringtrain's launcher, torchrun or SLURM put in the environment
    (or, in a worker started by ``rt.Trainer``, the worker's session), and joins the default
    ``torch.distributed`` process group, creating it when nobody has (gloo on CPU, NCCL with
    ``use_gpu``). A plain ``python script.py`` is rank 0 of 1.

    Args:
        comm: Horovod's MPI communicator; only ``None`` is supported (there is no MPI).
        process_sets: Horovod process sets; only ``None`` is supported.

    Raises:
        NotImplementedError: for ``comm`` or ``process_sets``.
    """
    global _runtime
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) needs MPI, which ringtrain.horovod does not use; call hvd.init() "
            "and start the ranks with `ringtrain run -n N` or torchrun"
        )
    if process_sets is not None:
        raise NotImplementedError(
            "process sets are not supported by ringtrain.horovod; use torch.distributed.new_group"
        )
    with _slot_lock:
        if _runtime is not None:
            return
        from ringtrain.distributed import init_process_group
        from ringtrain.session import get_context

        ctx = get_context()
        owns = False
        if ctx.world_size > 1 and not dist.is_initialized():
            init_process_group(ctx)
            owns = True
            atexit.register(_destroy_owned_group)
        _runtime = Runtime(ctx=ctx, owns_group=owns)


def shutdown() -> None:
    """Finish in-flight operations and shut down; ``init()`` may be called again afterwards.

    The process group stays up for the next :func:`init` (re-forming it at once would race on
    the rendezvous port: a fast rank could reach the old store of a slow rank 0). A group that
    ``init`` created is destroyed at interpreter exit; one made by ringtrain's worker or by the
    user is theirs to destroy.
    """
    global _runtime
    with _slot_lock:
        rt = _runtime
        _runtime = None
    if rt is None:
        return
    for pending in list(rt.handles.values()):
        try:
            pending.finish()
        except Exception:
            pass
    from ringtrain.comm.fusion import POOL

    POOL.clear()


def _destroy_owned_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    """Whether :func:`init` has been called (and :func:`shutdown` not since)."""
    return _runtime is not None


def runtime() -> Runtime:
    """The runtime :func:`init` created.

    Raises:
        ValueError: before ``hvd.init()`` (Horovod's error).
    """
    rt = _runtime
    if rt is None:
        raise ValueError("Horovod has not been initialized; use hvd.init().")
    return rt


def size() -> int:
    """Number of ranks (the world size)."""
    return runtime().ctx.world_size


def rank() -> int:
    """This process's rank in ``[0, size())``."""
    return runtime().ctx.world_rank


def local_size() -> int:
    """Number of ranks on this node."""
    return runtime().ctx.local_world_size


def local_rank() -> int:
    """This process's rank on its node (selects its GPU)."""
    return runtime().ctx.local_rank


def cross_size() -> int:
    """Number of nodes (ranks with the same local rank across nodes), ``size() // local_size()``."""
    ctx = runtime().ctx
    return max(1, ctx.world_size // max(1, ctx.local_world_size))


def cross_rank() -> int:
    """This node's index (the node rank)."""
    return runtime().ctx.node_rank


def is_homogeneous() -> bool:
    """Whether every node runs the same number of ranks."""
    ctx = runtime().ctx
    return ctx.world_size % max(1, ctx.local_world_size) == 0


# ------------------------------------------------------------------ build probes (truthful)


def gloo_built() -> bool:
    """Whether collectives can run over gloo (torch was built with it)."""
    return bool(dist.is_available() and dist.is_gloo_available())


def nccl_built() -> bool:
    """Whether collectives can run over NCCL (torch was built with it)."""
    return bool(dist.is_available() and dist.is_nccl_available())


def mpi_built() -> bool:
    """False: ringtrain.horovod never uses MPI (even when torch has an MPI backend)."""
    return False


def mpi_enabled() -> bool:
    """False: there is no MPI controller."""
    return False


def gloo_enabled() -> bool:
    """Whether the process group in use is gloo's (False before ``init``, or single process)."""
    return bool(dist.is_initialized() and dist.get_backend() == "gloo")


def mpi_threads_supported() -> bool:
    """False (no MPI)."""
    return False


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ddl_built() -> bool:
    """False: IBM DDL is not supported."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not supported."""
    return False


# ------------------------------------------------------------------ cross-rank metadata check

_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_HEADER = 8


def _hash63(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) if dtype in _DTYPES else 100 + _hash63(str(dtype)) % 1000


def _describe(row: list[int]) -> str:
    code = row[2]
    dtype = str(_DTYPES[code]).replace("torch.", "") if 0 <= code < len(_DTYPES) else f"#{code}"
    return f"dtype {dtype}, {row[3]} dims, first dim {row[5]}"


def negotiate(
    kind: str,
    name: str | None,
    tensors: Sequence[torch.Tensor],
    *,
    vary_first_dim: bool = False,
    extra: int = 0,
    splits: Sequence[int] | None = None,
) -> list[list[int]]:
    """Check that every rank calls the same operation on compatible tensors; raise otherwise.

    One ``all_gather`` of ``8 + size()`` int64 per rank (under 200 bytes at 16 ranks: one
    network latency, paid once per call; a grouped or fused call pays it once for all its
    tensors). Every rank sees every rank's row, so a mismatch raises on every rank instead of
    leaving some ranks blocked in a collective.

    Args:
        kind: the operation (``"allreduce"``...).
        name: the operation's name (``None``: not compared).
        tensors: the tensors of the operation.
        vary_first_dim: the first dimension may differ across ranks (allgather, alltoall).
        extra: one more integer every rank must agree on (the op, the root rank).
        splits: this rank's alltoall splits (``size()`` ints).

    Returns:
        Every rank's row: ``[kind, name, dtype, ndim, shape hash, first dim, extra, count,
        splits...]``.

    Raises:
        RuntimeError: on every rank, naming what differs.
    """
    rt = runtime()
    n = rt.size
    t0 = tensors[0] if tensors else torch.empty(0)
    if len(tensors) == 1:
        rest = tuple(t0.shape[1:]) if vary_first_dim else tuple(t0.shape)
        shape_hash = _hash63(repr(rest))
    else:
        shape_hash = _hash63(repr([(str(t.dtype), tuple(t.shape)) for t in tensors]))
    row = [
        _hash63(kind),
        _hash63(name) if name else 0,
        _dtype_code(t0.dtype),
        t0.dim(),
        shape_hash,
        int(t0.shape[0]) if t0.dim() > 0 else 1,
        int(extra),
        len(tensors),
    ]
    row += list(splits) if splits is not None else [0] * n
    if n == 1:
        return [row]
    mine = torch.tensor(row, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(n)]
    try:
        dist.all_gather(gathered, mine)
    except Exception as exc:
        raise HorovodInternalError(f"{kind}: the metadata exchange failed: {exc}") from exc
    rows = [g.tolist() for g in gathered]
    first = rows[0]
    label = f"{kind}" + (f" {name!r}" if name else "")
    problems = []
    for r, other in enumerate(rows[1:], start=1):
        if other[0] != first[0]:
            problems.append(f"rank {r} called another operation than rank 0")
        elif other[1] != first[1]:
            problems.append(f"rank {r} used another name than rank 0")
        elif other[6] != first[6]:
            problems.append(f"rank {r} passed another op/root rank than rank 0")
        elif other[7] != first[7]:
            problems.append(f"rank {r} passed {other[7]} tensors, rank 0 passed {first[7]}")
        elif other[2:5] != first[2:5] or (not vary_first_dim and other[5] != first[5]):
            problems.append(f"rank {r} has {_describe(other)}; rank 0 has {_describe(first)}")
    if problems:
        raise RuntimeError(
            f"{label}: mismatched tensors across ranks ({'; '.join(problems)}); every rank must "
            "pass tensors of the same dtype and shape"
            + (" (the first dimension may differ)" if vary_first_dim else "")
        )
    return rows
