"""Finding the system Chromium for the browser tests and scripts/dashboard_screenshots.py.

The browser is the distribution's ``chromium`` (installed by scripts/setup_chromium.sh), driven by Playwright for
Python through ``executable_path``: Playwright's own browser downloads are never used.
"""

from __future__ import annotations

import os
import shutil

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def chromium_path() -> str | None:
    """``CLAWLOOP_CHROMIUM`` when set, else the first Chromium-like browser on PATH, else None."""
    given = os.environ.get("CLAWLOOP_CHROMIUM", "").strip()
    if given:
        return given if os.path.isfile(given) and os.access(given, os.X_OK) else None
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None
