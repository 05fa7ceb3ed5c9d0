"""What a user sees in a real terminal (issue 21): ``ringtrain run`` in tmux panes 80 and 200
columns wide, captured with ``tmux capture-pane``; and the sweep's progress bar.

The live panel must fit the pane (no line wraps), show a progress bar with an ETA while the run
goes, give the epoch as the worker prints it (``epoch k/N``, 1-based), and be left on screen
once (one top border), with its workers ``finished`` or, after Ctrl-C, ``stopped``.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from ringtrain.tune.progress import SweepDisplay, TrialRow
from support import wait_until

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(HERE, os.pardir, "examples", "tiny_epochs.py")
TOP = "╭"  # a panel's top-left corner: one per panel drawn and left on screen


class Tmux:
    """A private tmux server (its own socket) with one detached session per pane."""

    def __init__(self) -> None:
        self.sock = f"ringtrain-term-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.env = {**os.environ, "TERM": "xterm-256color"}
        for var in ("COLUMNS", "LINES", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE"):
            self.env.pop(var, None)

    def __call__(self, *args: str) -> str:
        proc = subprocess.run(
            ["tmux", "-L", self.sock, *args],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=60,
            check=True,
        )
        return proc.stdout

    def start(self, name: str, width: int, command: str, raw: Path | None = None) -> None:
        self("new-session", "-d", "-s", name, "-x", str(width), "-y", "50", command)
        if raw is not None:  # every byte the pane's programs write, for a failure's message
            self("pipe-pane", "-t", name, "-o", f"cat > {raw}")

    def screen(self, name: str) -> str:
        # -J joins lines the terminal wrapped: a line wider than the pane shows as one.
        return self("capture-pane", "-p", "-J", "-S", "-", "-t", name)

    def kill(self) -> None:
        subprocess.run(["tmux", "-L", self.sock, "kill-server"], capture_output=True, check=False)


def _panel(screen: str) -> str:
    """The screen from the panel's top border on."""
    return screen[screen.rfind(TOP) :] if TOP in screen else ""


def _wait_for(tmux: Tmux, name: str, ok: Callable[[str], bool], timeout_s: float) -> str:
    seen = {"screen": ""}

    def check() -> bool:
        seen["screen"] = tmux.screen(name)
        return ok(seen["screen"])

    assert wait_until(check, timeout_s=timeout_s, interval_s=0.25), (
        f"pane {name} never showed what was waited for; it shows:\n{seen['screen']}"
    )
    return seen["screen"]


def _too_wide(screen: str, width: int) -> list[str]:
    return [line for line in screen.splitlines() if len(line.rstrip()) > width]


def _raw_tail(raw: Path, n: int = 6000) -> str:
    """The last ``n`` bytes a pane's programs wrote (escape sequences shown), to tell a frame
    cut mid-write from one drawn whole and then moved over."""
    data = raw.read_bytes() if raw.exists() else b""
    return f"last {min(n, len(data))} of {len(data)} bytes written to the pane:\n{data[-n:]!r}"


@pytest.mark.timeout(420)
def test_live_panel_in_tmux_at_80_and_200_columns(tmp_path: Path) -> None:
    """Two real runs side by side: at 80 columns to the end, at 200 columns stopped by Ctrl-C
    once the bar is up."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    tmux = Tmux()
    run = f"{sys.executable} -m ringtrain.cli run -n 2 --name {{name}} {EXAMPLE} --steps 20"
    run_plain = [sys.executable, "-m", "ringtrain.cli", "run", "--progress", "plain", "-n", "2"]
    tail = "; echo RINGTRAIN-EXIT-$?; sleep 600"
    # Beside them, piped: plain lines, one per round (the old throttle printed rounds 0 and 2).
    plain = subprocess.Popen(
        [*run_plain, "--name", "plain", EXAMPLE, "--epochs", "3", "--steps", "5", "--step-s", "0"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        tmux.start("w80", 80, f"cd {tmp_path} && {run.format(name='w80')} --epochs 4{tail}")
        raw200 = tmp_path / "w200.raw"
        tmux.start(
            "w200", 200, f"cd {tmp_path} && {run.format(name='w200')} --epochs 40{tail}", raw200
        )

        # While running: a bar with an ETA, in both panes.
        running80 = _wait_for(tmux, "w80", lambda s: "ETA" in s or "EXIT-" in s, 300)
        running200 = _wait_for(tmux, "w200", lambda s: "ETA" in _panel(s), 300)
        tmux("send-keys", "-t", "w200", "C-c")

        end80 = _wait_for(tmux, "w80", lambda s: "RINGTRAIN-EXIT-" in s, 300)
        end200 = _wait_for(tmux, "w200", lambda s: "RINGTRAIN-EXIT-" in s, 120)
        time.sleep(0.3)
        end80, end200 = tmux.screen("w80"), tmux.screen("w200")
        plain_out, _ = plain.communicate(timeout=300)
    finally:
        tmux.kill()
        if plain.poll() is None:
            plain.kill()
            plain.communicate()

    for width, screen in ((80, running80), (200, running200), (80, end80), (200, end200)):
        assert not _too_wide(screen, width), (
            f"lines wider than {width} columns:\n{screen}\n{_raw_tail(raw200)}"
        )
    assert "ETA" in running80 and "━" in running80, running80
    assert "ETA" in running200 and "━" in running200, running200

    # Plain: every round, its epoch as the worker printed it.
    assert plain.returncode == 0, plain_out
    rounds = [line for line in plain_out.splitlines() if line.startswith("[plain] round ")]
    assert [line.split()[2:5] for line in rounds] == [
        ["0", "epoch", "1/3"],
        ["1", "epoch", "2/3"],
        ["2", "epoch", "3/3"],
    ], plain_out
    printed = [line.split()[3] for line in plain_out.splitlines() if "(rank 0) epoch" in line]
    assert printed == ["1/3", "2/3", "3/3"], plain_out

    # 80 columns, to the end: one final panel, FINISHED, the bar full, epochs as printed.
    assert "RINGTRAIN-EXIT-0" in end80, end80
    assert end80.count(TOP) == 1, f"the panel's top border is on screen twice:\n{end80}"
    panel = _panel(end80)
    assert "FINISHED" in panel and "100.0%" in panel and "ETA" not in panel, end80
    assert "running" not in panel and "2 finished" in panel, end80
    printed = [line.split()[3] for line in end80.splitlines() if line.startswith("(rank 0) epoch")]
    assert printed == ["1/4", "2/4", "3/4", "4/4"], end80
    assert f"epoch {printed[-1]}" in panel, end80  # the panel agrees with the worker

    # 200 columns, Ctrl-C: one final panel, ABORTED, no worker left "running".
    assert "RINGTRAIN-EXIT-0" not in end200, end200
    assert end200.count(TOP) == 1, (
        f"the panel's top border is on screen twice:\n{end200}\n{_raw_tail(raw200)}"
    )
    panel = _panel(end200)
    assert "ABORTED" in panel and "2 stopped" in panel and "running" not in panel, end200
    shown = [line for line in end200.splitlines() if line.startswith("(rank 0) epoch")]
    if shown:  # the panel's epoch is the last one the worker printed, or the one after it
        k = int(shown[-1].split()[3].split("/")[0])
        assert f"epoch {k}/40" in panel or f"epoch {k + 1}/40" in panel, end200


def _rows(n: int) -> list[TrialRow]:
    return [TrialRow(i, {"lr": 0.1 * (i + 1)}, status="PENDING") for i in range(n)]


def test_sweep_progress_bar_and_eta() -> None:
    """Sweeps: trials ended / total with an ETA, in the live table and on plain lines."""
    display = SweepDisplay("sw", "val_acc", "max", ["lr"], mode_display="off", total=4)
    for row in _rows(4):
        display.add(row)
    display.start("4 trials")
    display._t_start -= 30.0  # as if the sweep had run for 30 s
    display.update(0, None, status="COMPLETE", last=0.9)
    display.update(1, None, status="PRUNED", last=0.5)
    display.update(2, None, status="RUNNING")
    for width in (80, 200):
        console = Console(width=width, record=True, file=io.StringIO(), color_system=None)
        console.print(display)
        text = console.export_text()
        assert "2/4 trials  50%" in text, text
        eta = float(text.split("ETA ")[1].split("s")[0])
        assert 29.0 <= eta <= 60.0, text  # 30 s for 2 trials, 2 to go (the clock moves on)
        assert max(len(line) for line in text.splitlines()) <= width, text

    out = io.StringIO()
    plain = SweepDisplay("sw", "val_acc", "max", ["lr"], mode_display="plain", stream=out, total=2)
    for row in _rows(2):
        plain.add(row)
    plain.start("2 trials")
    plain.update(0, "COMPLETE: val_acc=0.9", status="COMPLETE", last=0.9)
    assert "trial 0000 COMPLETE: val_acc=0.9 (lr=0.1) [1/2 trials, ETA " in out.getvalue()
    nobar = SweepDisplay("sw", "val_acc", "max", ["lr"], mode_display="off")
    assert nobar.progress_bar() is None  # no total, no bar
