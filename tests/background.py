"""Subprocess jobs started when the collection ends, one after another, on the core the in-process tests
leave idle (the suite runs in one process; the machine has two cores).

A test module declares a job at import time (`job(__name__, "demo", argv)`), where `argv(out)` gives the
command for an empty output folder `out`; conftest.py starts the declared jobs of the modules that have
selected tests, in the order those tests run, one at a time. The module's fixture calls `finished(job)`:
it waits for the job, or runs it at once when the queue has not reached it yet, and returns
(out, CompletedProcess). A job whose module has no selected test never runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable


class Job:
    def __init__(self, module: str, name: str, argv: Callable[[Path], list[str]], env: dict | None, timeout: float):
        self.module, self.name, self.argv, self.env, self.timeout = module, name, argv, env, timeout
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self.out: Path | None = None
        self.result: subprocess.CompletedProcess | None = None
        self.error: BaseException | None = None
        self.proc: subprocess.Popen | None = None
        self.started: float = 0.0  # time.monotonic() when its process started

    def run(self, root: Path) -> None:
        """Run the job unless it already started (here or on another thread)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        try:
            self.out = root / self.name
            self.out.mkdir(parents=True)
            env = {k: v for k, v in {**os.environ, **(self.env or {})}.items() if v is not None}  # None: unset
            argv = [str(a) for a in self.argv(self.out)]
            with _STARTING:  # no job starts once the session has ended (cleanup below)
                if _ENDED.is_set():
                    raise RuntimeError("the test session ended before this job started")
                # cwd: the repository, not wherever a test has moved the process to by now (test_golden chdirs
                # into a folder it removes after its module)
                self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                             env=env, cwd=REPO)
                self.started = time.monotonic()
            try:
                stdout, stderr = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
                raise
            self.result = subprocess.CompletedProcess(argv, self.proc.returncode, stdout, stderr)
        except BaseException as e:  # noqa: BLE001 - handed to the test that waits for it
            self.error = e
        finally:
            self._done.set()


REPO = Path(__file__).resolve().parents[1]
JOBS: list[Job] = []
_ROOT: list[Path] = []
_STARTING = threading.Lock()
_ENDED = threading.Event()


def job(module: str, name: str, argv: Callable[[Path], list[str]], env: dict | None = None,
        timeout: float = 600) -> Job:
    j = Job(module, f"{module.rsplit('.', 1)[-1]}-{name}", argv, env, timeout)
    JOBS.append(j)
    return j


def _root() -> Path:
    if not _ROOT:
        _ROOT.append(Path(tempfile.mkdtemp(prefix="kmesh-background-")))
    return _ROOT[0]


def start(modules_in_order: list[str]) -> None:
    """Run, on one background thread, the jobs of these modules (in this order), one at a time."""
    order = {m: i for i, m in enumerate(modules_in_order)}
    queue = sorted((j for j in JOBS if j.module in order), key=lambda j: order[j.module])
    if not queue:
        return
    root = _root()

    def work() -> None:
        for j in queue:
            j.run(root)

    threading.Thread(target=work, name="kmesh-background-jobs", daemon=True).start()


def finished(j: Job) -> tuple[Path, subprocess.CompletedProcess]:
    """The job's (output folder, CompletedProcess): run now if not started, else waited for."""
    j.run(_root())
    j._done.wait()
    if j.error is not None:
        raise j.error
    return j.out, j.result


def running() -> list[Job]:
    """The jobs whose process runs now (named in the suite's heartbeat lines, tests/heartbeat.py)."""
    return [j for j in JOBS if j.proc is not None and j.proc.poll() is None]


def cleanup() -> None:
    """At the session's end: start no more jobs, kill one still running (a session stopped early), remove the
    outputs."""
    with _STARTING:
        _ENDED.set()
    for j in JOBS:
        if j.proc is not None and j.proc.poll() is None:
            j.proc.kill()
            j.proc.wait()
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)
