"""SLURM: requeue a preempted job, and name its run so that the requeued job resumes it.

A SLURM job that is preempted (a higher-priority job needs its nodes, ``--signal`` before the
time limit) gets a signal first; ringtrain's driver takes SIGTERM and SIGUSR1 as a preemption
notice (:mod:`ringtrain.preemption`), the workers save their ``TrainState`` at one agreed step
and the run ends ``PREEMPTED``. Under SLURM the driver then asks for the job to be queued again,
``scontrol requeue $SLURM_JOB_ID``, and the requeued job (same ``SLURM_JOB_ID``,
``SLURM_RESTART_COUNT`` one higher) runs the same script: its run has the same name (the
default name under SLURM is ``{entrypoint}_slurm{SLURM_JOB_ID}``, see :func:`default_run_name`)
and the same ``storage_path``, so ``fit()`` (or ``ringtrain run``) resumes it from the checkpoint
of the stop step, with no user code.

The requeue happens only when all of these hold (:func:`requeue_decision`):

- the run ended ``PREEMPTED`` (not FINISHED, ERRORED, STOPPED or ABORTED);
- ``SLURM_JOB_ID`` is set (the driver runs inside a SLURM job);
- the user did not opt out (``FailureConfig(slurm_requeue=False)``).

A job submitted with ``--no-requeue`` (or a cluster with ``JobRequeue=0``) makes ``scontrol
requeue`` fail: ringtrain then logs one message with scontrol's answer, and the run still ends
``PREEMPTED`` (resume it by hand with ``ringtrain run --resume RUN_DIR``).

Like :mod:`ringtrain.cluster.env` (the ranks of ``srun`` tasks), this module reads ``SLURM_*``
variables: these are job-level facts of the driver's own job, not rank information.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "RequeueOutcome",
    "SlurmJob",
    "default_run_name",
    "requeue",
    "requeue_after_preemption",
    "requeue_decision",
]

logger = logging.getLogger("ringtrain")

SCONTROL_TIMEOUT_S = 30.0
"""How long ``scontrol requeue`` may take (seconds): a controller under load answers slowly."""


@dataclass(frozen=True)
class SlurmJob:
    """The SLURM job the driver runs in.

    Attributes:
        job_id: ``SLURM_JOB_ID`` (kept when the job is requeued; an array task has its own).
        restart_count: ``SLURM_RESTART_COUNT``: how many times the job was requeued (0 for the
            first run).
    """

    job_id: str
    restart_count: int = 0

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> SlurmJob | None:
        """The job from ``environ`` (default ``os.environ``); ``None`` outside SLURM."""
        env = os.environ if environ is None else environ
        job_id = env.get("SLURM_JOB_ID", "").strip()
        if not job_id:
            return None
        try:
            restarts = max(0, int(env.get("SLURM_RESTART_COUNT", "0") or 0))
        except ValueError:
            restarts = 0
        return cls(job_id=job_id, restart_count=restarts)


def default_run_name(entrypoint: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The default run name inside a SLURM job, ``{entrypoint}_slurm{SLURM_JOB_ID}``: the same
    for the requeued job, so that it resumes the run; ``None`` outside SLURM (the caller uses its
    timestamped name). ``entrypoint`` must already be a safe directory name."""
    job = SlurmJob.detect(environ)
    if job is None:
        return None
    safe_id = "".join(c if c.isalnum() or c in "_.-" else "_" for c in job.job_id)
    return f"{entrypoint}_slurm{safe_id}"


@dataclass(frozen=True)
class RequeueOutcome:
    """What :func:`requeue_after_preemption` did.

    Attributes:
        requeued: ``scontrol requeue`` succeeded.
        attempted: ``scontrol requeue`` was run (it may have failed).
        message: one line for the log and the user: why not, what was done, or what failed.
    """

    requeued: bool
    attempted: bool
    message: str


def requeue_decision(
    status: str, *, enabled: bool = True, environ: Mapping[str, str] | None = None
) -> tuple[SlurmJob | None, str]:
    """Whether a run that ended with ``status`` should requeue its SLURM job.

    Returns:
        ``(job, why)``: ``job`` is the job to requeue, or ``None`` with ``why`` saying why not.
    """
    if status != "PREEMPTED":
        return None, f"the run ended {status}, not PREEMPTED: no requeue"
    job = SlurmJob.detect(environ)
    if job is None:
        return None, "not inside a SLURM job (SLURM_JOB_ID is not set): no requeue"
    if not enabled:
        return None, (
            f"SLURM job {job.job_id} not requeued: FailureConfig(slurm_requeue=False); resume "
            "the run with the same name (or `ringtrain run --resume RUN_DIR`)"
        )
    return job, f"requeueing SLURM job {job.job_id}"


def requeue(
    job: SlurmJob, *, scontrol: str = "scontrol", timeout_s: float = SCONTROL_TIMEOUT_S
) -> RequeueOutcome:
    """Run ``scontrol requeue JOB_ID``.

    Args:
        job: the job to requeue.
        scontrol: the command (looked up on ``PATH``).
        timeout_s: how long to wait for it (seconds).

    Returns:
        The outcome; never raises (a missing ``scontrol``, a refusal or a timeout is said in
        ``message``).
    """
    argv: Sequence[str] = (scontrol, "requeue", job.job_id)
    if shutil.which(scontrol) is None:
        return RequeueOutcome(
            False, False, f"SLURM job {job.job_id} not requeued: {scontrol!r} is not on PATH"
        )
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return RequeueOutcome(
            False, True, f"SLURM job {job.job_id} not requeued: `{' '.join(argv)}` failed: {exc}"
        )
    if done.returncode != 0:
        said = " ".join((done.stderr or done.stdout or "").split())[:500] or "no message"
        return RequeueOutcome(
            False,
            True,
            f"SLURM job {job.job_id} not requeued: `{' '.join(argv)}` exited with status "
            f"{done.returncode} ({said}); was the job submitted with --no-requeue? The run is "
            "PREEMPTED: resume it with the same name or `ringtrain run --resume RUN_DIR`",
        )
    again = f" (requeue {job.restart_count + 1})" if job.restart_count else ""
    return RequeueOutcome(
        True,
        True,
        f"requeued SLURM job {job.job_id}{again}: the requeued job resumes the run from the "
        "checkpoint of the stop step",
    )


def requeue_after_preemption(
    status: str,
    *,
    enabled: bool = True,
    environ: Mapping[str, str] | None = None,
    scontrol: str = "scontrol",
) -> RequeueOutcome:
    """After a run ended: requeue its SLURM job when :func:`requeue_decision` says so, and log
    what happened (one line; a warning when ``scontrol`` failed).

    Args:
        status: the run's final status (``Result.status``).
        enabled: ``FailureConfig.slurm_requeue``.
        environ: the environment to read ``SLURM_*`` from (default ``os.environ``).
        scontrol: the ``scontrol`` command.

    Returns:
        The outcome (never raises).
    """
    job, why = requeue_decision(status, enabled=enabled, environ=environ)
    if job is None:
        if status == "PREEMPTED" and "SLURM_JOB_ID" in why:
            logger.debug(why)
        elif status == "PREEMPTED":
            logger.info(why)
        return RequeueOutcome(False, False, why)
    outcome = requeue(job, scontrol=scontrol)
    if outcome.requeued:
        logger.info(outcome.message)
    else:
        logger.warning(outcome.message)
    return outcome
