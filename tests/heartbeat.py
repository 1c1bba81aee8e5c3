"""A line on the terminal whenever the suite has shown nothing for PERIOD_S seconds: what it is waiting for.

A module fixture that starts vLLM servers runs for minutes before its first test reports; pytest prints
nothing meanwhile and the run looks hung. The plugin (registered by conftest.py) keeps the test, its phase
and the fixture being set up; a helper may say what it is doing in words (`waiting("starting 3 vLLM
servers")`); tests/background.py's running job is named with its age. A thread writes the line, straight
to the terminal (a copy of the descriptor taken while pytest's capture is off), so it shows while the
test's own output is captured. KMESH_HEARTBEAT_S sets the period (0: no lines).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import pytest

PERIOD_S = float(os.environ.get("KMESH_HEARTBEAT_S", "30"))
_lock = threading.Lock()
_doing: list[tuple[str, float]] = []  # what helpers said they wait for, innermost last, with its start


@contextlib.contextmanager
def waiting(what: str):
    """Name what the code inside waits for (e.g. "starting 3 vLLM servers"); shown in the heartbeat line."""
    entry = (what, time.monotonic())
    with _lock:
        _doing.append(entry)
    try:
        yield
    finally:
        with _lock:
            _doing.remove(entry)


def _age(since: float) -> str:
    s = int(time.monotonic() - since)
    return f"{s // 60} min {s % 60:02d} s" if s >= 60 else f"{s} s"


class Heartbeat:
    def __init__(self, config):
        self.config = config
        self.test: tuple[str, str, float] | None = None  # nodeid, phase, since
        self.fixtures: list[tuple[str, float]] = []
        self.last = time.monotonic()
        self.fd: int | None = None
        self.width = 0  # pytest's current line width when the last heartbeat line was written
        self.stop = threading.Event()

    # What the main thread is doing.
    def pytest_runtest_logstart(self, nodeid):
        self.test = (nodeid, "set-up", time.monotonic())
        self.last = time.monotonic()

    def pytest_runtest_call(self, item):
        self.test = (item.nodeid, "run", time.monotonic())

    def pytest_runtest_teardown(self, item):
        self.test = (item.nodeid, "tear-down", time.monotonic())

    def pytest_runtest_logreport(self, report):
        self.last = time.monotonic()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef):
        entry = (fixturedef.argname, time.monotonic())
        self.fixtures.append(entry)
        try:
            yield
        finally:
            self.fixtures.remove(entry)

    # The writer.
    def pytest_sessionstart(self, session):
        if PERIOD_S <= 0:
            return
        capman = self.config.pluginmanager.getplugin("capturemanager")
        with capman.global_and_fixture_disabled() if capman else contextlib.nullcontext():
            self.fd = os.dup(1)
        threading.Thread(target=self._beat, name="kmesh-heartbeat", daemon=True).start()

    def pytest_sessionfinish(self, session):
        self.stop.set()

    def line(self) -> str:
        parts = []
        if self.test is not None:
            nodeid, phase, since = self.test
            parts.append(f"{nodeid}: {phase} for {_age(since)}")
        if self.fixtures:
            name, since = self.fixtures[-1]
            parts.append(f"setting up fixture `{name}` ({_age(since)})")
        with _lock:
            parts += [f"{what} ({_age(since)})" for what, since in _doing]
        import background

        parts += [f"background job {j.name} running ({_age(j.started)})" for j in background.running()]
        return "still running: " + ("; ".join(parts) or "collecting tests")

    def _beat(self) -> None:
        while not self.stop.wait(min(5.0, PERIOD_S)):
            if time.monotonic() - self.last < PERIOD_S:
                continue
            self.last = time.monotonic()
            reporter = self.config.pluginmanager.getplugin("terminalreporter")
            tw = getattr(reporter, "_tw", None)
            width = getattr(tw, "width_of_current_line", 0)
            start = "\n" if width and width != self.width else ""  # pytest's line ended unless ours ended it
            self.width = width
            try:
                os.write(self.fd, f"{start}[{time.strftime('%H:%M:%S')}] {self.line()}\n".encode())
            except OSError:
                return
