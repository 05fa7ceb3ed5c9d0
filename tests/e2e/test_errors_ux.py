"""What a user sees when something goes wrong (issue 21, items 1, 3, 4, 7): the root cause once,
with its source line; follow-on failures folded and counted apart; configuration and usage errors
in one line naming the fix for the interface used (a CLI flag or a Python argument).

The CLI is run as a user runs it (a subprocess of the console script) at a fixed ``COLUMNS=80``.
Only two tests start workers; the rest check errors raised before anything starts.
"""

from __future__ import annotations

import io
import json
import linecache
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import traceback

import pytest

import ringtrain as rt
from ringtrain.cli import for_cli
from ringtrain.launch import local
from ringtrain.launch.worker import install_sources, user_traceback
from ringtrain.trainer import RunNameTaken, finished_note
from ringtrain.wire.payload import pickle_payload, source_lines

RINGTRAIN = shutil.which("ringtrain") or os.path.join(os.path.dirname(sys.executable), "ringtrain")

RAISES = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    def main():
        dist.init_process_group()
        t = torch.ones(1)
        dist.all_reduce(t)
        if dist.get_rank() == 1:
            # Close this rank's connections first, so rank 0's follow-on error (a peer's
            # closed connection) arrives however loaded the machine is.
            dist.destroy_process_group()
            raise ValueError("bad value on rank 1")
        for _ in range(1000):
            dist.all_reduce(t)

    main()
    """
)


def ringtrain(*args, cwd, timeout=240, env=None):
    return subprocess.run(
        [RINGTRAIN, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "COLUMNS": "80", **(env or {})},
    )


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _events(run_dir, kind):
    with open(os.path.join(run_dir, "events.jsonl")) as f:
        return [e for e in map(json.loads, f) if e.get("type", e.get("event")) == kind]


# ------------------------------------------------------------------ with workers


@pytest.mark.timeout(300)
def test_one_exception_is_shown_once_with_follow_ons_folded_and_counted_apart(tmp_path):
    _write(tmp_path, "raises.py", RAISES)
    proc = ringtrain(
        "run", "-n", "2", "--max-failures", "1", "--progress", "plain", "--name", "r",
        "raises.py", cwd=tmp_path,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    # Exactly one traceback: rank 1's own, starting at the user's code, with its source line.
    assert out.count("Traceback (most recent call last)") == 1, out
    assert 'raise ValueError("bad value on rank 1")' in out, out
    assert out.count('raise ValueError("bad value on rank 1")') == 1, out
    assert "runpy" not in out and "launch/worker.py" not in out, out
    assert "Traceback of rank 1:" in out, out
    # Rank 0's gloo error is one folded line, never its traceback; no lone Traceback line.
    assert "rank 0: lost its connection to rank 1 (follow-on)" in out, out
    assert "GLHF" not in out and "Connection closed" not in out, out
    assert not any(line.rstrip().endswith("Traceback (most recent call last):")
                   and line.startswith("(rank") for line in out.splitlines()), out  # fmt: skip
    assert out.count("stopping: rank 1 raised ValueError") == 1, out

    # Counted apart everywhere: Result (result.json), the events, `ringtrain show`.
    run_dir = tmp_path / "runs" / "r"
    result = json.loads((run_dir / "result.json").read_text())
    assert [f["rank"] for f in result["failures"]] == [1, 1]
    assert [f["rank"] for f in result["follow_on_failures"]] == [0, 0]
    assert all(f["follow_on"] for f in result["follow_on_failures"])
    assert "failures (2):" in result["error"]
    failures = _events(run_dir, "failure")
    roots = [e for e in failures if not e.get("follow_on")]
    assert len(roots) == len(result["failures"]) == 2, failures
    show = ringtrain("show", str(run_dir), cwd=tmp_path)
    assert show.returncode == 0, show.stderr
    assert "Failures (2)" in show.stdout, show.stdout


@pytest.mark.timeout(240)
def test_syntax_error_and_python_c_tracebacks(tmp_path):
    # A syntax error in the script: its lines once, no frames of the bootstrap.
    _write(tmp_path, "syn.py", "x = 1\ndef f(:\n    pass\n")
    proc = ringtrain("run", "-n", "2", "--progress", "plain", "syn.py", cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.count("def f(:") == 1, out
    assert out.count("SyntaxError: invalid syntax\n") == 1, out
    assert "Traceback (most recent call last)" not in out, out
    assert "raised the same SyntaxError (follow-on)" in out, out

    # A train function defined in `python -c`: the worker's traceback shows its source line.
    program = textwrap.dedent(
        """
        import ringtrain as rt

        def train():
            raise KeyError("column from python -c")

        try:
            rt.Trainer(train, run_config=rt.RunConfig(storage_path="runs", progress="off")).fit()
        except rt.TrainingFailedError as exc:
            print(exc)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert 'File "<string>", line 5, in train' in proc.stdout, proc.stdout
    assert 'raise KeyError("column from python -c")' in proc.stdout, proc.stdout
    assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ before anything starts


@pytest.mark.timeout(120)
def test_cli_usage_errors_are_one_line_naming_the_flag(tmp_path):
    _write(tmp_path, "train.py", "import sys\nprint(sys.argv)\n")
    marker = tmp_path / "MARKER"
    _write(tmp_path, "perworker.py", f"open({str(marker)!r}, 'w').write('ran')\n")

    proc = ringtrain("run", "train.py", "-n", "2", "--lr", "0.1", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "ringtrain run: ringtrain's options go before SCRIPT: ringtrain run -n 2 train.py "
        "--lr 0.1 (train.py does not define -n; to pass it to the script anyway: "
        "ringtrain run train.py -- ARGS)"
    ), proc.stderr

    proc = ringtrain("tune", "perworker.py", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "is not a sweep script" in proc.stderr and "ringtrain run" in proc.stderr
    assert not marker.exists()  # its top-level code never ran

    proc = ringtrain("run", "--max-failures", "-5", "train.py", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--max-failures" in proc.stderr and "Traceback" not in proc.stderr
    debug = ringtrain("run", "--debug", "--max-failures", "-5", "train.py", cwd=tmp_path)
    assert "Traceback (most recent call last)" in debug.stderr, debug.stderr
    debug = ringtrain("run", "--max-failures", "-5", "train.py", cwd=tmp_path,
                      env={"RINGTRAIN_DEBUG": "1"})  # fmt: skip
    assert "Traceback (most recent call last)" in debug.stderr, debug.stderr

    proc = ringtrain("run", "--preload", "no_such_module_rt", "train.py", cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--preload" in proc.stderr and "ScalingConfig" not in proc.stderr, proc.stderr
    assert "no module named 'no_such_module_rt'" in proc.stderr, proc.stderr

    if not _has_cuda():
        proc = ringtrain("run", "--gpu", "-n", "2", "train.py", cwd=tmp_path)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
        assert "drop --gpu" in proc.stderr and "<=0" not in proc.stderr, proc.stderr

    # A name taken by a run whose driver is alive: refused, naming --name.
    with _live_pid() as pid:
        _fake_run(tmp_path / "runs", "busy", status="RUNNING", driver_pid=pid)
        proc = ringtrain("run", "--name", "busy", "train.py", cwd=tmp_path)
    assert proc.returncode == 2 and "already running" in proc.stderr, proc.stderr
    assert "--name" in proc.stderr and "RunConfig" not in proc.stderr, proc.stderr


def test_python_errors_name_the_fix_without_ringtrain_frames(tmp_path, monkeypatch):
    monkeypatch.delenv("RINGTRAIN_DEBUG", raising=False)
    with pytest.raises(ValueError, match="num_workers") as info:
        rt.ScalingConfig(num_workers=0)
    assert len(_ringtrain_frames(info.value)) <= 1, traceback.format_exception(info.value)
    monkeypatch.setenv("RINGTRAIN_DEBUG", "1")
    with pytest.raises(ValueError) as info:
        rt.ScalingConfig(num_workers=0)
    assert len(_ringtrain_frames(info.value)) >= 3
    monkeypatch.delenv("RINGTRAIN_DEBUG")

    # A name taken by a live run: refused before anything starts, naming the Python fix.
    storage = str(tmp_path / "runs")
    with _live_pid() as pid:
        _fake_run(tmp_path / "runs", "busy", status="RUNNING", driver_pid=pid)
        trainer = rt.Trainer(_noop, run_config=rt.RunConfig(name="busy", storage_path=storage))
        with pytest.raises(RunNameTaken) as info:
            trainer.fit()
    message = str(info.value)
    assert "already running" in message and "RunConfig(name=...)" in message, message
    assert "--name" not in message
    assert len(_ringtrain_frames(info.value)) <= 1
    # A name taken by a FINISHED run continues it (the run directory contract), but says so:
    # RunConfig(name=...) in Python, --name on the command line (tests/backends/test_notebook.py
    # runs it).
    _fake_run(tmp_path / "runs", "done", status="FINISHED", rounds=1)
    note = finished_note(storage, "done")
    assert note is not None and "already finished" in note and "1 rounds" in note
    assert "RunConfig(name=...)" in note and "--name" in for_cli(note)
    assert "RunConfig" not in for_cli(note)
    assert finished_note(storage, "busy") is None and finished_note(storage, "new") is None

    if not _has_cuda():
        gpu = rt.Trainer(_noop, rt.ScalingConfig(use_gpu=True, num_workers=2))
        with pytest.raises(ValueError) as info:
            gpu.fit()
        assert "use_gpu=False" in str(info.value) and "<=0" not in str(info.value)

    lock = threading.Lock()

    def closure():
        with lock:
            pass

    with pytest.raises(TypeError, match=r"closure variable 'lock' of .*closure \(a _thread.lock\)"):
        pickle_payload(closure, None)
    cell = {"__name__": "not_importable_cell", "shared": lock}  # a notebook's globals
    exec("def uses_global():\n    with shared:\n        pass\n", cell)
    with pytest.raises(TypeError, match=r"global 'shared' of uses_global \(a _thread.lock\)"):
        pickle_payload(cell["uses_global"], None)
    with pytest.raises(TypeError, match=r"train_loop_config\['lock'\]"):
        pickle_payload(_noop, {"lock": lock})


def test_cell_sources_reach_the_worker_traceback():
    # A function defined where no file exists (a notebook cell): its lines travel with it.
    name = "/nonexistent/ipykernel_0/cell_42.py"
    text = "def cell_fn(config):\n    x = config['missing']\n    return x\n"
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    scope: dict = {}
    exec(compile(text, name, "exec"), scope)
    try:
        sources = source_lines(scope["cell_fn"])
    finally:
        del linecache.cache[name]
    assert sources == {name: text.splitlines(True)}
    assert linecache.getline(name, 2) == ""
    install_sources(sources)  # what the worker does with the payload's third item
    try:
        scope["cell_fn"]({})
    except KeyError as exc:
        formatted = user_traceback(exc)
    finally:
        del linecache.cache[name]
    assert "x = config['missing']" in formatted, formatted


def test_relayed_tracebacks_never_interleave(monkeypatch):
    """Two ranks printing tracebacks line by line at the same time: each block arrives whole;
    one cut short by the worker's end says so instead of leaving a lone header."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    pipes = {rank: os.pipe() for rank in (0, 1)}
    threads = [
        threading.Thread(target=local._forward, args=(rank, os.fdopen(r, "rb"), "stderr"))
        for rank, (r, _) in pipes.items()
    ]
    for t in threads:
        t.start()
    block = ["Traceback (most recent call last):\n", '  File "x.py", line 1, in f\n', "    f()\n"]
    writers = {rank: os.fdopen(w, "wb", buffering=0) for rank, (_, w) in pipes.items()}
    for line in block:
        for rank in (0, 1):
            writers[rank].write(line.encode())
            time.sleep(0.01)
    writers[0].write(b"ValueError: zero\n")
    writers[1].write(b"ValueError: one\n")
    writers[0].write(b"Traceback (most recent call last):\n")  # cut short by the exit
    for w in writers.values():
        w.close()
    for t in threads:
        t.join(timeout=10)
    lines = out.getvalue().splitlines()
    for rank in (0, 1):
        start = lines.index(f"(rank {rank}) Traceback (most recent call last):")
        assert all(line.startswith(f"(rank {rank}) ") for line in lines[start : start + 4])
    cut = lines.index("(rank 0) ... (traceback cut short: the worker was stopped)")
    assert lines[cut - 1] == "(rank 0) Traceback (most recent call last):", lines


# ------------------------------------------------------------------ helpers


def _noop() -> None:
    pass


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _ringtrain_frames(exc: BaseException) -> list[traceback.FrameSummary]:
    package = os.path.dirname(rt.__file__)
    return [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(package)]


def _fake_run(storage, name, **result):
    run_dir = storage / name
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"name": name, **result}))


class _live_pid:
    """A process that is alive for the ``with`` block (a driver that is still running)."""

    def __enter__(self) -> int:
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        return self.proc.pid

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()
