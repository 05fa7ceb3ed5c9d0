"""Outer gradients on the wire: the averaging collective of one DiLoCo fragment.

:class:`Topology` says who averages with whom: R replicas (workers, or islands of S workers
under ``ParallelConfig(dp_replicate=R, dp_shard=S)``). :class:`Exchange` starts the collective
asynchronously (it overlaps the next inner steps when ``DiLoCoConfig.sync_delay > 0``) and
``wait()`` returns the averaged float32 outer gradients, **bit-identical on every rank** (every
rank gets the same reduced bytes, and the int8 path dequantizes and sums the gathered payloads in
rank order), which is what keeps the replicas' global parameters equal without ever comparing
them.

Encodings (``DiLoCoConfig.outer_dtype``):

- ``"fp32"``, ``"bf16"``, ``"fp16"``: each tensor divided by R, cast, concatenated into one
  buffer and all-reduced (SUM) in that dtype, as DDP's own ``bf16_compress_hook`` does.
- ``"int8"``: each tensor quantized symmetrically with its own scale ``max|x| / 127``
  (round-half-to-even, clamped to [-127, 127]); the int8 values and the float32 scales (as bytes)
  are all-gathered, because an int8 sum would overflow; every rank dequantizes the R payloads and
  sums them in float32 in rank order, then divides by R.

Islands (S > 1): the S ranks of an island hold the same outer gradient (DDP inside keeps them
equal), so each carries only its share of the tensors across islands (over the mesh's
``dp_replicate`` group of its ``dp_shard`` coordinate; shares balanced by size), then the shares
are broadcast inside the island. The cross-island bytes are one model per island, spread over S
links.

Bytes on the wire (what :attr:`Exchange.bytes_sent` counts, per rank): a ring all-reduce of b
bytes sends ``2 (R - 1) / R * b``; a ring all-gather sends ``(R - 1) * b`` (Patarasuk and Yuan,
"Bandwidth optimal all-reduce algorithms for clusters of workstations", JPDC 2009). Gloo picks
its own algorithm per size; ``benchmarks/diloco.py`` measures the bytes that actually crossed
the interface.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

CAST = {"bf16": torch.bfloat16, "fp16": torch.float16}

REDUCIBLE = {
    "gloo": ("fp32", "bf16", "fp16"),
    "nccl": ("fp32", "bf16", "fp16"),
}
"""The outer dtypes each backend all-reduces (``"int8"`` is all-gathered as bytes: any backend).
gloo: torch 2.13's ``ProcessGroupGloo`` reduces float32, float16 and bfloat16 (checked here); NCCL
reduces bfloat16 since 2.10. Another backend (MPI, UCC, a custom one) is not assumed to."""


def check_outer_dtype(outer_dtype: str, backend: str) -> None:
    """Raise unless ``backend`` can move outer gradients of ``outer_dtype``.

    Raises:
        ValueError: naming ``DiLoCoConfig.outer_dtype``, the backend and what works there.
    """
    if outer_dtype == "int8":
        return
    reducible = REDUCIBLE.get(backend, ("fp32",))
    if outer_dtype not in reducible:
        raise ValueError(
            f"DiLoCoConfig.outer_dtype={outer_dtype!r}: the {backend!r} process group backend is "
            f"not known to all-reduce it (use one of {', '.join(map(repr, reducible))}, or "
            "'int8', which is all-gathered as bytes)"
        )


@dataclass(frozen=True)
class Topology:
    """Who averages with whom.

    Attributes:
        replicas: R, the replicas (islands) averaged over.
        replica: this rank's replica index in [0, R).
        island_size: S, ranks per island (1 without islands).
        island_rank: this rank's index in its island.
        outer_group: the process group over the R replicas at this island rank (``None`` at
            R = 1).
        island_group: the island's process group (``None`` at S = 1).
    """

    replicas: int
    replica: int = 0
    island_size: int = 1
    island_rank: int = 0
    outer_group: Any = None
    island_group: Any = None


def owners(sizes: list[int], island_size: int) -> list[int]:
    """Which island rank carries each tensor across islands: the largest first, each to the
    least loaded rank (ties: the lowest rank). A function of the sizes alone: the same on
    every rank."""
    load = [0] * island_size
    out = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(island_size), key=lambda r: (load[r], r))
        out[index] = rank
        load[rank] += sizes[index]
    return out


class Exchange:
    """The averaging of one fragment's outer gradients, started at construction.

    Args:
        deltas: the outer gradients (global - local), float32, the same shapes on every rank.
        topology: who averages (see :class:`Topology`).
        outer_dtype: one of ``ringtrain.config.diloco.OUTER_DTYPES``.
        weight: 1, or 0 for a replica that joined while this exchange was in flight (it has no
            inner steps behind it: its zeros are left out of the mean). The weights travel with
            the payload (one more element), and the mean is over the replicas that contribute.

    Attributes:
        bytes_sent: bytes this rank puts on the wire across islands (ring-algorithm count).
    """

    def __init__(
        self,
        deltas: list[torch.Tensor],
        topology: Topology,
        outer_dtype: str,
        weight: float = 1.0,
    ) -> None:
        self.topology = topology
        self.outer_dtype = outer_dtype
        self.weight = weight
        self.shapes = [d.shape for d in deltas]
        self.device = deltas[0].device if deltas else torch.device("cpu")
        self.owner = owners([d.numel() for d in deltas], topology.island_size)
        self.mine = [i for i, o in enumerate(self.owner) if o == topology.island_rank]
        self.bytes_sent = 0
        self._work: Any = None
        self._buffers: list[torch.Tensor] = []
        self._payload: torch.Tensor | None = None
        self._start([deltas[i] for i in self.mine])

    def _start(self, tensors: list[torch.Tensor]) -> None:
        topo = self.topology
        replicas = topo.replicas
        if not tensors:
            return
        if self.outer_dtype == "int8":
            payload = _quantize(tensors, self.weight)
            self._payload = payload
            if replicas == 1:
                self._buffers = [payload]
                return
            self._buffers = [torch.empty_like(payload) for _ in range(replicas)]
            self.bytes_sent = (replicas - 1) * payload.numel()
            self._work = dist.all_gather(
                self._buffers, payload, group=topo.outer_group, async_op=True
            )
            return
        flat = torch.cat([t.reshape(-1) for t in tensors]).div_(replicas)
        flat = torch.cat([flat, flat.new_full((1,), self.weight)])
        if self.outer_dtype in CAST:
            flat = flat.to(CAST[self.outer_dtype])
        self._buffers = [flat]
        if replicas > 1:
            nbytes = flat.numel() * flat.element_size()
            self.bytes_sent = 2 * (replicas - 1) * nbytes // replicas
            self._work = dist.all_reduce(flat, group=topo.outer_group, async_op=True)

    def wait(self) -> list[torch.Tensor]:
        """Block until the exchange is done; the averaged outer gradients (float32, one per
        delta, in order), identical on every rank.

        Raises:
            RuntimeError: the collective failed (a peer is gone: the worker runtime restarts
                or resizes the group).
        """
        if self._work is not None:
            self._work.wait()
            self._work = None
        sizes = [torch.Size(self.shapes[i]).numel() for i in self.mine]
        if self.outer_dtype == "int8":
            mine = _dequantize_mean(self._buffers, sizes) if self._buffers else []
        elif self._buffers:
            flat = self._buffers[0].float()
            flat, contributors = flat[:-1], float(flat[-1])
            if contributors != self.topology.replicas:  # some replica joined mid-exchange
                flat = flat * (self.topology.replicas / max(contributors, 1.0))
            mine = list(flat.split(sizes))
        else:
            mine = []
        out: list[torch.Tensor | None] = [None] * len(self.shapes)
        for index, tensor in zip(self.mine, mine, strict=True):
            out[index] = tensor.reshape(self.shapes[index])
        if self.topology.island_size > 1:
            self._share_in_island(out)
        return [t for t in out if t is not None]

    def _share_in_island(self, out: list[torch.Tensor | None]) -> None:
        """Broadcast each island rank's averaged share to the rest of the island."""
        topo = self.topology
        group = topo.island_group
        for rank in range(topo.island_size):
            indices = [i for i, o in enumerate(self.owner) if o == rank]
            if not indices:
                continue
            sizes = [torch.Size(self.shapes[i]).numel() for i in indices]
            if rank == topo.island_rank:
                flat = torch.cat([out[i].reshape(-1) for i in indices])  # type: ignore[union-attr]
            else:
                flat = torch.empty(sum(sizes), dtype=torch.float32, device=self.device)
            dist.broadcast(flat, src=dist.get_global_rank(group, rank), group=group)
            for index, part in zip(indices, flat.split(sizes), strict=True):
                out[index] = part.reshape(self.shapes[index])


def _quantize(tensors: list[torch.Tensor], weight: float = 1.0) -> torch.Tensor:
    """One int8 buffer: the weight and the float32 scales as bytes (4 each, first: a float32
    view needs an aligned offset), then every tensor's values quantized with its own scale."""
    scales = torch.stack([t.abs().max() / 127.0 if t.numel() else t.new_zeros(()) for t in tensors])
    scales = torch.where(scales > 0, scales, torch.ones_like(scales)).float()
    quantized = [
        torch.round(t / s).clamp_(-127, 127).to(torch.int8).reshape(-1)
        for t, s in zip(tensors, scales, strict=True)
    ]
    head = torch.cat([scales.new_full((1,), weight), scales])
    return torch.cat([head.view(torch.int8), *quantized])


def _dequantize_mean(payloads: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """The weighted mean over ``payloads`` (one per replica, summed in rank order) of the
    dequantized tensors."""
    head = 4 * (len(sizes) + 1)
    total: torch.Tensor | None = None
    contributors = 0.0
    for payload in payloads:
        weight_and_scales = payload[:head].view(torch.float32)
        weight, scales = float(weight_and_scales[0]), weight_and_scales[1:]
        contributors += weight
        parts = payload[head:].float().split(sizes)
        flat = torch.cat([p * s * weight for p, s in zip(parts, scales, strict=True)])
        total = flat if total is None else total.add_(flat)
    assert total is not None
    return list(total.div_(max(contributors, 1.0)).split(sizes))
