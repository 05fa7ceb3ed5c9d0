"""DiLoCo's outer loop on one rank: the global parameters, the outer optimizer, the fragment
schedule and the exchange in flight, as one Stateful object.

The algorithm (DiLoCo, Douillard et al. 2023, arXiv:2311.08105, Algorithm 1; Streaming DiLoCo,
arXiv:2501.18512, Algorithm 2), at every inner optimizer step ``t`` (1, 2, ...) of a replica:

1. if the exchange in flight is due (``t == start + sync_delay``): wait for the averaged outer
   gradient ``g`` of its fragment, step the outer optimizer on that fragment's global parameters
   (``global.grad = g``; the other fragments have no gradient and are left alone), and set the
   local fragment to ``alpha * local + (1 - alpha) * global`` (``alpha = merge_alpha``; 0 without
   overlap: the local fragment becomes the global one);
2. if ``t % H`` is the offset of fragment ``p`` (``DiLoCoConfig.offset``): compute its outer
   gradient ``global - local`` (float32) and start averaging it over the replicas
   (:class:`~ringtrain.parallel.diloco_exchange.Exchange`); with ``sync_delay == 0`` step 1
   follows at once.

The inner optimizer's state is each replica's own and is never reset (DiLoCo keeps it across
outer steps). :meth:`OuterSync.state_dict` holds everything a bit-exact resume needs that differs
between replicas or is not in the model's own state: the local parameters and buffers, the inner
optimizer's state, the global parameters, the outer optimizer's state, the step counters and the
outer gradient in flight (re-sent unchanged after a resume: same bytes in, same average out).
TrainState saves it in each rank's own file (``ringtrain.worker.state.attach_rank_state``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ringtrain.config.diloco import DiLoCoConfig
from ringtrain.parallel.diloco_exchange import Exchange, Topology

FORMAT = 1


def default_outer_optimizer(config: DiLoCoConfig) -> Callable[[list[torch.Tensor]], Any]:
    """The outer optimizer factory: ``config.outer_optimizer``, else SGD with Nesterov momentum
    (``outer_lr``, ``outer_momentum``; plain SGD when the momentum is 0), DiLoCo §3."""
    if config.outer_optimizer is not None:
        return config.outer_optimizer
    lr, momentum = config.resolved_outer_lr, config.resolved_outer_momentum

    def sgd(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)

    return sgd


@dataclass
class SyncStats:
    """What the outer loop cost this rank since the worker started (not saved).

    Attributes:
        bytes_sent: bytes put on the wire by outer exchanges (see
            :attr:`~ringtrain.parallel.diloco_exchange.Exchange.bytes_sent`).
        seconds: wall time the training thread spent in the outer loop: computing outer
            gradients, starting exchanges, waiting for them, the outer step and the merge (s).
        exchanges: exchanges started.
        peak_bytes: the most bytes one exchange sent.
    """

    bytes_sent: int = 0
    seconds: float = 0.0
    exchanges: int = 0
    peak_bytes: int = 0


@dataclass
class _Pending:
    fragment: int
    due: int
    deltas: list[torch.Tensor]
    weight: float = 1.0  # 0: this replica joined while the exchange was in flight
    exchange: Exchange | None = None
    started: float = field(default_factory=time.perf_counter)


class OuterSync:
    """One rank's outer loop (see the module docs).

    Args:
        module: the replica's unwrapped module (its parameters are the local parameters).
        config: the run's :class:`ringtrain.DiLoCoConfig`.
        topology: who averages with whom.
        fragments: lists of parameter indices (``named_parameters()`` order),
            :func:`ringtrain.parallel.diloco_fragments.split_fragments`.

    Attributes:
        inner: the inner optimizer (adopted at its first prepared ``step()``).
        inner_steps: inner optimizer steps taken (the ``t`` of the schedule).
        outer_steps: outer optimizer steps applied (one per fragment exchange).
        restored: whether :meth:`load_state_dict` ran (a resumed rank).
        stats: :class:`SyncStats`.
    """

    def __init__(
        self,
        module: nn.Module,
        config: DiLoCoConfig,
        topology: Topology,
        fragments: list[list[int]],
    ) -> None:
        self.module = module
        self.config = config
        self.topology = topology
        self.fragments = fragments
        named = list(module.named_parameters())
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.global_params = [p.detach().float().clone().requires_grad_() for p in self.params]
        self.outer = default_outer_optimizer(config)(self.global_params)
        self.offsets = {config.offset(f): f for f in range(len(fragments))}
        self.inner: torch.optim.Optimizer | None = None
        self.inner_steps = 0
        self.outer_steps = 0
        self.restored = False
        self.stats = SyncStats()
        self._pending: _Pending | None = None
        self._inner_state: dict[str, Any] | None = None  # restored before the optimizer came

    @property
    def in_flight(self) -> int | None:
        """The fragment whose exchange is in flight (started, its outer step not applied yet),
        or ``None``."""
        return None if self._pending is None else self._pending.fragment

    # ------------------------------------------------------------------ the schedule
    def adopt(self, optimizer: Any) -> bool:
        """Whether ``optimizer`` (a prepared optimizer) is the inner one: the first whose
        parameters include one of the module's; it is adopted then."""
        if optimizer is self.inner:
            return True
        mine = {id(p) for p in self.params}
        if not any(id(p) in mine for g in optimizer.param_groups for p in g["params"]):
            return False
        self.inner = optimizer
        if self._inner_state is not None:
            optimizer.load_state_dict(self._inner_state)
            self._inner_state = None
        return True

    def after_inner_step(self) -> None:
        """Advance the schedule by one inner step (finish a due exchange, start a new one)."""
        began = time.perf_counter()
        self.inner_steps += 1
        t = self.inner_steps
        pending = self._pending
        if pending is not None and pending.exchange is None:
            self._send(pending)  # restored mid-exchange: send the same outer gradient again
        if pending is not None and t >= pending.due:
            self._finish()
        fragment = self.offsets.get(t % self.config.sync_every)
        if fragment is not None:
            self._start(fragment, t)
        self.stats.seconds += time.perf_counter() - began

    def _start(self, fragment: int, t: int) -> None:
        with torch.no_grad():
            deltas = [
                self.global_params[i].detach() - self.params[i].detach().float()
                for i in self.fragments[fragment]
            ]
        pending = _Pending(fragment, t + self.config.sync_delay, deltas)
        self._pending = pending
        self._send(pending)
        if self.config.sync_delay == 0:
            self._finish()

    def _send(self, pending: _Pending) -> None:
        pending.exchange = Exchange(
            pending.deltas, self.topology, self.config.outer_dtype, pending.weight
        )
        sent = pending.exchange.bytes_sent
        self.stats.bytes_sent += sent
        self.stats.exchanges += 1
        self.stats.peak_bytes = max(self.stats.peak_bytes, sent)

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None and pending.exchange is not None
        averaged = pending.exchange.wait()
        indices = self.fragments[pending.fragment]
        alpha = self.config.resolved_merge_alpha
        with torch.no_grad():
            for i, g in zip(indices, averaged, strict=True):
                self.global_params[i].grad = g.to(self.global_params[i].device)
            self.outer.step()
            for i in indices:
                self.global_params[i].grad = None
                local, new = self.params[i], self.global_params[i]
                if alpha == 0.0:
                    local.copy_(new)
                else:
                    local.copy_(local.float().mul_(alpha).add_(new, alpha=1.0 - alpha))
        self.outer_steps += 1

    def drain(self) -> None:
        """Wait for an exchange still in flight (the last steps of a run): every rank started
        it, so every rank must see it through before the process group goes. Its outer step
        is not applied (the run ended before it was due)."""
        pending = self._pending
        if pending is not None and pending.exchange is not None:
            pending.exchange.wait()

    # ------------------------------------------------------------------ state
    def layout(self) -> dict[str, Any]:
        """What must match between a checkpoint and this run: parameter names, fragments,
        ``sync_every``."""
        return {
            "names": list(self.names),
            "fragments": [list(f) for f in self.fragments],
            "sync_every": self.config.sync_every,
        }

    def shared_state(self) -> dict[str, Any]:
        """The part identical on every replica: counters, global parameters, outer optimizer."""
        return {
            "format": FORMAT,
            "layout": self.layout(),
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "global": [p.detach() for p in self.global_params],
            "outer_optimizer": self.outer.state_dict(),
            "in_flight": None
            if self._pending is None
            else [self._pending.fragment, self._pending.due],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's whole outer-loop state (see the module docs)."""
        pending = self._pending
        inner = self.inner.state_dict() if self.inner is not None else self._inner_state
        return {
            **self.shared_state(),
            "local": self.module.state_dict(),
            "inner_optimizer": inner,
            "pending": None
            if pending is None
            else {
                "fragment": pending.fragment,
                "due": pending.due,
                "deltas": pending.deltas,
                "weight": pending.weight,
            },
        }

    def load_shared_state(self, state: dict[str, Any]) -> None:
        """Load :meth:`shared_state` (a peer's, or the part of a saved state).

        Raises:
            ValueError: the state was saved with another model or DiLoCo layout.
        """
        if state.get("layout") != self.layout():
            raise ValueError(
                "the checkpoint's DiLoCo state was saved with another model or DiLoCoConfig "
                "(parameter names, fragments or sync_every differ): resume with the same ones"
            )
        with torch.no_grad():
            for p, saved in zip(self.global_params, state["global"], strict=True):
                p.copy_(saved)
        self.outer.load_state_dict(state["outer_optimizer"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` (this rank's, saved by a TrainState)."""
        self.load_shared_state(state)
        self.module.load_state_dict(state["local"])
        inner = state.get("inner_optimizer")
        if inner is not None:
            if self.inner is not None:
                self.inner.load_state_dict(inner)
            else:
                self._inner_state = inner
        pending = state.get("pending")
        self._pending = None
        if pending is not None:
            self._pending = _Pending(
                int(pending["fragment"]),
                int(pending["due"]),
                list(pending["deltas"]),
                float(pending.get("weight", 1.0)),
            )
        self.restored = True

    def reset_from_local(self) -> None:
        """Start the outer loop afresh from the local parameters (a checkpoint without DiLoCo
        state: every rank loaded the same model)."""
        with torch.no_grad():
            for g, p in zip(self.global_params, self.params, strict=True):
                g.copy_(p.detach().float())
        self.outer = default_outer_optimizer(self.config)(self.global_params)
        self._pending = None

    def join(self, in_flight: list[int] | None = None) -> None:
        """Become a replica that joins now, holding the group's global state (counters, global
        parameters, outer optimizer: :meth:`load_shared_state`): the local parameters become
        the global ones, and an exchange the group has in flight (``in_flight``: its fragment
        and due step, from :meth:`shared_state`; or the one this state holds) is joined with a
        zero outer gradient of weight 0 (the collective needs every rank; the mean leaves it
        out). The replica contributes from its next sync on."""
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params, strict=True):
                p.copy_(g)
        if in_flight is not None and self._pending is None:
            fragment, due = int(in_flight[0]), int(in_flight[1])
            zeros = [self.global_params[i].detach() for i in self.fragments[fragment]]
            self._pending = _Pending(fragment, due, zeros)
        pending = self._pending
        if pending is not None:
            pending.deltas = [torch.zeros_like(d) for d in pending.deltas]
            pending.weight = 0.0
            pending.exchange = None
