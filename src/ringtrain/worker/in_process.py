"""An ``rt.Trainer(...).fit()`` that runs in a worker another launcher started (``ringtrain
run SCRIPT``, torchrun, SLURM): the train function runs in this process as its rank. Two things
connect it to the run ringtrain's driver already started:

* :func:`send_run_settings`: rank 0 sends the script's ``RunConfig`` to the driver, which
  adopts its retention and ``max_failures`` and says what does not apply
  (:mod:`ringtrain.controller.script_settings`);
* :func:`latest_published`: the ``Result.checkpoint`` the script gets is the run's newest
  published checkpoint once this rank's last write is published (not the one the run was
  restored from, nor none).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from ringtrain.checkpoint.checkpoint import Checkpoint
from ringtrain.checkpoint.layout import join, parse_round
from ringtrain.wire.channel import RunSettings

if TYPE_CHECKING:
    from ringtrain.config import RunConfig
    from ringtrain.worker.session import Session

PUBLISH_WAIT_S = 120.0
"""How long :func:`latest_published` waits for the driver to publish this rank's last
checkpoint (a write that failed is discarded sooner: the previous checkpoint is then the
latest)."""


def send_run_settings(session: Session, run_config: RunConfig) -> None:
    """On rank 0 of a run with a driver, send ``run_config`` to it (its callbacks as their
    ``repr`` and its notice sources dropped: objects of this process)."""
    if session.channel is None or session.context.world_rank != 0:
        return
    failure = dataclasses.replace(run_config.failure_config, notice_sources=())
    plain = dataclasses.replace(
        run_config,
        callbacks=[],
        failure_config=failure,
        signing_key=None,
        signing_key_file=None,
    )
    session.channel.send(
        RunSettings(
            rank=0,
            run_config=plain,
            callbacks=tuple(repr(c) for c in run_config.callbacks),
            notice_sources=tuple(repr(s) for s in run_config.failure_config.notice_sources),
        )
    )


def latest_published(session: Session, wait_s: float = PUBLISH_WAIT_S) -> Checkpoint | None:
    """The run's newest published checkpoint once none of the rounds this rank reported is
    still being written (its background write finished, and the driver published or discarded
    every staged round); ``session.latest_checkpoint`` without a run directory.

    Args:
        session: this worker's session.
        wait_s: at most this long for the driver to publish (then the newest there is).
    """
    storage = session.run_storage()
    if storage is None:
        return session.latest_checkpoint
    fs, run_path = storage
    session.wait_for_checkpoint(wait_s)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(run_path, detail=False)]
        except FileNotFoundError:
            names = []
        staged = [parse_round(n[: -len(".tmp")]) for n in names if n.endswith(".tmp")]
        pending = [r for r in staged if r is not None and r < session.next_round]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    rounds = [(r, n) for n in names if (r := parse_round(n)) is not None]
    if not rounds:
        return session.latest_checkpoint
    _, newest = max(rounds)
    return Checkpoint(join(fs, run_path, newest), fs)
