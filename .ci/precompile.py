"""Byte-compile the installed packages and ringtrain's sources, one worker per core.

`.ci/run` installs with `pip install --no-compile`, because pip byte-compiles the ~21,000 .py
files of ringtrain[test] in one process, on one core (~110 CPU-s). This does the same work with
one worker per core. It must not be skipped: where PYTHONDONTWRITEBYTECODE is set (this
project's machines set it), a module without a .pyc is compiled again by every process that
imports it, which made the test tiers about twice as slow. Files that do not compile (some
packages ship Python 2 examples) are skipped, as pip skips them.
"""

from __future__ import annotations

import compileall
import os
import sys
import sysconfig
import time


def main() -> int:
    started = time.monotonic()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = dict.fromkeys(
        [sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), os.path.join(root, "src")]
    )
    for path in dirs:
        # quiet=2: no listing and no error output; a file that does not compile is left out.
        compileall.compile_dir(path, quiet=2, workers=os.cpu_count() or 1)
    print(f"precompiled {', '.join(dirs)} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
