"""The replica check: every ``FailureConfig.replica_check_every`` steps the ranks compare a
64-bit fingerprint of their parameters and optimizer state (:mod:`~ringtrain.integrity.
fingerprint`), one tiny allgather on a gloo group of the check's own.

Data-parallel replicas hold bit-identical state by construction, so a rank whose fingerprint
differs from its replicas' holds corrupted bits (a flipped bit in memory, a miscomputing core).
With three or more replicas the minority is named at once; with two there is no majority, and
the driver names the rank later: it rolls both back to the newest checkpoint that passed a
check, and the re-run, bit-exact by construction, reaches the same step with the true
fingerprint, which one of the two did not have (:mod:`ringtrain.controller.integrity`).

On a device mesh the replicas of a rank are the ranks that hold the same shard: the same
``pp``, ``dp_shard`` and ``tp`` coordinates, along ``dp_replicate`` (HSDP). A layout without
replicas (FSDP over every rank, tensor parallelism alone) cannot be checked: the plug-in refuses
it when the model is prepared, naming what to use instead.

Under DiLoCo (``parallel_strategy="diloco"``) the replicas train alone between syncs, so their
local parameters differ by design; what every rank holds alike is the *global* state (the global
parameters and the outer optimizer's state, moved by the same averaged outer gradient on every
rank), and inside an island of ``dp_shard`` workers (DDP) the local state too. Each rank sends
both fingerprints: the global one is compared over every rank, the local one within islands.

Pipelined like the step agreement (:mod:`ringtrain.worker.preempt`): the allgather of step k's
fingerprint starts at k's boundary and is read at the next one, so no rank waits for it; a
mismatch found there raises :class:`ReplicaMismatchError` on every rank, after telling the
driver (:class:`~ringtrain.wire.channel.IntegrityMismatch`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ringtrain.cluster.distributed import collective_timeout_s, new_gloo_group, settle
from ringtrain.config.parallel import MESH_DIMS, MeshShape
from ringtrain.integrity.fingerprint import fingerprint, state_tensors, to_signed
from ringtrain.parallel.diloco import outer_sync
from ringtrain.wire.channel import IntegrityMismatch, IntegrityVerified
from ringtrain.worker.hooks import ModelSetup, StepState, WorkerPlugin
from ringtrain.worker.session import Session

logger = logging.getLogger("ringtrain")


class ReplicaMismatchError(RuntimeError):
    """Replicas that must hold the same bits do not: silent data corruption (the driver rolls
    the run back to the newest checkpoint that passed a check)."""


def replica_sets(world_size: int, mesh: MeshShape | None) -> list[list[int]]:
    """The groups of ranks that hold bit-identical state: every rank (plain data parallelism),
    or on a mesh the ranks that share their ``pp``, ``dp_shard`` and ``tp`` coordinates."""
    if mesh is None:
        return [list(range(world_size))]
    sizes = [getattr(mesh, d) for d in MESH_DIMS]  # ("pp", "dp_replicate", "dp_shard", "tp")
    sets: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world_size):
        coords, rest = [], rank
        for size in reversed(sizes):
            coords.append(rest % size)
            rest //= size
        pp, _replicate, shard, tp = reversed(coords)
        sets.setdefault((pp, shard, tp), []).append(rank)
    return list(sets.values())


def judge(fingerprints: Mapping[int, int], sets: Sequence[Sequence[int]]) -> tuple[list[int], bool]:
    """The suspect ranks of one check, and whether they are named for sure: in each replica
    set, the ranks whose fingerprint differs from a strict majority's (named), or, without a
    strict majority, every rank of a set that disagrees (not named: two replicas, or a tie).

    Returns:
        ``([], True)`` when every set agrees.
    """
    suspects: list[int] = []
    named = True
    for ranks in sets:
        counts = Counter(fingerprints[r] for r in ranks)
        if len(counts) <= 1:
            continue
        value, votes = counts.most_common(1)[0]
        if votes * 2 > len(ranks):
            suspects += [r for r in ranks if fingerprints[r] != value]
        else:
            suspects += list(ranks)
            named = False
    return sorted(suspects), named


def diloco_state(model: Any) -> Any | None:
    """The :class:`~ringtrain.parallel.diloco_outer.OuterSync` of a model prepared with
    DiLoCo (its global parameters and outer optimizer), ``None`` for any other model."""
    try:
        return outer_sync(model)
    except (ValueError, TypeError, AttributeError):
        return None


def global_tensors(sync: Any) -> list[torch.Tensor]:
    """DiLoCo's global state, in an order every rank shares: the global parameters, then the
    outer optimizer's state tensors by parameter index and name."""
    found = list(sync.global_params)
    state = sync.outer.state_dict().get("state", {})
    for index in sorted(state):
        found += [v for _k, v in sorted(state[index].items()) if isinstance(v, torch.Tensor)]
    return found


def judge_diloco(
    local: Mapping[int, int], global_: Mapping[int, int], islands: Mapping[int, int]
) -> tuple[list[int], bool]:
    """:func:`judge` for DiLoCo: the global fingerprints over every rank, the local ones over
    the ranks of each island (``islands``: rank -> its replica index)."""
    sets: dict[int, list[int]] = {}
    for rank, island in sorted(islands.items()):
        sets.setdefault(island, []).append(rank)
    a, named_a = judge(global_, [sorted(global_)])
    b, named_b = judge(local, list(sets.values()))
    return sorted(set(a) | set(b)), named_a and named_b


class ReplicaCheck(WorkerPlugin):
    """The replica check of one worker (see the module docs).

    Args:
        session: the worker's session (its context, channel and ``WorkerConfig``).
        every: check every this many steps (``FailureConfig.replica_check_every``).
        recheck_step: a step whose fingerprint the driver wants (after a mismatch without a
            majority: the re-run's value names the corrupted rank); ``None``: none.
    """

    def __init__(self, session: Session, every: int, recheck_step: int | None = None) -> None:
        self.session = session
        self.every = every
        self.recheck_step = recheck_step
        self.model: Any = None
        self.optimizer: Any = None
        self.last_passed: int | None = None  # the newest step whose check passed
        self.round_steps: dict[int, int] = {}  # report round -> the step it was reported at
        self.checks = 0  # checks started (for tests and the cost benchmark)
        self._step: int | None = None
        self._started: int | None = None  # the step of the newest check started
        self._state: tuple[Any, Any] | None = None  # (model, optimizer) of the newest step
        self._group: Any = None
        self._group_for: Any = None
        self._pending: tuple[Any, torch.Tensor, int, int] | None = None

    # ------------------------------------------------------------------ hooks
    def on_group_formed(self) -> None:
        """Make the check's gloo group over the new default group (every rank does, now)."""
        if self.session.context.world_size > 1 and dist.is_initialized():
            self._new_group()

    def on_group_broken(self) -> None:
        """An elastic resize tears the group down: the check in flight is waited for (it ends
        at once: the connections were ended) and dropped unread, with the check's group (the
        next one starts on the re-formed group; see ``WorkerPlugin.on_group_broken``)."""
        pending, self._pending = self._pending, None
        group, self._group, self._group_for = self._group, None, None
        if pending is not None:
            settle(pending[0], group)

    def after_wrap(self, setup: ModelSetup) -> None:
        """Refuse a layout without replicas, before the first step."""
        ctx = self.session.context
        if ctx.world_size <= 1:
            return
        sets = replica_sets(ctx.world_size, ctx.config.mesh)
        sharded = any(hasattr(p, "to_local") for p in setup.module.parameters())
        if all(len(s) == 1 for s in sets) or (sharded and ctx.config.mesh is None):
            raise ValueError(
                "FailureConfig(replica_check_every=...) compares replicas, but this model has "
                "none: FSDP (or tensor parallelism) gives every rank different shards. Use "
                "ScalingConfig(parallel=ParallelConfig(dp_replicate=R, dp_shard=S)) with R >= 2 "
                "to check the replicate axis, or FailureConfig(replay_check_every=...), which "
                "recomputes a rank's step on another rank"
            )

    def on_restore(self, state: object, checkpoint: object) -> None:
        """The restored state is where a rollback resumed: it counts as checked."""
        step = int(getattr(state, "step", 0))
        self.last_passed = step
        self.round_steps[self.session.next_round - 1] = step

    def on_report(self, metrics: Mapping[str, object], round_: int) -> None:
        if self._step is not None:
            self.round_steps[round_] = self._step

    def on_step(self, state: StepState) -> None:
        """Read the previous check (raising on a mismatch); start this step's if it is due.

        Raises:
            ReplicaMismatchError: the previous check found replicas with different bits.
        """
        step = int(state.step)
        self._step = step
        self._finish()
        model = _get(state, "model")
        if model is not None:
            self._state = (model, _get(state, "optimizer"))
            if step % self.every == 0:
                self._start(step, model, self._state[1])

    def on_worker_stop(self, error: BaseException | None) -> None:
        """The train function returned: the last check started is read, and the final state
        is checked if its step was not (a flip in the last ``every - 1`` steps would otherwise
        end up in the run's result unseen). Every rank returns after the same step, so every
        rank starts that check.

        Raises:
            ReplicaMismatchError: either check found replicas with different bits.
        """
        if error is not None:
            return
        self._finish()
        if self._state is not None and self._step is not None and self._started != self._step:
            self._start(self._step, *self._state)
            self._finish()

    # ------------------------------------------------------------------ the check
    def _new_group(self) -> None:
        timeout = collective_timeout_s(self.session.context.worker_timeout_s)
        self._group = new_gloo_group(timeout)
        self._group_for = dist.group.WORLD

    def _start(self, step: int, model: Any, optimizer: Any) -> None:
        value = to_signed(fingerprint(state_tensors(model, optimizer)))
        sync = diloco_state(model)
        # [local, global, island]: a DiLoCo rank's global state and its replica index; -1 for
        # a model without a global state (the local fingerprint is compared over replica_sets).
        row = [value, 0, -1]
        if sync is not None:
            row = [value, to_signed(fingerprint(global_tensors(sync))), sync.topology.replica]
        ctx = self.session.context
        self.checks += 1
        self._started = step
        mine = torch.tensor(row, dtype=torch.int64)
        if ctx.world_size <= 1 or not dist.is_initialized():
            self._pending = (None, mine, step, value)
            return
        if self._group is None or self._group_for is not dist.group.WORLD:
            self._new_group()
        gathered = torch.empty(ctx.world_size * 3, dtype=torch.int64)
        work = dist.all_gather_single(gathered, mine, group=self._group, async_op=True)
        self._pending = (work, gathered, step, value)

    def _finish(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        work, gathered, step, value = pending
        if work is None:
            self._passed(step, value)
            return
        work.wait()
        rows = gathered.view(-1, 3).tolist()
        values = {r: int(row[0]) & ((1 << 64) - 1) for r, row in enumerate(rows)}
        ctx = self.session.context
        if rows[0][2] >= 0:  # DiLoCo
            globals_ = {r: int(row[1]) & ((1 << 64) - 1) for r, row in enumerate(rows)}
            islands = {r: int(row[2]) for r, row in enumerate(rows)}
            suspects, named = judge_diloco(values, globals_, islands)
            if any(globals_[r] != globals_[0] for r in globals_):
                values = globals_  # the event shows the fingerprints that differ
        else:
            suspects, named = judge(values, replica_sets(ctx.world_size, ctx.config.mesh))
        if not suspects:
            self._passed(step, value)
            return
        clean = max(
            (
                r
                for r, s in self.round_steps.items()
                if self.last_passed is not None and s <= self.last_passed
            ),
            default=-1,
        )
        message = IntegrityMismatch(
            rank=ctx.world_rank,
            time=time.time(),
            step=step,
            check="replica",
            fingerprints=values,
            suspects=tuple(suspects),
            named=named,
            last_clean_step=self.last_passed,
            clean_round=clean,
        )
        if self.session.channel is not None:
            self.session.channel.send(message)
        who = f"rank(s) {suspects}" if named else f"one of ranks {suspects} (no majority)"
        raise ReplicaMismatchError(
            f"replica check at step {step}: {who} hold(s) other parameter or optimizer bits "
            f"than their replicas (fingerprints {_hex(values)}): silent data corruption; the "
            f"run rolls back to the newest checkpoint that passed a check (step "
            f"{self.last_passed})"
        )

    def _passed(self, step: int, value: int) -> None:
        self.last_passed = step
        if step == self.recheck_step and self.session.context.world_rank == 0:
            channel = self.session.channel
            if channel is not None:
                channel.send(
                    IntegrityVerified(
                        rank=0, time=time.time(), step=step, fingerprint=value & ((1 << 64) - 1)
                    )
                )


def _get(state: object, name: str) -> Any:
    """``state[name]`` of a TrainState (``None``: no such object, or not a TrainState)."""
    try:
        return state[name]  # type: ignore[index]
    except (KeyError, TypeError):
        return None


def _hex(values: Mapping[int, int]) -> str:
    return ", ".join(f"rank {r}: {v:016x}" for r, v in sorted(values.items()))
