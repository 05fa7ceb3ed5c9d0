"""Hot spares (``ScalingConfig(spares=K)``), as pure rules checked before any process starts.

A spare is a worker process started with the group, its train function's module imported, its
one-time start-up costs paid (:func:`ringtrain.elastic.runtime.warm_up`) and its channel to the
driver open, that trains nothing until a member is lost (or leaves for a preemption notice): it
then takes that member's rank at the next step boundary, the state coming from a peer (DDP
replicas hold it), and the group goes on at full size. Spares need the in-place runtime
(:mod:`ringtrain.elastic`), so ``spares > 0`` turns it on for an int ``num_workers`` too: the
group then never shrinks (``min = max = num_workers``); with ``num_workers=(min, max)`` a lost
member is replaced while a spare is ready, and the group shrinks (as before) only when none is.

This module says where a spare cannot serve (:func:`spares_refusal`,
:func:`spares_run_refusal`); each message names the field and the fix. It imports neither torch
nor a launcher.
"""

from __future__ import annotations

from typing import Any

from ringtrain.config.validation import check_int

SPARES_FIX = "use spares=0 for none, or spares=K to keep K ready workers"


def check_spares(scaling: Any) -> None:
    """Reject ``ScalingConfig.spares`` values and combinations that cannot serve.

    Args:
        scaling: the :class:`~ringtrain.config.ScalingConfig` being built.

    Raises:
        TypeError: ``spares`` is not an int.
        ValueError: ``spares < 0``, or :func:`spares_refusal` says why they cannot serve.
    """
    check_int("ScalingConfig", "spares", scaling.spares, 0, SPARES_FIX)
    refusal = spares_refusal(scaling)
    if refusal is not None:
        raise ValueError(refusal)


def spares_refusal(scaling: Any) -> str | None:
    """Why the spares of ``scaling`` could never take a lost member's place (``None``: they can,
    or there are none). Pure: reads the config's fields only. (``backend="ray"`` is refused
    with the other backend fields: :mod:`ringtrain.config.backends`.)"""
    k = scaling.spares
    if k == 0:
        return None
    shown = f"ScalingConfig(spares={k})"
    if scaling.parallel is not None:
        return (
            f"{shown} with parallel={scaling.parallel!r}: a spare takes a lost rank's place with "
            "the state of a peer, which only plain data parallelism holds on every rank (an "
            "FSDP/TP/PP rank's shards are on no peer); use parallel=None, or spares=0"
        )
    if scaling.use_gpu:
        return (
            f"{shown} with use_gpu=True: a spare would need the lost worker's device, which "
            "this version does not hand over; use use_gpu=False, or spares=0"
        )
    return None


def spares_run_refusal(spares: int, *, max_failures: int, script: bool) -> str | None:
    """Why a run's spares could never serve, from the parts of the run a ``ScalingConfig``
    does not see (``None``: they can). Checked by ``Trainer.fit`` and ``ringtrain run`` before
    any process starts.

    Args:
        spares: ``ScalingConfig.spares``.
        max_failures: ``FailureConfig.max_failures`` (each hand-over to a spare after a lost
            worker counts as one failure, as a resize in place does).
        script: the run is a script (``ringtrain run script.py``), not a train function.
    """
    if spares == 0:
        return None
    if max_failures == 0:
        return (
            f"ScalingConfig(spares={spares}) with FailureConfig(max_failures=0): the first lost "
            "worker ends the run, so no spare could ever take its place (each hand-over counts "
            "as one failure); set FailureConfig(max_failures=N) with N >= 1 (or -1), or spares=0"
        )
    if script:
        return (
            f"ScalingConfig(spares={spares}) with a script: a spare re-enters a train function "
            "in place, which a script run as __main__ cannot do; pass a train function to "
            "rt.Trainer, or use spares=0"
        )
    return None
