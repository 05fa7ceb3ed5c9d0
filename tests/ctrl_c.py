"""Start a driver process that a test stops with a "Ctrl-C" (SIGINT), whatever the test session's
own SIGINT disposition.

Why: a Ctrl-C at a terminal reaches the foreground job, whose SIGINT is never ignored, so Python
raises ``KeyboardInterrupt`` in it. A process started in the background by a non-interactive
shell (``python -m pytest ... &``, ``nohup ... &``, a CI step that backgrounds the suite) has SIGINT
*ignored* (POSIX), every child inherits that across ``exec``, and Python installs no
``KeyboardInterrupt`` handler for an ignored SIGINT: the test's SIGINT then did nothing, and the
driver ran until the test gave up (the two "driver did not exit within 30 s / 120 s after Ctrl-C"
failures of the suite's load run, which had been started in the background; reproduced every time
that way, never in the foreground).

So :func:`ctrl_c_driver` starts the driver with SIGINT ignored (the worst case, whatever the
session's: a test that depends on how pytest was started is not deterministic), and the driver's
code begins with :data:`AS_AT_A_TERMINAL`, which gives it the SIGINT handling of a foreground job.
"""

from __future__ import annotations

import signal
import sys

AS_AT_A_TERMINAL = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
"""The first line of a driver's ``-c`` code: SIGINT raises ``KeyboardInterrupt``, as in a
foreground job at a terminal, even where the process inherited SIGINT ignored."""

_IGNORING_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def ctrl_c_driver(code: str, *args: str) -> list[str]:
    """The command line of a driver running ``python -c code args...``, started with SIGINT
    ignored (as a background job's child): ``code`` must begin with :data:`AS_AT_A_TERMINAL`.

    Raises:
        ValueError: if ``code`` does not begin with :data:`AS_AT_A_TERMINAL`.
    """
    if not code.lstrip("\n").startswith(AS_AT_A_TERMINAL):
        raise ValueError("the driver's code must begin with ctrl_c.AS_AT_A_TERMINAL")
    return [sys.executable, "-c", _IGNORING_SIGINT, sys.executable, "-c", code, *args]


def sigint_ignored(pid: int) -> bool:
    """Whether process ``pid`` ignores SIGINT (``SigIgn`` in ``/proc/PID/status``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return False
