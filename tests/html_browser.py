"""Opening a report page in headless Chromium (Playwright driving the system's Chromium).

Used by ``tests/test_html_report.py`` and ``docs/screenshots.py``. ``chromium_path`` finds
the browser (``SOAP_CHROMIUM``, else ``chromium``/``chromium-browser``/``google-chrome`` on
the PATH); ``.ci/run`` installs Debian's ``chromium`` where it is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator


def chromium_path() -> str | None:
    """The Chromium executable to drive, or None."""
    configured = os.environ.get("SOAP_CHROMIUM")
    if configured:
        return configured if Path(configured).exists() else None
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def browser_missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if chromium_path() is None:
        return "no Chromium on this machine (install Debian's chromium, or set SOAP_CHROMIUM); .ci/run installs it"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[dev]')"
    return None


@contextlib.contextmanager
def opened_page(path: Path, width: int = 1280, height: int = 900) -> Iterator[tuple[object, list[str]]]:
    """``path`` opened from a file:// URL: the page and the console errors it logged
    (``console.error`` calls and uncaught exceptions)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        # --no-sandbox: CI and containers run as root, where Chromium's sandbox refuses to start.
        browser = driver.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            errors: list[str] = []
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            # Offline, as the page promises: any request that leaves the file is refused.
            page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:") else route.abort())
            page.goto(Path(path).resolve().as_uri())
            yield page, errors
        finally:
            browser.close()
