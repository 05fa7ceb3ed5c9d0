"""What the driver does about silent data corruption: a decider over a replica check's
mismatch (:mod:`ringtrain.integrity.replicas`).

- **Named at once** (three or more replicas: the minority): the ranks are *caught*; the run
  rolls back to the newest checkpoint that passed a check (the newer ones are set aside) and
  continues, without counting a failure against ``max_failures``.
- **Not named** (two replicas, or a tie): every rank of the set is a suspect; the run rolls back
  the same way, and the re-run, bit-exact by construction, reaches the mismatch's step with the
  true fingerprint (:class:`~ringtrain.wire.channel.IntegrityVerified`): a suspect whose
  fingerprint there was the true one is cleared, the other caught (:func:`named_by_rerun`).
  Usually both differ from the true one: a corrupted parameter changes that rank's gradient,
  and the allreduce spreads it to every replica at the next step, so with two replicas the
  source cannot be told (the event says ``unresolved``; three replicas name it at once).
- **Caught twice**: a rank that corrupts twice is not trusted a third time. An elastic run
  restarts without one worker while ``min_workers`` holds; otherwise the run fails with a clear
  error naming the rank and its host. Suspects that were never told apart fail the run the
  same way the second time (both named: one of them corrupts repeatedly).

Every decision is a ``replica_mismatch`` event in ``events.jsonl`` (``step``, ``check``,
``ranks``, ``hosts``, ``action``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

from ringtrain.controller.effects import Effect, Say, Write
from ringtrain.rundir.schema import ReplicaMismatchEvent
from ringtrain.wire.channel import IntegrityMismatch, IntegrityVerified

ACTIONS = ("rollback", "exclude", "fail", "named", "unresolved")
"""The ``action`` of a ``replica_mismatch`` event."""


@dataclass(frozen=True)
class Recheck:
    """A mismatch without a majority, to be named by the re-run: its ``step``, every rank's
    ``fingerprints`` there, and the ranks' ``hosts``."""

    step: int
    fingerprints: dict[int, int]
    hosts: dict[int, str]


@dataclass(frozen=True)
class IntegrityDecision:
    """What to do about one mismatch.

    Attributes:
        action: ``"rollback"`` (to ``clean_round``'s checkpoint), ``"exclude"`` (an elastic
            run restarts without ``excluded``), or ``"fail"``.
        reason: one line for the transition and the log.
        culprits: the ranks caught by this mismatch (empty until a re-run names them).
        excluded: the ranks caught twice.
        clean_round: the newest report round whose checkpoint passed a check (``-1``: none).
        recheck: what the re-run must tell, when the mismatch named no one.
        effects: the ``replica_mismatch`` event and the message.
    """

    action: str
    reason: str
    culprits: tuple[int, ...] = ()
    excluded: tuple[int, ...] = ()
    clean_round: int = -1
    recheck: Recheck | None = None
    effects: list[Effect] = field(default_factory=list)


def _where(ranks: tuple[int, ...] | list[int], hosts: Mapping[int, str]) -> str:
    return ", ".join(f"rank {r} on {hosts.get(r, '?')}" for r in ranks)


def after_mismatch(
    mismatch: IntegrityMismatch,
    *,
    hosts: Mapping[int, str],
    caught: Counter[int],
    suspected: Counter[int],
    can_shrink_by: int,
) -> IntegrityDecision:
    """The decision about ``mismatch``.

    Args:
        mismatch: what the check found (its suspects, whether they are named).
        hosts: rank -> host name of the group.
        caught: how often each rank was caught before (not changed here).
        suspected: how often each rank was a suspect never told apart (not changed here).
        can_shrink_by: how many workers the run may lose and go on (an elastic run's world
            size minus ``min_workers``; 0 otherwise).
    """
    suspects = tuple(mismatch.suspects)
    culprits = suspects if mismatch.named else ()
    twice = tuple(r for r in culprits if caught[r] + 1 >= 2)
    again = tuple(r for r in suspects if not mismatch.named and suspected[r] + 1 >= 2)
    where = _where(suspects, hosts)
    if again:
        action = "fail"
        twice = again
        reason = (
            f"replica check at step {mismatch.step}: one of {_where(again, hosts)} corrupted its "
            "state again, and two replicas cannot tell which (silent data corruption on one of "
            "those devices); the run stops (replace them, or run with three or more replicas "
            "to name the device, then run it again to resume)"
        )
    elif twice and len(twice) <= can_shrink_by:
        action = "exclude"
        reason = (
            f"{_where(twice, hosts)} corrupted its state a second time (replica check at step "
            f"{mismatch.step}); restarting without it"
        )
    elif twice:
        action = "fail"
        reason = (
            f"{_where(twice, hosts)} corrupted its state a second time (replica check at step "
            f"{mismatch.step}): silent data corruption on that device; the run stops (replace "
            "the host or device, then run it again to resume)"
        )
    else:
        action = "rollback"
        who = where if mismatch.named else f"one of {where} (two replicas: named by the re-run)"
        reason = (
            f"silent data corruption at step {mismatch.step}: {who} held other bits than "
            f"its replicas; rolling back to the newest checkpoint that passed a check"
        )
    record = ReplicaMismatchEvent(
        step=mismatch.step,
        check=mismatch.check,
        ranks=list(suspects),
        hosts=[hosts.get(r, "?") for r in suspects],
        action=action,
        named=mismatch.named,
        fingerprints={str(r): f"{v:016x}" for r, v in sorted(mismatch.fingerprints.items())},
    )
    recheck = (
        None if mismatch.named else Recheck(mismatch.step, dict(mismatch.fingerprints), dict(hosts))
    )
    return IntegrityDecision(
        action=action,
        reason=reason,
        culprits=culprits,
        excluded=twice,
        clean_round=mismatch.clean_round,
        recheck=recheck,
        effects=[Write(record), Say(reason, warn=True)],
    )


def named_by_rerun(
    recheck: Recheck, verified: IntegrityVerified
) -> tuple[tuple[int, ...], list[Effect]]:
    """The suspects of ``recheck`` the re-run names: those whose fingerprint at its step was
    not the re-run's, when another suspect's was (``action: "named"``); when none of them had
    the true value the corruption had spread to every replica and nobody is named
    (``action: "unresolved"``). Returns the named ranks and the event."""
    differ = sorted(r for r, v in recheck.fingerprints.items() if v != verified.fingerprint)
    if not differ:
        return (), []
    named = len(differ) < len(recheck.fingerprints)
    ranks = differ if named else sorted(recheck.fingerprints)
    where = _where(tuple(ranks), recheck.hosts)
    text = (
        f"the re-run reached step {recheck.step} with fingerprint {verified.fingerprint:016x}: "
        + (
            f"{where} had other bits there (silent data corruption)"
            if named
            else f"none of {where} had it (the corrupted values had spread to every replica "
            "through the gradients): two replicas cannot tell which device corrupted them"
        )
    )
    culprits = tuple(ranks) if named else ()
    record = ReplicaMismatchEvent(
        step=recheck.step,
        check="replica",
        ranks=ranks,
        hosts=[recheck.hosts.get(r, "?") for r in ranks],
        action="named" if named else "unresolved",
        named=named,
        fingerprints={str(r): f"{v:016x}" for r, v in sorted(recheck.fingerprints.items())},
    )
    return culprits, [Write(record), Say(text, warn=True)]
