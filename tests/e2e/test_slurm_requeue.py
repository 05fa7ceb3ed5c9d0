"""SLURM requeue after a preemption (issue 19): a fake ``scontrol`` on PATH records its arguments.

The decision (which statuses requeue, the opt-out, a failing scontrol) is checked on the real
``scontrol`` subprocess path of :mod:`ringtrain.cluster.slurm`; one real job checks the whole chain
through ``run_workers``: PREEMPTED, requeued once, and the same script run again (its default
name is the job's) resumes and FINISHES without a second requeue.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import ringtrain as rt
import workloads
from ringtrain.cluster import slurm
from ringtrain.preemption import FileNotice
from ringtrain.trainer import default_run_name
from support import read_jsonl_dir

JOB = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}


def _fake_scontrol(bin_dir: Path, log: Path, *, status: int = 0, say: str = "") -> Path:
    """An ``scontrol`` that appends its arguments to ``log`` and exits with ``status``."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n' + (f"echo '{say}' >&2\n" if say else "") + f"exit {status}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """(install, calls): ``install(status=0, say="")`` puts a fake scontrol first on PATH;
    ``calls()`` lists the argument lines it was called with."""
    log = tmp_path / "scontrol.log"

    def install(status: int = 0, say: str = "") -> None:
        _fake_scontrol(tmp_path / "bin", log, status=status, say=say)
        monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")

    def calls() -> list[str]:
        return log.read_text().splitlines() if log.exists() else []

    return install, calls


def test_a_preempted_run_requeues_its_job(scontrol):
    install, calls = scontrol
    install()
    outcome = slurm.requeue_after_preemption("PREEMPTED", environ=JOB)
    assert calls() == ["requeue 4242"]
    assert outcome.requeued and outcome.attempted
    assert "requeued SLURM job 4242" in outcome.message
    again = slurm.requeue_after_preemption("PREEMPTED", environ={**JOB, "SLURM_RESTART_COUNT": "2"})
    assert again.requeued and "(requeue 3)" in again.message


@pytest.mark.parametrize("status", ["FINISHED", "ERRORED", "STOPPED", "ABORTED"])
def test_no_requeue_unless_preempted(scontrol, status):
    install, calls = scontrol
    install()
    outcome = slurm.requeue_after_preemption(status, environ=JOB)
    assert calls() == []
    assert not outcome.attempted and f"ended {status}" in outcome.message


def test_no_requeue_when_the_user_opted_out_or_outside_slurm(scontrol):
    install, calls = scontrol
    install()
    out = slurm.requeue_after_preemption("PREEMPTED", enabled=False, environ=JOB)
    assert not out.attempted and "slurm_requeue=False" in out.message
    out = slurm.requeue_after_preemption("PREEMPTED", environ={"PATH": "/bin"})
    assert not out.attempted and "SLURM_JOB_ID" in out.message
    assert calls() == []
    with pytest.raises(TypeError, match="slurm_requeue must be True or False"):
        rt.FailureConfig(slurm_requeue="no")  # type: ignore[arg-type]


def test_a_failing_scontrol_says_why_once_and_the_run_stays_preempted(scontrol):
    install, calls = scontrol
    install(status=1, say="slurm_requeue error: Requested operation is presently disabled")
    outcome = slurm.requeue_after_preemption("PREEMPTED", environ=JOB)
    assert calls() == ["requeue 4242"]
    assert outcome.attempted and not outcome.requeued
    assert outcome.message.count("\n") == 0
    assert "exited with status 1" in outcome.message
    assert "Requested operation is presently disabled" in outcome.message
    assert "--no-requeue" in outcome.message and "--resume" in outcome.message


def test_no_scontrol_on_path_is_said(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    outcome = slurm.requeue_after_preemption("PREEMPTED", environ=JOB)
    assert not outcome.requeued and "'scontrol' is not on PATH" in outcome.message


def test_the_default_run_name_is_the_jobs_so_a_requeued_job_resumes(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    first = default_run_name("train")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # the requeued job: same id
    assert default_run_name("train") == first == "train_slurm4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    assert default_run_name("train").startswith("train_2")  # a timestamp outside SLURM


@pytest.mark.timeout(300)
def test_a_preempted_run_requeues_and_the_requeued_job_resumes_it(scontrol, tmp_path, monkeypatch):
    """The whole chain: a notice ends the run PREEMPTED inside a SLURM job, the job is requeued
    once, and the "requeued job" (the same script: same default name) resumes it to the end."""
    install, calls = scontrol
    install()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    log, flag = tmp_path / "log", tmp_path / "notice"
    log.mkdir()
    loop = {"epochs": 1, "log": str(log), "out": str(tmp_path / "out.pt"), "batch_size": 6}
    loop.update(first_world=2, notice_step=4, notice_file=str(flag))

    def job(sources=()):  # the batch script: no run name, the default one
        return rt.Trainer(
            workloads.elastic_fn,
            rt.ScalingConfig(num_workers=2),
            rt.RunConfig(
                storage_path=str(tmp_path / "runs"),
                progress="off",
                failure_config=rt.FailureConfig(notice_sources=list(sources)),
            ),
            train_loop_config={
                **loop,
                "first_world": 2,
                "notice_step": 4,
                "notice_file": str(flag),
            },
        ).fit()

    first = job([FileNotice(flag, interval_s=0.1)])
    assert first.status == "PREEMPTED" and calls() == ["requeue 4242"]
    assert Path(first.path).name == "elastic_fn_slurm4242"
    stopped = max(r["step"] for r in read_jsonl_dir(log))
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    again = job()
    assert again.status == "FINISHED" and again.path == first.path
    assert calls() == ["requeue 4242"]  # a finished run does not requeue
    steps = sorted(r["step"] for r in read_jsonl_dir(log) if r["rank"] == 0)
    assert steps == list(range(1, 11))  # resumed after the stop step: none lost, none repeated
    assert stopped < 10
