"""What the tests that drive a real browser or server need from this machine: found, or the test cannot run.

In CI (CI=true) something missing fails the test, since CI installs it (.ci/run, `make test`); elsewhere the
test is skipped with the command that installs it.
"""

from __future__ import annotations

import os

import pytest


def needed(found, message: str):
    """``found`` when it is there (not None); else fail in CI and skip elsewhere, saying ``message``."""
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return found


def chromium() -> str:
    """Headless Chromium's executable (Debian's package; scripts/install-chromium installs it)."""
    from gpucourse.course import lab

    return needed(lab.find_chromium(),
                  "no Chromium for the browser test: run scripts/install-chromium (Debian: apt-get install chromium)")
