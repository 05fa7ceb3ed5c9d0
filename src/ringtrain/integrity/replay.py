"""The replay check: every ``FailureConfig.replay_check_every`` steps each rank's step is
recomputed on its neighbour in a ring, and the local gradients compared bit for bit.

The replica check cannot see a rank whose *gradient* is wrong (a core that miscomputes during
its backward): the allreduce spreads the wrong gradient to every replica alike. But a rank's
step is a deterministic function of its inputs, its RNG state and the parameters every replica
shares, so another rank can compute it again and must get the same bits:

1. At a replay step t every rank records what its model's forward got (the inputs, the RNG
   state right before it), the gradient its loss sent back into the model's outputs, and a
   fingerprint of each parameter's local gradient (before the allreduce: a tensor hook), and
   keeps a copy of the parameters and buffers its forward of step t saw.
2. At the step boundary after t, rank ``i`` sends its record to rank ``i + 1 (mod W)`` (a chain
   of point-to-point sends on the check's own gloo group; tensors with a header of integers,
   never a pickle) and receives rank ``i - 1``'s; it replays the forward with that rank's inputs
   and RNG state on the saved parameters and the model's backward with that rank's output
   gradient (``torch.autograd.grad``), compares the per-parameter fingerprints, and puts its
   parameters, buffers and RNG state back. Every rank learns the verdicts (one allgather).
   Every rank's step is checked at every replay step, for one replay per rank: a transient
   flip is caught when its step is a replay step (a rate of 1/N), a rank that miscomputes at
   every step within N steps.
3. A mismatch of the pair (``i - 1``, ``i``): from three workers on, a rank whose record *and*
   whose replay both disagree (a device that miscomputes both times) is named
   (:func:`verdict`); otherwise both ranks of each disagreeing pair are suspects, not named.
   Every rank raises :class:`~ringtrain.integrity.replicas.ReplicaMismatchError` and the driver
   rolls back as for the replica check (check ``"replay"``).

Assumptions (docs/fault-tolerance.md): the loss depends on the parameters only through the
model's outputs (weight decay in the optimizer is fine; an L2 term added to the loss is not);
one forward of the prepared model per step (a step with gradient accumulation, or a second
forward, is not replayed, and says so once); positional tensor inputs, and keyword inputs that
are tensors or ``None``. The cost is a recomputation of one micro-batch per rank every N steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.cluster.distributed import collective_timeout_s, new_gloo_group
from ringtrain.integrity.fingerprint import tensor_sums
from ringtrain.integrity.replicas import ReplicaMismatchError
from ringtrain.integrity.wire import recv_tensors, send_tensors
from ringtrain.wire.channel import IntegrityMismatch
from ringtrain.worker.hooks import ModelSetup, StepState, WorkerPlugin
from ringtrain.worker.session import Session

logger = logging.getLogger("ringtrain")

OK, MISMATCH, SKIPPED = 0, 1, 2


def neighbours(rank: int, world_size: int) -> tuple[int, int]:
    """``(the rank whose step this rank replays, the rank that replays this rank's step)``."""
    return (rank - 1) % world_size, (rank + 1) % world_size


def verdict(results: Mapping[int, int], world_size: int) -> tuple[list[int], bool]:
    """Who a replay step names, from each rank's result (``results[q]``: :data:`OK` or
    :data:`MISMATCH`, rank ``q``'s replay of rank ``q - 1``'s step). ``([], True)``: every pair
    agrees. From three workers on, the ranks that are in two disagreeing pairs (their record
    and their replay both differ: a device that miscomputes) are named, when every disagreeing
    pair holds one of them; otherwise every rank of a disagreeing pair is a suspect, not named
    (a transient flip: the recording rank or its replayer; two workers; every pair disagreeing).
    """
    pairs = [((q - 1) % world_size, q) for q in sorted(results) if results[q] == MISMATCH]
    if not pairs:
        return [], True
    involved = sorted({r for pair in pairs for r in pair})
    if world_size < 3 or len(pairs) == world_size:
        return involved, False
    named = [r for r in involved if sum(r in pair for pair in pairs) >= 2]
    if named and all(any(r in pair for r in named) for pair in pairs):
        return named, True
    return involved, False


class ReplayCheck(WorkerPlugin):
    """The replay check of one worker (see the module docs).

    Args:
        session: the worker's session.
        every: replay a step every this many steps (``FailureConfig.replay_check_every``).
    """

    def __init__(self, session: Session, every: int) -> None:
        self.session = session
        self.every = every
        self.module: Any = None
        self.replays = 0  # replays this rank computed (tests, the cost benchmark)
        self.skipped = 0
        self.round_steps: dict[int, int] = {}
        self._step = 0
        self._armed: int | None = None  # the replay step being recorded
        self._record: dict[str, Any] | None = None  # what this rank recorded of its step
        self._saved: dict[str, list[torch.Tensor]] | None = None  # params, buffers it saw
        self._forwards = 0
        self._hooks: list[Any] = []
        self._replaying = False
        self._said_skip = False
        self._group: Any = None
        self._group_for: Any = None

    # ------------------------------------------------------------------ hooks
    def on_group_formed(self) -> None:
        if self.session.context.world_size > 1 and dist.is_initialized():
            timeout = collective_timeout_s(self.session.context.worker_timeout_s)
            self._group = new_gloo_group(timeout)
            self._group_for = dist.group.WORLD

    def after_wrap(self, setup: ModelSetup) -> None:
        """Watch the prepared module's forward (its inputs, RNG state, outputs)."""
        if any(hasattr(p, "to_local") for p in setup.module.parameters()):
            raise ValueError(
                "FailureConfig(replay_check_every=...) recomputes a rank's step on another "
                "rank, which needs the whole model on each: it does not work with FSDP or tensor "
                "parallelism (sharded parameters); use replica_check_every with "
                "ParallelConfig(dp_replicate=R, dp_shard=S), R >= 2, to check HSDP's replicas"
            )
        self.module = setup.module
        setup.module.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        setup.module.register_forward_hook(self._after_forward)

    def on_report(self, metrics: Mapping[str, object], round_: int) -> None:
        self.round_steps[round_] = self._step

    def on_restore(self, state: object, checkpoint: object) -> None:
        self.round_steps[self.session.next_round - 1] = int(getattr(state, "step", 0))

    def on_step(self, state: StepState) -> None:
        """Replay the step that just ended if it was a replay step; arm the next one.

        Raises:
            ReplicaMismatchError: a replayed gradient differed.
        """
        step = int(state.step)
        self._step = step
        ctx = self.session.context
        if ctx.world_size < 2 or self.module is None or not dist.is_initialized():
            return
        if self._armed is not None and self._armed == step:
            self._exchange(step)
        self._disarm()
        if (step + 1) % self.every == 0:
            self._arm(step + 1)

    # ------------------------------------------------------------------ recording a step
    def _arm(self, step: int) -> None:
        self._armed, self._forwards = step, 0
        self._saved = None
        self._record = {"grads": {}, "outputs": [], "g_out": {}}
        for i, p in enumerate(self.module.parameters()):
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook(i)))

    def _disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._armed = None

    def _grad_hook(self, index: int) -> Any:
        """The local gradient as the backward left it in ``param.grad`` (after every tensor hook:
        what DDP reduces), ``+ 0.0`` so that a -0.0 and a +0.0 compare equal."""

        def hook(param: torch.Tensor) -> None:
            if self._record is not None and not self._replaying and param.grad is not None:
                self._record["grads"][index] = tensor_sums([param.grad + 0.0])[0]

        return hook

    def _before_forward(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._armed is None or self._replaying:
            return
        self._forwards += 1
        if self._forwards == 1:
            self._saved = {
                "params": [p.detach().clone() for p in module.parameters()],
                "buffers": [b.detach().clone() for b in module.buffers()],
            }
        if self._record is not None and self._forwards == 1:
            rec = self._record
            rec["args"] = [_copy(a) for a in args]
            rec["kwargs"] = {k: _copy(v) for k, v in kwargs.items()}
            rec["rng"] = torch.get_rng_state()
            device = next(module.parameters()).device
            if device.type == "cuda":  # dropout on the GPU draws from its own generator
                rec["cuda_rng"] = torch.cuda.get_rng_state(device)

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if self._record is None or self._replaying or self._forwards != 1:
            return
        outs = [t for t in _tensors(output) if t.is_floating_point() and t.requires_grad]
        self._record["outputs"] = outs

        def keep(i: int) -> Any:
            def hook(grad: torch.Tensor) -> None:
                if self._record is not None:
                    self._record["g_out"][i] = grad.detach().clone()

            return hook

        for i, t in enumerate(outs):
            t.register_hook(keep(i))

    # ------------------------------------------------------------------ the exchange
    def _exchange(self, step: int) -> None:
        ctx = self.session.context
        world, me = ctx.world_size, ctx.world_rank
        before, after = neighbours(me, world)
        if self._group is None or self._group_for is not dist.group.WORLD:
            self.on_group_formed()
        tensors, meta = self._payload()
        # A chain round the ring (rank 0 sends first, every other rank receives first): blocking
        # point-to-point calls that cannot wait on each other in a circle.
        if me == 0:
            send_tensors(tensors, meta, after, self._group)
            theirs = recv_tensors(before, self._group)
        else:
            theirs = recv_tensors(before, self._group)
            send_tensors(tensors, meta, after, self._group)
        result = self._replay(*theirs)
        mine = torch.tensor([result], dtype=torch.int64)
        everyone = torch.empty(world, dtype=torch.int64)
        dist.all_gather_single(everyone, mine, group=self._group)
        results = {q: int(everyone[q]) for q in range(world)}
        if any(v == SKIPPED for v in results.values()):
            self.skipped += 1
            return
        suspects, named = verdict(results, world)
        if suspects:
            self._mismatch(step, suspects, named)

    def _payload(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        rec = self._record
        if rec is None or self._forwards != 1 or "args" not in rec or not rec["outputs"]:
            return [], {"valid": 0}
        if not all(isinstance(a, torch.Tensor) for a in rec["args"]) or not all(
            v is None or isinstance(v, torch.Tensor) for v in rec["kwargs"].values()
        ):
            return [], {"valid": 0}
        names = [k for k, v in rec["kwargs"].items() if v is not None]
        n_params = sum(1 for _ in self.module.parameters())
        got = rec["grads"]
        grads = torch.tensor(
            [got[i] - (1 << 63) if i in got else 0 for i in range(n_params)], dtype=torch.int64
        )
        present = torch.tensor([int(i in got) for i in range(n_params)], dtype=torch.int64)
        g_out = [rec["g_out"].get(i, torch.zeros(0)) for i in range(len(rec["outputs"]))]
        rng = [rec["rng"], *([rec["cuda_rng"]] if "cuda_rng" in rec else [])]
        tensors = [
            *rec["args"],
            *[rec["kwargs"][k] for k in names],
            *rng,
            *g_out,
            grads,
            present,
        ]
        meta = {
            "valid": 1,
            "args": len(rec["args"]),
            "kwargs": names,
            "rngs": len(rng),
            "outputs": len(g_out),
        }
        return tensors, meta

    def _replay(self, tensors: list[torch.Tensor], meta: dict[str, Any]) -> int:
        """Recompute the previous rank's step here; :data:`OK`, :data:`MISMATCH` or
        :data:`SKIPPED`."""
        saved = self._saved
        if not meta.get("valid") or saved is None or self._forwards != 1:
            self._say_skip()
            return SKIPPED
        n_args, names = int(meta["args"]), list(meta["kwargs"])
        n_rngs, n_out = int(meta["rngs"]), int(meta["outputs"])
        rest = iter(tensors)
        args = [next(rest) for _ in range(n_args)]
        kwargs = {k: next(rest) for k in names}
        rngs = [next(rest) for _ in range(n_rngs)]
        g_out = [next(rest) for _ in range(n_out)]
        theirs, present = next(rest), next(rest)
        module, device = self.module, next(self.module.parameters()).device
        params = list(module.parameters())
        buffers = list(module.buffers())
        mine = [p.detach().clone() for p in params], [b.detach().clone() for b in buffers]
        own_rng = torch.get_rng_state()
        own_cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        self._replaying = True
        try:
            with torch.no_grad():
                for p, s in zip(params, saved["params"], strict=True):
                    p.copy_(s)
                for b, s in zip(buffers, saved["buffers"], strict=True):
                    b.copy_(s)
            torch.set_rng_state(rngs[0])
            if len(rngs) > 1 and device.type == "cuda":
                torch.cuda.set_rng_state(rngs[1], device)
            inputs = [a.to(device) for a in args]
            out = module(*inputs, **{k: v.to(device) for k, v in kwargs.items()})
            outs = [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad]
            wanted = [p for p in params if p.requires_grad]
            pairs = [(o, g.to(device)) for o, g in zip(outs, g_out, strict=False) if g.numel()]
            grads = torch.autograd.grad(
                [o for o, _ in pairs],
                wanted,
                grad_outputs=[g for _, g in pairs],
                allow_unused=True,
            )
        finally:
            with torch.no_grad():
                for p, m in zip(params, mine[0], strict=True):
                    p.copy_(m)
                for b, m in zip(buffers, mine[1], strict=True):
                    b.copy_(m)
            torch.set_rng_state(own_rng)
            if own_cuda is not None:
                torch.cuda.set_rng_state(own_cuda, device)
            self._replaying = False
        self.replays += 1
        by_param = iter(grads)
        for i, p in enumerate(params):
            if not p.requires_grad:
                continue
            g = next(by_param)
            had = bool(present[i])
            if g is None:
                if had:
                    return MISMATCH
                continue
            if not had or tensor_sums([g + 0.0])[0] - (1 << 63) != int(theirs[i]):
                return MISMATCH
        return OK

    def _say_skip(self) -> None:
        if not self._said_skip:
            self._said_skip = True
            logger.warning(
                "replay check: a step was not replayed (gradient accumulation or a second "
                "forward in one step, or inputs that are not tensors): such steps are skipped"
            )

    def _mismatch(self, step: int, suspects: list[int], named: bool) -> None:
        ctx = self.session.context
        clean = max((rd for rd, s in self.round_steps.items() if s < step), default=-1)
        message = IntegrityMismatch(
            rank=ctx.world_rank,
            time=time.time(),
            step=step,
            check="replay",
            fingerprints={},
            suspects=tuple(suspects),
            named=named,
            last_clean_step=step - 1,
            clean_round=clean,
        )
        if self.session.channel is not None:
            self.session.channel.send(message)
        who = f"rank(s) {suspects}" if named else f"one of ranks {suspects}"
        raise ReplicaMismatchError(
            f"replay check of step {step}: {who} computed other gradient bits than the replay "
            "(silent data corruption); the run rolls back to the newest checkpoint before step "
            f"{step}"
        )


def _copy(value: Any) -> Any:
    """A tensor input, copied to the CPU (sent later); anything else as it is."""
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a forward's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


__all__ = ["MISMATCH", "OK", "SKIPPED", "ReplayCheck", "neighbours", "verdict"]
