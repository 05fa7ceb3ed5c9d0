"""``hvd.init()`` and what it sets up: ranks and sizes, the in-flight handle table, the cross-rank
metadata check, and the build probes.

Horovod's API is process-global (``hvd.rank()`` takes no context argument), so this module keeps
one :class:`Runtime` in a single slot, created by :func:`init` and dropped by :func:`shutdown`;
everything else in ringtrain passes its context explicitly. The rank information itself comes
from :func:`ringtrain.worker.session.get_context` (the ringtrain launcher, torchrun, SLURM, or a
single process), and the process group from :func:`ringtrain.cluster.distributed.init_process_group`
(gloo on CPU, NCCL with one GPU per rank): there is no MPI and no Horovod background thread.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ringtrain.cluster.env import DistributedContext
from ringtrain.comm.fusion import BufferPool
from ringtrain.horovod import slot
from ringtrain.horovod.errors import HorovodInternalError
from ringtrain.horovod.metadata import hash63
from ringtrain.horovod.process_sets import ProcessSet, SetView, add_process_set, global_process_set
from ringtrain.horovod.slot import runtime

if TYPE_CHECKING:
    from ringtrain.horovod.coordinator import Request

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


@dataclass
class Runtime:
    """The state ``hvd.init()`` creates.

    Attributes:
        ctx: the worker's context (ranks, sizes, device).
        owns_group: whether ``init`` created the default process group (``shutdown`` then
            destroys it; a group made by ringtrain's worker or by the user is left alone).
        handles: the operations returned as handles (``*_async``), by handle.
        inflight_names: names of this rank's operations submitted and not yet synchronized (a
            duplicate raises ``ValueError`` at once, on this rank only: Horovod's rule).
        queues: per process set id, this rank's operations not matched yet, oldest first
            (:mod:`ringtrain.horovod.coordinator`).
        seqs: per process set id, the sequence number of the next unnamed operation.
        join_age: exchange rounds spent in ``hvd.join()`` so far (-1: not in it).
    """

    ctx: DistributedContext
    owns_group: bool
    handles: dict[int, Request] = field(default_factory=dict)
    inflight_names: set[str] = field(default_factory=set)
    next_handle: int = 1
    lock: threading.Lock = field(default_factory=threading.Lock)
    coord_lock: threading.RLock = field(default_factory=threading.RLock)
    queues: dict[int, list[Request]] = field(default_factory=dict)
    seqs: dict[int, int] = field(default_factory=dict)
    join_age: int = -1
    join_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sets: dict[int, tuple[tuple[int, ...], Any]] = field(default_factory=dict)
    next_set_id: int = 1
    check: bool = True
    """Exchange each operation's descriptor before its data (``False`` only for benchmarks:
    operations are then launched in program order unchecked, and a mismatch hangs or corrupts
    instead of raising on every rank)."""
    pool: BufferPool = field(default_factory=BufferPool)
    """The fusion buffers of this runtime's fused allreduces (kept between calls, as Horovod
    keeps its fusion buffer; :func:`shutdown` drops them)."""

    @property
    def size(self) -> int:
        return self.ctx.world_size

    @property
    def rank(self) -> int:
        return self.ctx.world_rank

    def add(self, request: Request) -> int:
        """Register an operation handed out as a handle; returns the handle."""
        with self.lock:
            handle = self.next_handle
            self.next_handle += 1
            self.handles[handle] = request
            return handle

    def release_name(self, name: str | None) -> None:
        """The operation named ``name`` is synchronized: the name may be used again."""
        if name is not None:
            with self.lock:
                self.inflight_names.discard(name)

    # -------------------------------------------------------------- process sets

    def set_view(self, process_set: ProcessSet | None) -> SetView:
        """The :class:`~ringtrain.horovod.process_sets.SetView` of ``process_set`` (``None``:
        the global set).

        Raises:
            ValueError: for a set that is not registered (never added, or removed).
        """
        psid = 0 if process_set is None else getattr(process_set, "process_set_id", "?")
        if psid == 0:
            n, r = self.ctx.world_size, self.ctx.world_rank
            return SetView(0, tuple(range(n)), None, n, r)
        entry = self.sets.get(psid) if isinstance(psid, int) else None
        if entry is None or not isinstance(psid, int):
            raise ValueError(
                f"process set {process_set} is not registered on this rank: pass one returned "
                "by hvd.add_process_set() (or listed in hvd.init(process_sets=...)) and not "
                "removed since"
            )
        ranks, group = entry
        me = self.ctx.world_rank
        return SetView(psid, ranks, group, len(ranks), ranks.index(me) if me in ranks else -1)

    def register_set(self, ps: ProcessSet) -> None:
        """Create the subgroup of ``ps`` (collective over all ranks) and give it an id."""
        ranks = tuple(ps.ranks or ())
        n = self.ctx.world_size
        bad = [r for r in ranks if not 0 <= r < n]
        negotiate("add_process_set", None, [], extra=hash63(repr(ranks)))
        if not ranks or bad:
            raise ValueError(
                f"add_process_set: ranks {list(ranks)} must be a non-empty list of ranks in "
                f"[0, size()={n})"
            )
        if ps.process_set_id is not None and ps.process_set_id in self.sets:
            raise ValueError(f"add_process_set: {ps} is already registered")
        known = [psid for psid, (rk, _) in self.sets.items() if rk == ranks]
        if known:
            raise ValueError(
                f"add_process_set: a process set with ranks {list(ranks)} already exists (id "
                f"{known[0]}); reuse it"
            )
        group = dist.new_group(list(ranks)) if n > 1 else None
        psid = self.next_set_id
        self.next_set_id += 1
        self.sets[psid] = (ranks, group)
        ps.process_set_id = psid
        ps.ranks = list(ranks)

    def unregister_set(self, ps: ProcessSet) -> bool:
        """Drop the subgroup of ``ps`` (collective over all ranks)."""
        psid = getattr(ps, "process_set_id", None)
        negotiate("remove_process_set", None, [], extra=-1 if psid is None else int(psid))
        if psid is None or psid == 0 or psid not in self.sets:
            return False
        _, group = self.sets.pop(psid)
        ps.invalidate()
        if group is not None:
            dist.destroy_process_group(group)
        return True

    def take(self, handle: int) -> Request:
        """The operation of ``handle``.

        Raises:
            ValueError: for an unknown (or already synchronized) handle.
        """
        with self.lock:
            request = self.handles.get(handle)
        if request is None:
            raise ValueError(
                f"handle {handle!r} is not an in-flight operation (already synchronized?)"
            )
        return request


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initialise ringtrain.horovod (``hvd.init()``); a second call does nothing.

    Reads the rank information ringtrain's launcher, torchrun or SLURM put in the environment
    (or, in a worker started by ``rt.Trainer``, the worker's session), and joins the default
    ``torch.distributed`` process group, creating it when nobody has (gloo on CPU, NCCL with
    ``use_gpu``). A plain ``python script.py`` is rank 0 of 1.

    Args:
        comm: Horovod's MPI communicator; only ``None`` is supported (there is no MPI).
        process_sets: ``None``, ``"dynamic"`` (accepted: sets can always be added later), or a
            list of :class:`~ringtrain.horovod.ProcessSet` created here, in list order, on every
            rank (collective).

    Raises:
        NotImplementedError: for ``comm`` (on every rank: it does not depend on the rank).
        ValueError: for ``process_sets`` of another type.
    """
    if comm is not None:
        raise NotImplementedError(
            "hvd.init(comm=...) needs MPI, which ringtrain.horovod does not use; call hvd.init() "
            "and start the ranks with `ringtrain run -n N` or torchrun (for a subset of ranks, "
            "use hvd.init(process_sets=[hvd.ProcessSet([...])]) or hvd.add_process_set)"
        )
    if process_sets not in (None, "dynamic") and not isinstance(process_sets, (list, tuple)):
        raise ValueError(
            f"hvd.init(process_sets=...) takes a list of hvd.ProcessSet or 'dynamic', got "
            f"{type(process_sets).__name__}"
        )
    _init(process_sets if isinstance(process_sets, (list, tuple)) else [])


def _init(process_sets: Sequence[Any]) -> None:
    with slot.lock:
        if slot.current is not None:
            return
        from ringtrain.cluster.distributed import init_process_group
        from ringtrain.worker.session import get_context

        ctx = get_context()
        owns = False
        if ctx.world_size > 1 and not dist.is_initialized():
            init_process_group(ctx)
            owns = True
            atexit.register(_destroy_owned_group)
        # A script that never calls shutdown() still shuts down before the interpreter tears
        # its objects down (once, however many times init ran).
        atexit.unregister(shutdown)
        atexit.register(shutdown)
        slot.current = Runtime(ctx=ctx, owns_group=owns)
        global_process_set.ranks = list(range(ctx.world_size))
    for ps in process_sets:
        add_process_set(ps if isinstance(ps, ProcessSet) else ProcessSet(ps))


def shutdown() -> None:
    """Finish in-flight operations and shut down; ``init()`` may be called again afterwards.

    The process group stays up for the next :func:`init` (re-forming it at once would race on
    the rendezvous port: a fast rank could reach the old store of a slow rank 0). A group that
    ``init`` created is destroyed at interpreter exit; one made by ringtrain's worker or by the
    user is theirs to destroy. Called at interpreter exit too (registered by ``init``).

    Order matters: in-flight operations are finished first (operations never matched by the
    peers are dropped), then the process sets' groups destroyed. A gloo group destroyed under
    queued work, or left to the interpreter's own teardown, can end the process with SIGABRT
    ("terminate called without an active exception": a C++ thread object destroyed while still
    joinable).
    """
    with slot.lock:
        rt = slot.current
        slot.current = None
    if rt is None:
        return
    for request in list(rt.handles.values()):
        if request.state == "launched":
            try:
                request.finish()
            except Exception:
                pass
    rt.handles.clear()
    rt.queues.clear()
    for _, group in rt.sets.values():
        if group is not None:
            try:
                dist.destroy_process_group(group)
            except Exception:
                pass
    rt.sets.clear()
    rt.pool.clear()


def _destroy_owned_group() -> None:
    """At interpreter exit: shut down (in-flight work, the sets' groups), then destroy the
    default group that :func:`init` created, while the interpreter is still whole."""
    shutdown()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_initialized() -> bool:
    """Whether :func:`init` has been called (and :func:`shutdown` not since)."""
    return slot.current is not None


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
    """Horovod's answer when MPI is not enabled (its gloo mode): ``ValueError``.

    Raises:
        ValueError: always, on every rank (there is no MPI to mix with ``mpi4py``; use
            ``torch.distributed`` collectives on ``hvd``'s process group instead).
    """
    raise ValueError(
        "Horovod MPI is not enabled (ringtrain.horovod runs on torch.distributed, never MPI): "
        "there is no MPI threading to query; to mix in other collectives use torch.distributed "
        "directly (the default process group is hvd's)"
    )


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


def negotiate(
    kind: str,
    name: str | None,
    tensors: Sequence[torch.Tensor],
    *,
    vary_first_dim: bool = False,
    extra: int = 0,
    view: SetView | None = None,
    signature: str | None = None,
) -> list[list[int]]:
    """Wait until every member of the set has submitted this operation (matched by ``name``, or
    by order among the unnamed ones) and check that the calls agree; raise otherwise.

    For the operations that move their data themselves once matched (``barrier``, the object
    collectives, ``broadcast_parameters``, process-set changes, ``DistributedOptimizer``): a
    blocking request of :mod:`ringtrain.horovod.coordinator` whose launch does nothing. Every
    member sees every member's row, so an invalid call on any rank raises the same exception on
    every rank instead of leaving some ranks blocked in the data collective.

    Args:
        kind: the operation (``"barrier"``...).
        name: the operation's name (``None``: unnamed).
        tensors: the tensors of the operation.
        vary_first_dim: the first dimension may differ across ranks.
        extra: one more integer every rank must agree on (the root rank, a set id).
        view: the process set's :class:`~ringtrain.horovod.process_sets.SetView` (``None``: all
            ranks).
        signature: text every rank must agree on (e.g. the names of broadcast parameters).

    Returns:
        Every member's row (``metadata_row`` and ``n`` zeros), in set order.

    Raises:
        ValueError: on this rank only, if an operation of this name is in flight on it.
        RuntimeError: on every rank, naming what differs, or when the ranks wait for
            operations that can never meet (Horovod would hang), or when a rank has joined.
        HorovodInternalError: if a peer is gone.
    """
    from ringtrain.horovod.coordinator import Match, submit, wait

    def rows(match: Match) -> tuple[Callable[[], bool], Callable[[], Any]]:
        return (lambda: True), (lambda: match.rows)

    view = runtime().set_view(None) if view is None else view
    request = submit(
        kind,
        name,
        tensors,
        rows,
        view,
        blocking=True,
        vary_first_dim=vary_first_dim,
        extra=extra,
        signature=signature,
    )
    return wait(request)
