"""Tests for ringtrain.monitor.progress: the driver's progress reporters."""

from __future__ import annotations

import io
import os
import signal
import sys
import threading

import pytest
from rich.console import Console
from rich.file_proxy import FileProxy

from ringtrain.monitor.eta import RunProgress
from ringtrain.monitor.progress import (
    NullProgress,
    PlainProgress,
    ProgressReporter,
    RichProgress,
    make_progress,
)


class FakeClock:
    """A settable monotonic clock, in seconds."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class TTYStringIO(io.StringIO):
    """A StringIO that says it is a terminal."""

    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No environment variable forcing rich's terminal detection either way, and a terminal that
    draws (``TERM=dumb``, common on CI machines, turns rich's live display off); a test that
    wants another ``TERM`` sets it."""
    for var in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "NO_COLOR", "JUPYTER_COLUMNS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")


# --------------------------------------------------------------------------------------------
# PlainProgress
# --------------------------------------------------------------------------------------------


def test_plain_lines_format() -> None:
    clock = FakeClock()
    out = io.StringIO()
    p = PlainProgress(out, clock=clock)

    p.start("mnist", 2, "/abs/runs/mnist")
    p.worker_state(0, "running")  # silent
    p.report(0, 3, {"loss": 0.5})  # silent
    clock.t += 12.3
    p.round_complete(3, {"loss": 0.123449, "val_acc": 0.97123, "epoch": 2})
    clock.t += 80.0
    p.close("FINISHED")

    assert out.getvalue().splitlines() == [
        "[mnist] started: 2 workers, run directory /abs/runs/mnist",
        "[mnist] round 3 epoch=2 loss=0.1234 val_acc=0.9712 (12.3s)",
        "[mnist] FINISHED in 1m 32s (4 rounds)",
    ]


def test_plain_throttles_round_lines_but_keeps_the_last() -> None:
    clock = FakeClock(0.0)
    out = io.StringIO()
    p = PlainProgress(out, clock=clock, min_interval_s=1.0)
    p.start("run", 1, "runs/run")

    for t, rnd in [(0.5, 0), (0.8, 1), (1.2, 2), (1.6, 3), (1.7, 4)]:
        clock.t = t
        p.round_complete(rnd, {"loss": float(rnd)})
    clock.t = 2.0
    p.close("FINISHED")

    lines = out.getvalue().splitlines()
    assert lines == [
        "[run] started: 1 worker, run directory runs/run",
        "[run] round 0 loss=0 (0.5s)",
        # rounds 1 and 2 came within a second of round 0: held back, then superseded
        "[run] round 3 loss=3 (1.6s)",
        # round 4 was held back; close writes it (with the time it completed)
        "[run] round 4 loss=4 (1.7s)",
        "[run] FINISHED in 2.0s (5 rounds)",
    ]


def test_plain_message_flushes_held_round_first() -> None:
    clock = FakeClock(0.0)
    out = io.StringIO()
    p = PlainProgress(out, clock=clock)
    p.start("run", 2, "runs/run")
    clock.t = 0.1
    p.round_complete(0, {"acc": 0.5})
    clock.t = 0.2
    p.round_complete(1, {"acc": 0.6})  # held back
    p.message("checkpoint saved: checkpoint_000001\n  2 files")
    clock.t = 0.3
    p.close("ERRORED")
    p.close("FINISHED")  # a second close writes nothing

    assert out.getvalue().splitlines()[1:] == [
        "[run] round 0 acc=0.5 (0.1s)",
        "[run] round 1 acc=0.6 (0.2s)",
        "[run] checkpoint saved: checkpoint_000001",
        "  2 files",
        "[run] ERRORED in 0.3s (2 rounds)",
    ]


def test_plain_survives_closed_stream() -> None:
    out = io.StringIO()
    p = PlainProgress(out)
    p.start("run", 1, "runs/run")
    out.close()
    p.round_complete(0, {"loss": 1.0})  # must not raise
    p.close("FINISHED")


def test_plain_context_manager_closes_with_errored() -> None:
    out = io.StringIO()
    clock = FakeClock()
    with pytest.raises(RuntimeError), PlainProgress(out, clock=clock) as p:
        p.start("run", 1, "runs/run")
        raise RuntimeError("driver bug")
    assert out.getvalue().splitlines()[-1] == "[run] ERRORED in 0.0s"


# --------------------------------------------------------------------------------------------
# RichProgress
# --------------------------------------------------------------------------------------------


def _rich(max_worker_rows: int = 16) -> tuple[RichProgress, io.StringIO, FakeClock]:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    clock = FakeClock()
    progress = RichProgress(console, clock=clock, max_worker_rows=max_worker_rows)
    return progress, buf, clock


def test_rich_renders_panel_and_messages() -> None:
    p, buf, clock = _rich()
    p.start("mnist", 2, "/abs/runs/mnist")
    p.worker_state(0, "running")
    p.worker_state(1, "starting")
    for rnd in range(3):
        for rank in range(2):
            p.report(rank, rnd, {"epoch": rnd, "loss": 0.5 / (rnd + 1), "val_acc": 0.97123})
        p.round_complete(rnd, {"epoch": rnd, "loss": 0.5 / (rnd + 1), "val_acc": 0.97123})
    p.message("checkpoint saved: checkpoint_000002")
    p.worker_state(1, "failed")
    clock.t += 92.0
    p.close("FINISHED")

    out = buf.getvalue()
    final = out[out.rindex("ringtrain · mnist") :]  # the panel as left on screen
    assert "FINISHED" in final
    assert "elapsed 1m 32s" in final
    assert "round 2" in final
    assert "epoch 2" in final
    assert "loss=0.1667" in final
    assert "val_acc=0.9712" in final
    assert "1 finished, 1 failed" in final  # close() settles the running worker
    assert "/abs/runs/mnist" in final
    rows = [line for line in final.splitlines() if "0.1667" in line and "│" in line]
    assert any("finished" in r for r in rows) and any("failed" in r for r in rows)
    # The message was printed (above the panel), before the final panel was drawn.
    assert "checkpoint saved: checkpoint_000002" in out
    assert out.index("checkpoint saved") < out.rindex("ringtrain · mnist")


def test_rich_report_moves_starting_worker_to_running() -> None:
    p, buf, _ = _rich()
    p.start("run", 1, "runs/run")
    p.report(0, 0, {"loss": 1.5})
    p.close("FINISHED")
    final = buf.getvalue()[buf.getvalue().rindex("ringtrain · run") :]
    row = next(line for line in final.splitlines() if "1.5" in line and "│" in line)
    assert "finished" in row  # running when the run ended: close() settles it
    assert "starting" not in final


def test_rich_close_stops_live_after_exception() -> None:
    p, _, _ = _rich()
    stdout_before = sys.stdout
    with pytest.raises(KeyError), p:
        p.start("run", 1, "runs/run")
        assert isinstance(sys.stdout, FileProxy)  # Live redirects stdout above the panel
        raise KeyError("boom")
    assert sys.stdout is stdout_before
    assert not isinstance(sys.stdout, FileProxy)
    assert p._live is None


class CtrlCMidWrite(TTYStringIO):
    """A terminal where a Ctrl-C (a real SIGINT to this process) arrives in the middle of the
    main thread's write of the first frame that shows ``ABORTED``, as when that write blocks on
    a busy terminal."""

    armed = True
    marker = "ABORTED"

    def write(self, s: str) -> int:
        main = threading.current_thread() is threading.main_thread()
        if self.armed and self.marker in s and main:
            self.armed = False
            half = len(s) // 2
            written = super().write(s[:half])
            os.kill(os.getpid(), signal.SIGINT)
            return written + super().write(s[half:])
        return super().write(s)


def test_rich_close_writes_the_final_frame_whole_and_raises_a_ctrl_c_after() -> None:
    """A Ctrl-C during the final frame's write does not cut it mid-row (the CLI's next line
    would continue that row): the frame ends with its bottom border, then the Ctrl-C raises."""
    buf = CtrlCMidWrite()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    p = RichProgress(console, refresh_per_second=0.01, clock=FakeClock())  # no redraw thread frame
    p.start("run", 2, "runs/run")
    p.report(0, 0, {"loss": 1.5})
    with pytest.raises(KeyboardInterrupt):
        p.close("ABORTED")
    assert not buf.armed  # the SIGINT was sent inside the final frame's write
    final = buf.getvalue()[buf.getvalue().rindex("ABORTED") :]
    assert "╰" in final, final  # the bottom border: the frame was written to its end
    assert p._live is None and not isinstance(sys.stdout, FileProxy)


def test_rich_drawing_error_does_not_break_close() -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("no str")

    p, buf, _ = _rich()
    p.start("run", 1, "runs/run")
    p.report(0, 0, {"weird": Unprintable()})
    p.close("ERRORED")
    assert "progress display error" in buf.getvalue()
    assert not isinstance(sys.stdout, FileProxy)


def test_rich_many_workers_are_summarised() -> None:
    p, buf, _ = _rich(max_worker_rows=5)
    p.start("big", 40, "runs/big")
    p.close("ABORTED")
    final = buf.getvalue()[buf.getvalue().rindex("ringtrain · big") :]
    assert "36 more" in final
    assert "40 stopped" in final  # aborted while starting: none is left "starting"
    assert "ABORTED" in final


def test_plain_writes_every_round() -> None:
    """The guide's promise: one line per round, however fast the rounds come (the old
    one-line-a-second throttle printed rounds 0 and 2 of a 3-round run)."""
    clock = FakeClock()
    out = io.StringIO()
    p = PlainProgress(out, clock=clock)
    p.start("tiny", 2, "runs/tiny")
    for rnd in range(3):
        clock.t += 0.01
        p.round_complete(rnd, {"epoch": rnd})
    p.close("FINISHED")
    rounds = [line for line in out.getvalue().splitlines() if " round " in line]
    assert [line.split()[2] for line in rounds] == ["0", "1", "2"]


def _window(epoch: int, step: int, *, epochs: int = 4, steps: int = 10) -> dict[str, object]:
    """A timing window as a worker inside TrainState.epochs(epochs) sends it."""
    return {
        "step": step,
        "step_s": 0.1,
        "samples_per_s": 40.0,
        "progress_epoch": epoch,
        "progress_epochs": epochs,
        "progress_epoch_steps": steps,
        "progress_epoch_start_step": epoch * steps,
    }


def test_plain_epoch_as_the_worker_prints_it() -> None:
    """Once rank 0's windows say N (TrainState.epochs), a round line gives its epoch 1-based of N,
    like the worker's own "epoch 1/4" line; before that, the raw metric."""
    out = io.StringIO()
    p = PlainProgress(out, clock=FakeClock())
    p.start("tiny", 2, "runs/tiny")
    p.round_complete(0, {"epoch": 0, "loss": 1.0})
    p.timing(1, _window(1, 12))  # rank 1's windows do not count
    p.round_complete(1, {"epoch": 1, "loss": 1.0})
    p.timing(0, _window(2, 20))
    p.round_complete(2, {"epoch": 2, "loss": 0.5})
    lines = [line for line in out.getvalue().splitlines() if " round " in line]
    assert lines[0].startswith("[tiny] round 0 epoch=0 loss=1 ")
    assert lines[1].startswith("[tiny] round 1 epoch=1 loss=1 ")
    assert lines[2].startswith("[tiny] round 2 epoch 3/4 loss=0.5 ")


def test_run_progress_fraction_eta_and_label() -> None:
    prog = RunProgress()
    assert prog.fraction is None and prog.epoch_label() is None and prog.eta_s(0.0) is None
    prog.update({"step": 3, "step_s": 0.1}, 1.0)  # no progress fields: still unknown
    assert prog.fraction is None
    prog.update(_window(0, 5), 10.0)  # half of epoch 1 of 4
    assert prog.fraction == pytest.approx(0.125)
    assert prog.epoch_label() == "1/4"
    prog.update(_window(1, 15), 20.0)  # half of epoch 2: 0.25 more in 10 s
    assert prog.fraction == pytest.approx(0.375)
    assert prog.epoch_label() == "2/4"
    assert prog.eta_s(20.0) == pytest.approx(25.0)  # 0.625 left at 0.025/s
    assert prog.eta_s(24.0) == pytest.approx(21.0)  # counts down between windows
    prog.update(_window(1, 12), 21.0)  # a stale window never moves the bar back
    assert prog.fraction == pytest.approx(0.375)
    prog.epoch_done(3, 30.0)  # round with metric epoch=3 (0-based): the last epoch is done
    assert prog.fraction == 1.0 and prog.epoch_label() == "4/4"


def test_run_progress_resumed_run_counts_its_rate_from_the_resume() -> None:
    prog = RunProgress()
    prog.update(_window(2, 20, steps=10), 100.0)  # resumed at the start of epoch 3 of 4
    prog.update(_window(2, 25, steps=10), 110.0)  # half an epoch (0.125) in 10 s
    assert prog.fraction == pytest.approx(0.625)
    assert prog.eta_s(110.0) == pytest.approx(30.0)


def test_rich_panel_bar_eta_and_epochs_as_the_worker_prints_them() -> None:
    p, buf, clock = _rich()
    p.start("tiny", 2, "runs/tiny")
    for rank in range(2):
        p.worker_state(rank, "running")
    p.timing(0, _window(0, 5))
    clock.t += 10.0
    p.timing(0, _window(1, 15))
    p.report(0, 0, {"epoch": 0, "loss": 1.0})
    p.round_complete(0, {"epoch": 0, "loss": 1.0})
    live = p._render()
    console = Console(width=80, record=True, color_system=None, file=io.StringIO())
    console.print(live)
    text = console.export_text()
    # The header's epoch is its round's (0, the first epoch), as the rows and the plain lines
    # give it: 1-based of the total. (It gave the epoch being trained, 2/4, beside rows of 1/4.)
    header = next(line for line in text.splitlines() if "round" in line)
    assert "round 0   epoch 1/4" in header, text
    row = next(line for line in text.splitlines() if line.strip("│ ").startswith("0 "))
    assert "1/4" in row, text
    assert "ETA" in text and "37.5%" in text
    assert max(len(line) for line in text.splitlines()) <= 80
    clock.t += 5.0
    p.close("ABORTED")
    final = buf.getvalue()[buf.getvalue().rindex("ringtrain · tiny") :]
    assert "ABORTED" in final and "2 stopped" in final and "running" not in final
    assert "ETA" not in final  # a stopped run has no ETA


# --------------------------------------------------------------------------------------------
# make_progress
# --------------------------------------------------------------------------------------------


def test_make_progress_modes(plain_env: None) -> None:
    assert isinstance(make_progress("plain", io.StringIO()), PlainProgress)
    assert isinstance(make_progress("off", io.StringIO()), NullProgress)
    assert isinstance(make_progress("RICH", io.StringIO()), RichProgress)
    # auto: plain lines for a pipe or file, the live panel for a terminal
    assert isinstance(make_progress("auto", io.StringIO()), PlainProgress)
    assert isinstance(make_progress("auto", TTYStringIO()), RichProgress)
    for mode in ("plain", "off", "rich", "auto"):
        assert isinstance(make_progress(mode, io.StringIO()), ProgressReporter)
    with pytest.raises(ValueError, match="progress mode"):
        make_progress("fancy")


def test_make_progress_auto_on_dumb_terminal_is_plain(
    plain_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TERM", "dumb")
    assert isinstance(make_progress("auto", TTYStringIO()), PlainProgress)


def test_make_progress_plain_writes_to_stream() -> None:
    out = io.StringIO()
    p = make_progress("plain", out)
    p.start("s", 1, "runs/s")
    p.round_complete(0, {"loss": 0.25})
    p.close("FINISHED")
    assert "[s] round 0 loss=0.25" in out.getvalue()


def test_off_mode_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    p = make_progress("off", out)
    p.start("quiet", 2, "runs/quiet")
    p.worker_state(0, "running")
    p.report(0, 0, {"loss": 1.0})
    p.round_complete(0, {"loss": 1.0})
    p.message("checkpoint saved")
    p.close("FINISHED")
    assert out.getvalue() == ""
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_rich_mode_forces_terminal_on_plain_stream() -> None:
    out = io.StringIO()
    p = make_progress("rich", out)
    p.start("forced", 1, "runs/forced")
    p.round_complete(0, {"loss": 0.5})
    p.close("FINISHED")
    text = out.getvalue()
    assert "ringtrain · forced" in text
    assert "\x1b[" in text  # drawn with terminal control codes


def test_sweep_display_close_writes_the_final_frame_whole_too() -> None:
    """The sweep's live table, closed by a Ctrl-C path, likewise: the last frame is whole."""
    from ringtrain.tune.progress import SweepDisplay, TrialRow

    buf = CtrlCMidWrite()
    buf.armed, buf.marker = False, "trial"
    display = SweepDisplay("sweep", "val_acc", "max", ["lr"], stream=buf, mode_display="rich")
    display.start("2 trials at a time")
    display.add(TrialRow(number=0, params={"lr": 0.1}))
    display.update(0, status="RUNNING")
    buf.armed = True
    with pytest.raises(KeyboardInterrupt):
        display.close()
    assert not buf.armed  # the SIGINT was sent inside the final frame's write
    out = buf.getvalue()
    row = out.rfind("RUNNING")  # the last frame's trial row
    assert row >= 0 and "└" in out[row:], out[-600:]  # and its bottom border after it


def test_no_samples_per_second_without_a_prepared_loader() -> None:
    """A loop without ``rt.prepare_data_loader`` counts no samples: its windows say 0 samples/s,
    which is no throughput to show (issue 40: "0 samples/s" on every round line)."""
    stream = io.StringIO()
    p = PlainProgress(stream, min_interval_s=0.0)
    p.start("loop", 2, "runs/loop")
    for rank in range(2):
        p.timing(rank, {"step": 4, "step_s": 0.03, "samples_per_s": 0.0})
        p.report(rank, 0, {"loss": 1.0})
    p.round_complete(0, {"loss": 1.0})
    p.close("FINISHED")
    assert "0.03 s/step]" in stream.getvalue() and "samples/s" not in stream.getvalue()

    r, _, _ = _rich()
    r.start("loop", 2, "runs/loop")
    for rank in range(2):
        r.worker_state(rank, "running")
        r.timing(rank, {"step": 4, "step_s": 0.03, "samples_per_s": 0.0})
    console = Console(width=100, record=True, color_system=None, file=io.StringIO())
    console.print(r._render())
    text = console.export_text()
    assert "samples/s" not in text and "0.03 s/step" in text, text
