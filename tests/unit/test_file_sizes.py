"""Every source file stays a room one can read (issue 20): at most 500 lines. Complexity per
function is ruff's C901 (max 15, pyproject.toml), checked by CI's ruff step."""

from __future__ import annotations

from pathlib import Path

import ringtrain

MAX_LINES = 500
SRC = Path(ringtrain.__file__).parent


def test_no_source_file_is_over_500_lines():
    sizes = {
        str(path.relative_to(SRC)): len(path.read_text(encoding="utf-8").splitlines())
        for path in SRC.rglob("*.py")
    }
    assert len(sizes) > 100  # the package was found
    over = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not over, f"split these files (at most {MAX_LINES} lines each): {over}"
