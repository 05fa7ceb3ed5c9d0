"""Helpers shared by the test tiers (import them as ``from support import ...``).

``tests/`` is on ``sys.path`` in every tier (``tests/conftest.py`` lives there), so a test module
of any tier, and a worker process that unpickles a test's train function, can import this module.
Nothing here starts a process: the unit tier may import it too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ringtrain as rt

# ---------------------------------------------------------------- processes, from /proc


def _live_parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every live (non-zombie) process, from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry)] = int(fields[1])
    return parents


def child_pids(pid: int | None = None) -> set[int]:
    """Live (non-zombie) direct children of ``pid`` (default: this process), from /proc."""
    parent = os.getpid() if pid is None else pid
    return {child for child, ppid in _live_parents().items() if ppid == parent}


def descendant_pids(pid: int | None = None) -> set[int]:
    """Live (non-zombie) descendants of ``pid`` (default: this process): its children, theirs,
    and so on, from /proc (a process that was re-parented away, a daemon, is not one)."""
    children: dict[int, list[int]] = {}
    for child, ppid in _live_parents().items():
        children.setdefault(ppid, []).append(child)
    found: set[int] = set()
    todo = [os.getpid() if pid is None else pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def catches_signal(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (its ``SigCgt`` mask in
    /proc/PID/status), so that sending it cannot kill it; False if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def dump_worker_stacks(pid: int | None = None) -> list[int]:
    """Send ringtrain's stack-dump signal (``SIGUSR2``) to every descendant of ``pid`` (default:
    this process) that is a ringtrain process catching it (a worker: ``faulthandler``); each
    prints its threads' stacks on its stderr, which its driver forwards. Processes that do not
    catch the signal (zygotes, stores, reapers, Ray's own) are left alone: it would end them.

    Returns:
        the pids signalled.
    """
    signalled = []
    for child in sorted(descendant_pids(pid)):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if b"ringtrain" not in cmdline or not catches_signal(child, signal.SIGUSR2):
            continue
        try:
            os.kill(child, signal.SIGUSR2)
        except OSError:
            continue
        signalled.append(child)
    return signalled


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def pids_with_environ(needle: bytes, *, whole_entry: bool = False) -> list[int]:
    """Live (non-zombie) processes whose environment contains ``needle`` (with ``whole_entry``,
    as one whole ``NAME=value`` entry), from ``/proc/*/environ``; sorted."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        hit = needle in environ.split(b"\0") if whole_entry else needle in environ
        if hit and pid_alive(int(entry)):
            found.append(int(entry))
    return sorted(found)


def wait_until(
    predicate: Callable[[], Any], timeout_s: float = 20.0, interval_s: float = 0.05
) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` (seconds) passed; its last value.
    Timeouts are generous bounds for a loaded machine, never a measure of speed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


# ---------------------------------------------------------------- hostile pickles


def touch_marker(path: str) -> None:
    with open(path, "w") as f:
        f.write("code ran")


class Poisoned:
    """Unpickling this calls ``touch_marker(marker)``: what a malicious file would do (the test
    then checks that ``marker`` does not exist)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[[str], None], tuple[str]]:
        return (touch_marker, (self.marker,))


# ---------------------------------------------------------------- run directories and results


def read_events(run_path: str | os.PathLike[str], kind: str | None = None) -> list[dict]:
    """The records of ``<run_path>/events.jsonl`` (only those of type ``kind`` if given)."""
    with open(Path(run_path) / "events.jsonl") as f:
        events = [json.loads(line) for line in f]
    return [e for e in events if kind is None or e["type"] == kind]


def read_jsonl_dir(log_dir: Path) -> list[dict]:
    """Every record of every ``*.jsonl`` file in ``log_dir`` (files in name order): the per-rank
    logs the workloads write."""
    return [json.loads(line) for f in sorted(log_dir.glob("*.jsonl")) for line in f.open()]


def assert_bit_identical(a: dict, b: dict) -> None:
    """Two final states of ``workloads.exact_fn`` (step, parameters, SGD momentum) are equal,
    tensor by tensor with ``torch.equal``."""
    assert a["step"] == b["step"]
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"parameter {k} differs"
    sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
    assert sa.keys() == sb.keys()
    for i in sa:
        assert torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"])


# ---------------------------------------------------------------- one way to run a job

_SCALING = {f.name for f in dataclasses.fields(rt.ScalingConfig)} - {"num_workers"}
_RUN = {f.name for f in dataclasses.fields(rt.RunConfig)} - {"name", "storage_path"}
_FAILURE = {f.name for f in dataclasses.fields(rt.FailureConfig)}
_CHECKPOINT = {f.name for f in dataclasses.fields(rt.CheckpointConfig)}


def job_configs(
    workers: int | tuple[int, int], name: str, storage_path: str, config: Mapping[str, Any]
) -> tuple[rt.ScalingConfig, rt.RunConfig]:
    """``config`` mapped onto the configs: a field of ScalingConfig, RunConfig, FailureConfig or
    CheckpointConfig by its name (``max_failures=2``, ``async_save=False``, ``backend="ray"``,
    ``callbacks=[...]``); ``progress`` defaults to ``"off"``.

    Raises:
        TypeError: for a name that is no field of these configs.
    """
    unknown = set(config) - _SCALING - _RUN - _FAILURE - _CHECKPOINT
    if unknown:
        raise TypeError(
            f"run_job: {sorted(unknown)} is no field of ScalingConfig, RunConfig, FailureConfig "
            "or CheckpointConfig (pass the train function's own settings as train_loop_config)"
        )
    pick = lambda names: {k: v for k, v in config.items() if k in names}
    run = {"progress": "off", **pick(_RUN)}
    if pick(_FAILURE):
        run["failure_config"] = rt.FailureConfig(**pick(_FAILURE))
    if pick(_CHECKPOINT):
        run["checkpoint_config"] = rt.CheckpointConfig(**pick(_CHECKPOINT))
    scaling = rt.ScalingConfig(num_workers=workers, **pick(_SCALING))
    return scaling, rt.RunConfig(name=name, storage_path=storage_path, **run)


def run_job(
    train_fn: Callable[..., Any],
    workers: int | tuple[int, int] = 2,
    *,
    storage_path: str | os.PathLike[str],
    name: str = "run",
    train_loop_config: dict[str, Any] | None = None,
    restore_from: str | None = None,
    **config: Any,
) -> rt.Result:
    """Run ``train_fn`` on ``workers`` real worker processes and return the Result.

    Args:
        train_fn: a module-level function (workers import it by name).
        workers: ``ScalingConfig.num_workers``: a count, or ``(min, max)`` for an elastic run.
        storage_path: the runs directory; the run is ``<storage_path>/<name>``.
        train_loop_config: the ``config`` dict ``train_fn`` receives.
        restore_from: a run directory to continue with ``Trainer.restore`` (the RunConfig of
            that run is reused; only ScalingConfig fields of ``config`` apply).
        **config: fields of ScalingConfig, RunConfig, FailureConfig, CheckpointConfig by name.
    """
    scaling, run = job_configs(workers, name, str(storage_path), config)
    if restore_from is not None:
        trainer = rt.Trainer.restore(
            restore_from, train_fn, scaling_config=scaling, train_loop_config=train_loop_config
        )
    else:
        trainer = rt.Trainer(train_fn, scaling, run, train_loop_config=train_loop_config)
    return trainer.fit()


def wait_for_checkpoint(run_dir: str, timeout_s: float = 120.0) -> None:
    """Until the driver has published a checkpoint under ``run_dir`` (its manifest exists).

    Raises:
        TimeoutError: none after ``timeout_s`` seconds.
    """
    import glob

    deadline = time.monotonic() + timeout_s
    while not glob.glob(os.path.join(run_dir, "checkpoint_*", "manifest.json")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no checkpoint under {run_dir} after {timeout_s} s")
        time.sleep(0.05)


def run_parity_job(
    train_fn: Callable[..., Any],
    workers: int,
    root: Path,
    name: str,
    mesh: Mapping[str, int],
    config: Mapping[str, Any],
    **job: Any,
) -> tuple[rt.Result, dict[str, str]]:
    """Run ``train_fn`` (a parity workload: it appends ``{"step", "loss"}`` lines to
    ``config["loss_file"]`` and saves the full parameters to ``config["out"]``) on a
    ``rt.ParallelConfig(**mesh)``; both files are ``root/<name>.*``, the run
    ``root/runs/<name>``. ``job``: more :func:`run_job` arguments.

    Returns:
        the Result (no error: asserted) and ``{"loss_file": ..., "out": ...}``.
    """
    files = {"loss_file": str(root / f"{name}.losses.jsonl"), "out": str(root / f"{name}.pt")}
    result = run_job(
        train_fn,
        workers,
        storage_path=root / "runs",
        name=name,
        train_loop_config={**config, **files},
        parallel=rt.ParallelConfig(**mesh),
        **job,
    )
    assert result.error is None, result.error
    return result, files


def step_losses(path: str) -> dict[int, float]:
    """``{step: loss}`` of a parity workload's loss file."""
    with open(path) as f:  # a restarted run appends again: the last line of a step wins
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def assert_matches_reference(
    reference: tuple[list[float], dict[str, torch.Tensor]],
    files: Mapping[str, str],
    name: str,
    steps: range,
    tol: float,
) -> None:
    """The run's losses of ``steps`` and its final parameters are within ``tol`` of the
    one-process ``reference`` (its losses per step from step 1, its parameters)."""
    ref_losses, ref_params = reference
    got = step_losses(files["loss_file"])
    for step in steps:
        assert abs(got[step] - ref_losses[step - 1]) <= tol, (name, step, got, ref_losses)
    full = torch.load(files["out"], weights_only=True)
    assert full.keys() == ref_params.keys()  # the stages keep the model's parameter names
    for key, want in ref_params.items():
        torch.testing.assert_close(full[key], want, rtol=0, atol=tol, msg=f"{name}: {key}")


def run_torchrun_style(
    argv: list[str],
    world_size: int,
    *,
    timeout_s: float,
    pythonpath: Sequence[str] = (),
    tries: int = 3,
) -> list[str]:
    """Run ``argv`` as ``world_size`` processes with torchrun's environment (``RANK``,
    ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` on loopback; no ``RINGTRAIN_`` variables) and
    return each rank's stdout, in rank order. Each process must exit 0 within ``timeout_s``
    seconds (a hang is the failure, not slowness; the others are killed).

    The store's port is probed free and then bound by rank 0 a moment later, so another process
    of a busy machine can take it in between (``EADDRINUSE``): then the ranks are started again
    on a fresh port, up to ``tries`` times, as torchrun's own rendezvous retries do.
    """
    import socket
    import subprocess
    import sys

    for attempt in range(tries):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        procs = []
        for rank in range(world_size):
            env = {k: v for k, v in os.environ.items() if not k.startswith("RINGTRAIN_")}
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([*pythonpath, env.get("PYTHONPATH", "")]),
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, *argv],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        outs: list[str] = []
        errors: list[str] = []
        try:
            deadline = time.monotonic() + timeout_s
            for p in procs:
                out, err = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
                outs.append(out)
                errors.append(err if p.returncode else "")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        taken = any("EADDRINUSE" in e for e in errors)
        if taken and attempt + 1 < tries:
            continue
        for rank, err in enumerate(errors):
            assert not err, f"rank {rank} failed:\n{err[-3000:]}"
        return outs
    raise AssertionError("unreachable")
