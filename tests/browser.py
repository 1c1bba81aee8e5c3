"""Test support: open a page in a real headless Chromium (Debian's `chromium`) and report what it did.

`load(page)` returns the console messages Chromium logged, the DOM after loading (`--dump-dom`) and a
screenshot (PNG). Each run uses a fresh profile and every background service off, so nothing but the
page is loaded. Tests skip with the reason when no Chromium is installed (`make install-browser`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-default-apps", "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
# Chromium's log line for a console message of the page: ...:CONSOLE(line)] "message", source: url (line)
_CONSOLE = re.compile(r':(?:INFO|WARNING|ERROR):CONSOLE[^\]]*\] "(.*)", source: (.*)$')


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


@dataclass
class Loaded:
    console: list[str]  # every console message the page caused (errors, CSP refusals, failed loads)
    dom: str
    screenshot: Path
    stderr: str


def _run(args: list[str], profile: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                          text=True, timeout=timeout)


def load(page: Path, screenshot: Path, width: int = 1280, height: int = 2400) -> Loaded:
    url = page.resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="kmesh-chromium-") as profile:
        dom = _run(["--dump-dom", url], profile)
    with tempfile.TemporaryDirectory(prefix="kmesh-chromium-") as profile:
        shot = _run([f"--screenshot={screenshot}", f"--window-size={width},{height}", url], profile)
    stderr = dom.stderr + shot.stderr
    console = [m.group(1) for line in stderr.splitlines() if (m := _CONSOLE.search(line))]
    if dom.returncode != 0 or not screenshot.is_file():
        raise RuntimeError(f"chromium failed (rc {dom.returncode}, {shot.returncode}): {stderr[-2000:]}")
    return Loaded(console, dom.stdout, screenshot, stderr)
