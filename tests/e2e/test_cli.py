"""The `ringtrain` command, run as a user runs it (a subprocess of the installed console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from support import wait_until

RINGTRAIN = shutil.which("ringtrain") or os.path.join(os.path.dirname(sys.executable), "ringtrain")

TORCHRUN_STYLE = textwrap.dedent(
    """
    import os, sys
    import torch, torch.distributed as dist
    import ringtrain as rt

    dist.init_process_group("gloo")          # plain torch: reads the torchrun variables
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    ctx = rt.get_context()
    assert ctx.world_rank == int(os.environ["RANK"])
    assert ctx.world_size == int(os.environ["WORLD_SIZE"])
    assert os.environ["LOCAL_WORLD_SIZE"] == os.environ["WORLD_SIZE"]
    rt.report({"sum": t.item(), "args": " ".join(sys.argv[1:]), "rank": ctx.world_rank})
    print(f"hello from rank {ctx.world_rank}")
    dist.destroy_process_group()
    """
)

TRAINER_SCRIPT = textwrap.dedent(
    """
    import ringtrain as rt, torch, torch.distributed as dist

    def train_fn(config):
        ctx = rt.get_context()
        t = torch.ones(1)
        dist.all_reduce(t)
        rt.report({"world": t.item(), "rank": ctx.world_rank, "lr": config["lr"]})

    if __name__ == "__main__":
        rt.Trainer(train_fn, rt.ScalingConfig(num_workers=5), train_loop_config={"lr": 0.1}).fit()
    """
)

FAILING = textwrap.dedent(
    """
    import ringtrain as rt
    ctx = rt.get_context()
    rt.report({"x": 1})
    if ctx.world_rank == 1:
        raise KeyError("missing column 'label'")
    """
)

KILLED_ONCE = textwrap.dedent(
    """
    import os, torch
    import ringtrain as rt
    model = rt.prepare_model(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = rt.TrainState(model=model, optimizer=opt)
    state.restore()
    while state.step < 6:
        loss = model(torch.randn(8, 4)).sum()
        opt.zero_grad(); loss.backward(); opt.step()
        state.step += 1
        if state.step == 4 and rt.get_context().world_rank == 1 and not os.path.exists("killed"):
            open("killed", "w").close()
            os.kill(os.getpid(), 9)
        rt.report({"loss": loss.item(), "step": state.step}, checkpoint=state)
    """
)


def ringtrain(*args, cwd, timeout=120):
    return subprocess.run(
        [RINGTRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("flag", ["-n", "-np"])
def test_run_torchrun_style_script(tmp_path, flag):
    script = _write(tmp_path, "job.py", TORCHRUN_STYLE)
    proc = ringtrain(
        "run",
        flag,
        "2",
        "--name",
        "job",
        "--progress",
        "plain",
        script,
        "--lr",
        "0.1",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "(rank 0) hello from rank 0" in proc.stdout
    assert "(rank 1) hello from rank 1" in proc.stdout
    result = json.loads((tmp_path / "runs" / "job" / "result.json").read_text())
    assert result["status"] == "FINISHED"
    assert result["metrics"] == {"sum": 3.0, "args": "--lr 0.1", "rank": 0}
    assert result["metrics_per_rank"]["1"]["rank"] == 1


def test_run_script_that_calls_trainer_runs_in_place(tmp_path):
    script = _write(tmp_path, "trainer_job.py", TRAINER_SCRIPT)
    proc = ringtrain("run", "-n", "2", "--name", "tj", "--progress", "plain", script, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    result = json.loads((tmp_path / "runs" / "tj" / "result.json").read_text())
    # ringtrain run's 2 workers, not the script's num_workers=5
    assert result["metrics"] == {"world": 2.0, "rank": 0, "lr": 0.1}


def test_run_failure_exit_code_and_message(tmp_path):
    script = _write(tmp_path, "bad.py", FAILING)
    proc = ringtrain("run", "-n", "2", "--name", "bad", "--progress", "plain", script, cwd=tmp_path)
    assert proc.returncode == 1
    assert "rank 1 raised KeyError" in proc.stderr
    assert "missing column 'label'" in proc.stderr


def test_bad_input_is_rejected_before_anything_starts(tmp_path):
    proc = ringtrain("run", "-n", "0", "x.py", cwd=tmp_path)
    assert proc.returncode == 2 and "must be >= 1" in proc.stderr
    proc = ringtrain("run", "-n", "2", "missing.py", cwd=tmp_path)
    assert proc.returncode == 2 and "is not a file" in proc.stderr
    proc = ringtrain("run", "--name", "a/b", _write(tmp_path, "ok.py", "pass\n"), cwd=tmp_path)
    assert proc.returncode == 2 and "--name must be" in proc.stderr  # the flag, for the CLI
    proc = ringtrain("run", "--worker-timeout", "-1", "ok.py", cwd=tmp_path)
    assert proc.returncode == 2 and "--worker-timeout must be" in proc.stderr
    proc = ringtrain("run", cwd=tmp_path)
    assert proc.returncode == 2 and "give SCRIPT to run, or --resume RUN_DIR" in proc.stderr
    proc = ringtrain("run", "--resume", str(tmp_path / "nothing"), cwd=tmp_path)
    assert proc.returncode == 2 and "not a run directory (no config.json)" in proc.stderr
    proc = ringtrain("run", "--resume", str(tmp_path), "ok.py", cwd=tmp_path)
    assert proc.returncode == 2 and "give no SCRIPT" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_help_texts(tmp_path):
    top = ringtrain("--help", cwd=tmp_path)
    assert top.returncode == 0
    for word in ("run", "ls", "show", "Trainer"):
        assert word in top.stdout
    run = ringtrain("run", "--help", cwd=tmp_path)
    for word in (
        "--num-workers",
        "MASTER_ADDR",
        "--storage-path",
        "--max-failures",
        "--resume",
        "--worker-timeout",
        "Example",
    ):
        assert word in run.stdout


def test_ls_and_show_on_a_real_run(tmp_path):
    script = _write(tmp_path, "job.py", TORCHRUN_STYLE)
    assert (
        ringtrain(
            "run", "-n", "2", "--name", "seen", "--progress", "off", script, cwd=tmp_path
        ).returncode
        == 0
    )
    ls = ringtrain("ls", "runs", cwd=tmp_path)
    assert ls.returncode == 0, ls.stderr
    assert "seen" in ls.stdout and "FINISHED" in ls.stdout
    show = ringtrain("show", "runs/seen", cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "sum" in show.stdout and "3" in show.stdout
    missing = ringtrain("ls", "nowhere", cwd=tmp_path)
    assert missing.returncode == 1 and "nowhere" in missing.stderr
    # A table bigger than the pipe it goes to, whose write end is non-blocking (as some
    # terminals and CI runners hand it over) and whose reader is not reading yet: every byte
    # still arrives (before, all past the first 4 KiB was lost, silently: exit status 0).
    many = tmp_path / "many"
    for i in range(200):  # ~13 KB of table
        shutil.copytree(tmp_path / "runs" / "seen", many / f"seen{i:03d}")
    table = _read_through_a_full_non_blocking_pipe([RINGTRAIN, "ls", str(many)], tmp_path)
    assert all(f"seen{i:03d}" in table for i in range(200)), table[-2000:]


def _read_through_a_full_non_blocking_pipe(cmd: list[str], cwd) -> str:
    """Run ``cmd`` with its stdout a non-blocking pipe of one page that nobody reads until it is
    full (or the command ended); then read everything. Fails if the command fails."""
    import fcntl
    import select

    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)
    os.set_blocking(w, False)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=w, stderr=subprocess.PIPE)

    def full() -> bool:  # less room than one atomic write (PIPE_BUF): full for any writer
        return not select.select([], [w], [], 0)[1]

    assert wait_until(lambda: full() or proc.poll() is not None, timeout_s=60)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as out:
        while chunk := out.read(65536):
            chunks.append(chunk)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    return b"".join(chunks).decode()


CHECKPOINTING = textwrap.dedent(
    """
    import os, sys, tempfile
    import ringtrain as rt
    ctx = rt.get_context()
    for i, acc in enumerate([0.2, 0.9, 0.5, 0.1]):
        ckpt = None
        if ctx.world_rank == 0:
            d = tempfile.mkdtemp()
            open(os.path.join(d, "w.txt"), "w").write(str(i))
            ckpt = rt.Checkpoint.from_directory(d)
        rt.report({"acc": acc}, checkpoint=ckpt)
    """
)


def test_run_checkpoint_retention_flags(tmp_path):
    script = _write(tmp_path, "ckpt.py", CHECKPOINTING)
    proc = ringtrain(
        "run",
        "-n",
        "2",
        "--name",
        "keep",
        "--progress",
        "off",
        "--num-to-keep",
        "1",
        "--checkpoint-score-attribute",
        "acc",
        "--checkpoint-score-order",
        "max",
        script,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    kept = sorted(p.name for p in (tmp_path / "runs" / "keep").glob("checkpoint_*"))
    assert kept == ["checkpoint_000001", "checkpoint_000003"]  # best (0.9) and latest


@pytest.mark.parametrize("as_command", [True, False])
def test_the_command_freezes_the_gc_before_its_process_exits(tmp_path, as_command):
    """``ringtrain`` itself (``main()`` with no argv: its process exits next) freezes the GC's
    generations, so the interpreter's shutdown does not walk torch's objects again and again;
    ``main(argv)`` called by a program that goes on does not."""
    code = textwrap.dedent(
        """
        import atexit, gc, sys
        import torch.distributed  # what a `ringtrain run` driver holds at exit
        from ringtrain.cli import main
        atexit.register(lambda: print("frozen", gc.get_freeze_count() > 0, flush=True))
        args = ["ls", sys.argv[2]]
        if sys.argv[1] == "command":
            sys.argv = ["ringtrain", *args]
            status = main()
        else:
            status = main(args)
        print("status", status, flush=True)
        """
    )
    mode = "command" if as_command else "library"
    out = subprocess.run(
        [sys.executable, "-c", code, mode, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split("\n")
    assert "status 0" in out, out
    assert f"frozen {as_command}" in out, out


def test_the_run_drivers_process_never_imports_torch(tmp_path):
    """``ringtrain run``'s driver starts workers, hosts no torch object and writes TensorBoard
    scalars: it never imports torch (~2 CPU-seconds and ~180 MiB less per run). Its store is
    forked from the warm pool's zygote, and the TensorBoard sink imports tensorboardX without
    torch. A restart after a SIGKILL at W=3 and checkpoints included; the run's scalars are in
    its event file."""
    script = _write(tmp_path, "exact.py", KILLED_ONCE)
    code = textwrap.dedent(
        """
        import sys
        from ringtrain.cli import main
        status = main(sys.argv[1:])
        print("status", status, "torch", "torch" in sys.modules, flush=True)
        """
    )
    args = ["run", "-n", "3", "--max-failures", "1", "--name", "lean", "--progress", "plain"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "status 0 torch False" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restarting: rank 1 was killed by SIGKILL" in proc.stdout + proc.stderr
    result = json.loads((tmp_path / "runs" / "lean" / "result.json").read_text())
    assert result["status"] == "FINISHED" and result["metrics"]["step"] == 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "runs" / "lean" / "tensorboard"))
    events.Reload()
    # (a step before the kill is logged twice when its checkpoint was still being written)
    assert sorted({e.step for e in events.Scalars("metrics/loss")}) == [1, 2, 3, 4, 5, 6]
