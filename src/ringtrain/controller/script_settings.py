"""A script's own ``RunConfig`` under ``ringtrain run``: what the driver adopts, and what it says.

``ringtrain run SCRIPT`` starts the workers before the script runs; a script that calls
``rt.Trainer(..., run_config=...).fit()`` then runs its train function in-process on each
rank, and rank 0 sends its ``RunConfig`` (:class:`~ringtrain.wire.channel.RunSettings`). The
driver can still apply the checkpoint retention (``num_to_keep``, the score attribute and
order: retention runs at each publication) and ``max_failures`` (read at each failure): a
setting the command line left at its default takes the script's value; one the command line
set keeps its value, and the display says that it overrides the script's. The run directory
(``name``, ``storage_path``), the callbacks and the display were fixed when the run started:
the display says that they do not apply, and how to set them; so it does for every other
setting the script gives (the display, monitoring, hang and preemption settings: ringtrain
run's own flags set them). :func:`adopt` decides; the controller acts (``controller/events.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from ringtrain.config import CheckpointConfig, FailureConfig, MonitorConfig, RunConfig
from ringtrain.config.run import DEFAULT_STORAGE_PATH

RETENTION = ("num_to_keep", "checkpoint_score_attribute", "checkpoint_score_order")
_FLAGS = {
    "num_to_keep": "--num-to-keep",
    "checkpoint_score_attribute": "--checkpoint-score-attribute",
    "checkpoint_score_order": "--checkpoint-score-order",
    "max_failures": "--max-failures",
}


@dataclass(frozen=True)
class Adoption:
    """What the run uses from now on, and the lines that say so.

    Attributes:
        checkpoint_config: the run's retention settings after adopting the script's.
        max_failures: the run's ``FailureConfig.max_failures`` after adopting the script's.
        notes: one line each: what was adopted, what the command line overrides, what does not
            apply (empty when the script asks for nothing the run does not already do).
    """

    checkpoint_config: CheckpointConfig
    max_failures: int
    notes: list[str] = field(default_factory=list)


def adopt(
    current: CheckpointConfig,
    max_failures: int,
    script: RunConfig,
    *,
    run_name: str,
    run_uri: str,
    callbacks: tuple[str, ...] = (),
    notice_sources: tuple[str, ...] = (),
) -> Adoption:
    """The run's settings once the script's ``RunConfig`` is taken into account.

    Args:
        current: the run's retention settings (the command line's).
        max_failures: the run's ``FailureConfig.max_failures``.
        script: the ``RunConfig`` the script gave its ``rt.Trainer``.
        run_name: the run's name (its directory's).
        run_uri: the run directory.
        callbacks: the ``repr`` of each callback the script's ``RunConfig`` had (the objects
            stay in the worker).
        notice_sources: the same for its ``FailureConfig.notice_sources``.
    """
    taken: dict[str, Any] = {}
    kept: list[str] = []
    pairs = [(f, getattr(current, f), getattr(script.checkpoint_config, f)) for f in RETENTION]
    pairs.append(("max_failures", max_failures, script.failure_config.max_failures))
    defaults = {**{f: getattr(CheckpointConfig(), f) for f in RETENTION}}
    defaults["max_failures"] = FailureConfig().max_failures
    for name, ours, theirs in pairs:
        if theirs == ours or theirs == defaults[name]:
            continue
        if ours == defaults[name]:
            taken[name] = theirs
        else:
            kept.append(f"{_FLAGS[name]} {ours} overrides the script's {name}={theirs!r}")
    notes = []
    if taken:
        what = ", ".join(f"{k}={v!r}" for k, v in taken.items())
        notes.append(f"the script's RunConfig applies: {what}")
    notes += [f"ringtrain run's {line}" for line in kept]
    notes += _not_applied(script, run_name, run_uri, callbacks)
    notes += _not_read(script, notice_sources)
    retention = {k: v for k, v in taken.items() if k in RETENTION}
    return Adoption(
        checkpoint_config=replace(current, **retention),
        max_failures=int(taken.get("max_failures", max_failures)),
        notes=notes,
    )


def _not_applied(
    script: RunConfig, run_name: str, run_uri: str, callbacks: tuple[str, ...]
) -> list[str]:
    """What of ``script`` was fixed when the run started, each with how to set it."""
    notes = []
    named = script.name is not None and script.name != run_name
    elsewhere = script.storage_path != DEFAULT_STORAGE_PATH and os.path.abspath(
        os.path.join(script.storage_path, run_name)
    ) != os.path.abspath(run_uri)
    if named or elsewhere:
        given = ", ".join(
            f"{k}={v!r}"
            for k, v in (("name", script.name), ("storage_path", script.storage_path))
            if (k == "name" and named) or (k == "storage_path" and elsewhere)
        )
        notes.append(
            f"the script's RunConfig({given}) does not apply under ringtrain run: the run "
            f"directory is {run_uri}, chosen before the script ran (give --name / "
            "--storage-path; `python SCRIPT` starts the workers with the script's own)"
        )
    if callbacks:
        notes.append(
            f"the script's RunConfig(callbacks=[{', '.join(callbacks)}]) does not apply under "
            "ringtrain run: callbacks run in the driver, which started before the script did "
            "(run it with `python SCRIPT`)"
        )
    return notes


# Settings of the script's RunConfig the driver fixed when it started (ringtrain run's flags).
_FIXED = (
    ("progress", lambda c: c.progress, "auto", "--progress"),
    ("monitor_config", lambda c: c.monitor_config, MonitorConfig(), ""),
    ("checkpoint_config.async_save", lambda c: c.checkpoint_config.async_save, True, ""),
    (
        "checkpoint_config.from_scratch_if_invalid",
        lambda c: c.checkpoint_config.from_scratch_if_invalid,
        False,
        "--from-scratch-if-invalid",
    ),
    (
        "failure_config.worker_timeout_s",
        lambda c: c.failure_config.worker_timeout_s,
        FailureConfig().worker_timeout_s,
        "--worker-timeout",
    ),
    (
        "failure_config.preemption_grace_s",
        lambda c: c.failure_config.preemption_grace_s,
        FailureConfig().preemption_grace_s,
        "",
    ),
    (
        "failure_config.snapshot_interval_steps",
        lambda c: c.failure_config.snapshot_interval_steps,
        FailureConfig().snapshot_interval_steps,
        "",
    ),
    ("failure_config.slurm_requeue", lambda c: c.failure_config.slurm_requeue, True, ""),
    ("trust_unsigned", lambda c: c.trust_unsigned, False, "--trust-unsigned"),
)


def _not_read(script: RunConfig, notice_sources: tuple[str, ...]) -> list[str]:
    """The script's other settings that differ from their defaults: ringtrain run's apply."""
    given = [
        f"{name}={get(script)!r}" for name, get, default, _ in _FIXED if get(script) != default
    ]
    flags = [flag for _, get, default, flag in _FIXED if flag and get(script) != default]
    if notice_sources:
        given.append(f"failure_config.notice_sources=[{', '.join(notice_sources)}]")
    if not given:
        return []
    how = f" (ringtrain run's {', '.join(flags)})" if flags else ""
    return [
        f"the script's RunConfig({', '.join(given)}) is not read under ringtrain run: the run "
        f"was set up before the script ran, with ringtrain run's settings{how}; `python "
        "SCRIPT` starts the workers with the script's own"
    ]
