"""Process-group set-up on top of torch.distributed (gloo on CPU, NCCL on GPU)."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ringtrain.cluster.netif import check_not_self_rendezvous, give_up_after, tcp_opened_by

if TYPE_CHECKING:  # env's ctx.mesh imports this module (parallel/mesh.py): no run-time cycle
    from ringtrain.cluster.env import DistributedContext

DEFAULT_TIMEOUT_S = 1800.0
EXTERNAL_LAUNCHERS = ("torchrun", "slurm")
"""``DistributedContext.source`` of the launchers whose ``MASTER_ADDR`` is a name each node
resolves itself (checked by :func:`~ringtrain.cluster.netif.check_not_self_rendezvous`)."""


def collective_timeout_s(worker_timeout_s: float | None) -> float:
    """The process-group timeout for a run with this ``FailureConfig.worker_timeout_s``."""
    if worker_timeout_s is None:
        return DEFAULT_TIMEOUT_S
    return 2 * worker_timeout_s + 10


def init_process_group(ctx: DistributedContext, timeout_s: float | None = None) -> None:
    """Initialise the default process group for ``ctx`` if it is not initialised yet.

    NCCL with ``cuda:{local_rank}`` as the current device when ``ctx.use_gpu``, gloo otherwise;
    rendezvous through ``env://`` (``MASTER_ADDR``/``MASTER_PORT``). A gloo group ends with one
    barrier, so that no rank returns before every rank's connections are up. Does nothing for a
    single process.

    Under torchrun or SLURM, a rank on a node other than node 0 whose ``MASTER_ADDR`` resolves
    to its own host, where nothing serves the rendezvous, is refused first (it would rendezvous
    with itself; :func:`~ringtrain.cluster.netif.check_not_self_rendezvous`).

    Args:
        ctx: the worker's context.
        timeout_s: collective timeout, seconds: a collective waiting longer raises instead of
            blocking forever. Default: twice the run's ``FailureConfig.worker_timeout_s`` plus
            10 s (so that the driver, which watches progress, names the stuck rank before its
            peers' collectives give up and blame each other), else 1800.

    Raises:
        NetworkConfigError: the self-rendezvous trap above (names the rank, host and address).
        RuntimeError: a GPU rank whose ``cuda:{local_rank}`` this process cannot see.
    """
    import torch
    import torch.distributed as dist

    if ctx.world_size == 1 or dist.is_initialized():
        return
    if ctx.source in EXTERNAL_LAUNCHERS:
        # ringtrain's own launchers put rank 0 at an address they chose; torchrun and SLURM hand
        # over a name each node resolves itself.
        check_not_self_rendezvous(
            ctx.master_addr,
            ctx.master_port,
            rank=ctx.world_rank,
            node_rank=ctx.node_rank,
            launcher=ctx.source,
        )
    kwargs: dict[str, Any] = {}
    if ctx.use_gpu:
        if torch.cuda.device_count() <= ctx.local_rank:
            raise RuntimeError(
                f"rank {ctx.world_rank} needs cuda:{ctx.local_rank} but this process sees "
                f"{torch.cuda.device_count()} CUDA device(s)"
            )
        torch.cuda.set_device(ctx.local_rank)
        backend = "nccl"
        if "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = torch.device("cuda", ctx.local_rank)
    else:
        backend = "gloo"

    def create() -> None:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=ctx.world_rank,
            world_size=ctx.world_size,
            timeout=timedelta(seconds=timeout_s or collective_timeout_s(ctx.worker_timeout_s)),
            **kwargs,
        )

    if ctx.use_gpu:
        create()
    else:
        # A peer cut off by a partition sends no reset: gloo's connections to it fail after
        # worker_timeout_s of silence instead of at the collective timeout (cluster/netif.py).
        _, opened = tcp_opened_by(create)
        give_up_after(opened, ctx.worker_timeout_s)
    if not ctx.use_gpu:  # gloo
        # Gloo connects every pair in the constructor, and a rank whose own connections are up
        # returns while a peer may still be finishing its end: a train function that runs no
        # collective could then leave, and the peer's set-up failed with "Gloo connectFullMesh
        # failed ... Connection closed by peer" (a spurious failure, seen under load). One
        # barrier here lets no rank start the train function before every rank's mesh is up.
        dist.barrier()


def new_gloo_group(timeout_s: float | None = None) -> Any:
    """A gloo sub-group over every rank of the default group, connected on every rank before
    any rank returns.

    ``torch.distributed.new_group`` is a collective of the default group's ranks. Like
    :func:`init_process_group`, it ends with one barrier on the new group: gloo connects every
    pair in the constructor and a rank whose own pairs are up returns while a peer may still be
    finishing its end, so a rank that then left (a train function with no collective) failed
    the peer's set-up with "Gloo connectFullMesh failed ... Connection closed by peer".

    Args:
        timeout_s: the group's collective timeout, seconds (default: the default group's).

    Returns:
        The new ``ProcessGroup``.

    Raises:
        RuntimeError: the rendezvous or the barrier timed out, or a peer is gone.
    """
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    group = dist.new_group(backend="gloo", **kwargs)
    dist.barrier(group=group)
    return group


_KEPT: list[Any] = []
"""In-flight collectives (and their groups) that did not end when their group was torn down:
kept referenced for the life of the process (:func:`settle`)."""


def settle(work: Any, *keep: Any, timeout_s: float = 5.0) -> bool:
    """Wait at most ``timeout_s`` seconds for ``work`` (a ``Work`` of a collective still in
    flight on a group being torn down; its connections already ended, so it normally ends at
    once, with an error that is ignored here). If it has not ended, ``work`` and ``keep`` (its
    process group) are kept referenced for the life of the process: a gloo group whose
    collective still runs blocks, in its destructor, whichever thread drops its last reference,
    until the collective ends (measured: forever while the peer lives; it hung a worker's
    training thread at the next step boundary).

    Returns:
        Whether the collective ended.
    """
    if work is None:
        return True
    try:
        work.wait(timedelta(seconds=timeout_s))
        return True
    except RuntimeError as exc:
        if "timed out" not in str(exc).lower():
            return True  # it ended, with an error (a peer that left it)
    _KEPT.append((work, *keep))
    return False


def destroy_process_group() -> None:
    """Destroy the default process group if there is one; never raises (a group broken by a
    dead peer may fail to tear down cleanly, and the caller is exiting or re-forming it)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def broadcast_state(obj: Any, src: int, group: Any = None) -> Any:
    """``obj`` of rank ``src`` (a rank of ``group``: the group's own numbering; default: the
    default group) on every rank of ``group``, without a pickle.

    ``torch.distributed.broadcast_object_list`` unpickles what arrives, and gloo's connections
    are not authenticated: whoever reaches a rank's socket could make it run code. Here ``src``
    serialises ``obj`` with ``torch.save`` and the others read it with
    ``torch.load(weights_only=True)``, the loader of every checkpoint (tensors, numbers,
    strings, containers; nothing that runs code): anything a ``TrainState`` can save travels.
    Two broadcasts: the length (int64), then the bytes (uint8). A collective of ``group``.

    Args:
        obj: what ``src`` sends (ignored on the other ranks).
        src: the sending rank, in ``group``'s numbering.
        group: the process group (``None``: the default group).

    Returns:
        ``obj`` on ``src``; a copy of it, its tensors on the CPU, on every other rank.

    Raises:
        pickle.UnpicklingError: what arrived holds something ``weights_only`` refuses.
    """
    import io

    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = dist.get_rank(group) == src
    data = b""
    if mine:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, group_src=src, group=group)
    if mine:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if payload.numel():
        dist.broadcast(payload, group_src=src, group=group)
    if mine:
        return obj
    received = io.BytesIO(payload.cpu().numpy().tobytes())
    return torch.load(received, weights_only=True, map_location="cpu")
