"""A script's own ``RunConfig`` under ``ringtrain run``: what the driver adopts, and what it says.

``ringtrain run SCRIPT`` starts the workers before the script runs; a script that calls
``rt.Trainer(..., run_config=...).fit()`` then runs its train function in-process on each
rank, and rank 0 sends its ``RunConfig`` (:class:`~ringtrain.wire.channel.RunSettings`). The
driver can still apply the checkpoint retention (``num_to_keep``, the score attribute and
order: retention runs at each publication) and ``max_failures`` (read at each failure): a
setting the command line left at its default takes the script's value; one the command line
set keeps its value, and the display says that it overrides the script's. The run directory
(``name``, ``storage_path``), the callbacks and the display were fixed when the run started:
the display says that they do not apply, and how to set them. :func:`adopt` decides; the
controller acts (``controller/events.py``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from ringtrain.config import CheckpointConfig, FailureConfig, RunConfig
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
