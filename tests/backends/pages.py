"""The dashboard's browser tests: Debian's Chromium driven by Playwright (the ``browser`` and
``page`` fixtures are in tests/backends/conftest.py), with a generous wait and screenshots."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

try:
    from playwright.sync_api import Page, sync_playwright
except ImportError:  # pragma: no cover - playwright is in the [test] extra
    Page = object  # type: ignore[assignment,misc]
    sync_playwright = None  # type: ignore[assignment]

CHROMIUM = "/usr/bin/chromium"
needs_browser = pytest.mark.skipif(
    sync_playwright is None or not os.path.exists(CHROMIUM),
    reason="browser tests need playwright (pip install -e '.[test]') and Debian's Chromium at "
    f"{CHROMIUM} (apt-get install chromium); found playwright={sync_playwright is not None}, "
    f"chromium={os.path.exists(CHROMIUM)}",
)
ARTIFACTS = Path(
    os.environ.get("RINGTRAIN_TEST_ARTIFACTS")
    or Path(__file__).resolve().parents[2] / ".pytest_artifacts"
)
WAIT_MS = 30_000  # generous: a loaded 2-core machine must not fail these


def screenshot(page: Page, name: str) -> None:
    """``page`` as ``.pytest_artifacts/dashboard_<name>.png`` (for a person to look at)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"dashboard_{name}.png"), full_page=True)
