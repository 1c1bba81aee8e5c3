"""Shared fixtures: the public-data location and a CLI runner."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings
from typer.testing import CliRunner

# Hypothesis keeps its example database (and its other files) in the user's cache, not in the repository
# tree; an explicit HYPOTHESIS_STORAGE_DIRECTORY wins. Set before any test asks Hypothesis for storage.
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(
    Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kmesh-trace" / "hypothesis"))
# Two Hypothesis profiles, chosen by KMESH_HYPOTHESIS. `ci` (the default): at most CI_MAX_EXAMPLES examples a
# property, a test's own larger `max_examples` capped to it (pytest_collection_modifyitems below), no example
# database. `thorough`: every test's own count (50 where it names none) and the example database in the storage
# directory above, outside the tree.
CI_MAX_EXAMPLES = 25
HYPOTHESIS_PROFILE = os.environ.get("KMESH_HYPOTHESIS", "ci")
if HYPOTHESIS_PROFILE not in ("ci", "thorough"):
    raise pytest.UsageError(f"KMESH_HYPOTHESIS must be ci or thorough, not {HYPOTHESIS_PROFILE!r}")
settings.register_profile("ci", database=None, max_examples=CI_MAX_EXAMPLES, deadline=None)
settings.register_profile("thorough", max_examples=50, deadline=None)
settings.load_profile(HYPOTHESIS_PROFILE)


def pytest_configure(config):
    """A line at least every 30 s while nothing else shows (tests/heartbeat.py)."""
    from heartbeat import Heartbeat

    config.pluginmanager.register(Heartbeat(config), "kmesh-heartbeat")


def pytest_report_header(config):
    d = datasets_dir()
    if d.is_dir():
        return f"public datasets: {d}"
    return (f"public datasets: not found at {d}; the tests that read them skip. {DATASETS_HINT}")


DATASETS_SKIP = "public datasets not found"
DATASETS_HINT = ("To run them, set KMESH_DATASETS to a directory holding mooncake/, weka-claude-code/ and "
                 "lmcache-agent-trace/ (README.md, 'Start here').")


def pytest_terminal_summary(terminalreporter):
    """After the skip reasons: how many skipped for want of the public datasets, and how to run them."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if DATASETS_SKIP in str(r.longrepr)]
    if skipped:
        tests = "1 test" if len(skipped) == 1 else f"{len(skipped)} tests"
        terminalreporter.write_line(f"{tests} skipped: {DATASETS_SKIP} at {datasets_dir()}. "
                                    f"{DATASETS_HINT}", yellow=True)


def pytest_collection_modifyitems(items):
    """Under the `ci` profile, a property test's own `@settings(max_examples=N)` is capped at CI_MAX_EXAMPLES."""
    if HYPOTHESIS_PROFILE != "ci":
        return
    for item in items:
        test = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        own = getattr(test, "_hypothesis_internal_use_settings", None)
        if own is not None and own.max_examples > CI_MAX_EXAMPLES:
            test._hypothesis_internal_use_settings = settings(own, max_examples=CI_MAX_EXAMPLES, database=None)


def pytest_collection_finish(session):
    """Start the subprocess jobs of the selected modules in the background (tests/background.py)."""
    if session.config.option.collectonly:
        return
    import background

    modules: dict[str, None] = {}
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None:
            modules.setdefault(module.__name__)
    background.start(list(modules))


def pytest_sessionfinish(session):
    import background

    background.cleanup()


def datasets_dir() -> Path:
    env = os.environ.get("KMESH_DATASETS")
    return Path(env) if env else Path(__file__).resolve().parents[1].parent / "shared" / "datasets"


@pytest.fixture
def shared_datasets() -> Path:
    d = datasets_dir()
    if not d.is_dir():
        pytest.skip(f"{DATASETS_SKIP} at {d} (set KMESH_DATASETS to their directory)")
    return d


@pytest.fixture
def cli():
    """Invoke the CLI in-process: cli(args) -> result with exit_code, stdout, stderr."""
    from kmesh_trace.cli import app

    runner = CliRunner()
    return lambda args: runner.invoke(app, [str(a) for a in args])


@pytest.fixture
def width(monkeypatch):
    """Set the terminal width every console (and click's help) renders at."""
    from kmesh_trace.cli import display

    def set_width(columns: int) -> None:
        monkeypatch.setenv("COLUMNS", str(columns))
        for console in (display.out, display.err):
            monkeypatch.setattr(console, "_width", columns)

    return set_width


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs, loopback only, no dashboard) for the whole session; skipped without Ray. Its
    workers see tests/ on their path, so task functions may come from test helpers."""
    import logging

    ray = pytest.importorskip("ray", reason="ray is not installed; pip install 'kmesh-trace[fleet]' runs the Ray tests")
    tests_dir = str(Path(__file__).resolve().parent)
    from kmesh_trace.distributed import local_cluster_options

    # The same options as `--ray auto`'s local cluster: every server on 127.0.0.1, no dashboard.
    ray.init(num_cpus=2, logging_level=logging.WARNING, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": tests_dir}}, **local_cluster_options())
    yield ray
    ray.shutdown()


@pytest.fixture
def tmpfs(tmp_path):
    """mount(options) -> a fresh tmpfs mounted with `options` (e.g. "size=256k", "ro,size=64k"), unmounted
    after the test: a real full or read-only filesystem. Skips where mounting is not allowed (needs root)."""
    import shutil
    import subprocess
    import uuid

    mounted = []

    def mount(options: str) -> Path:
        if os.geteuid() != 0 or shutil.which("mount") is None:
            pytest.skip("mounting a tmpfs needs root and mount(8)")
        mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:8]}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="session")
def family_capture(tmp_path_factory):
    """One real vLLM engine (in-process, tiny model, a pool small enough to evict) running the family workload
    (tests/tiny_llm.py) under the capture, shared by the tests that only read its trace: (trace, outputs)."""
    pytest.importorskip("vllm")
    from tiny_llm import engine_env, family_workload, make_llm, write_model  # tests/ is on sys.path

    from kmesh_trace.capture.session import capture_in_process

    tmp = tmp_path_factory.mktemp("family-capture")
    engine_env(multiprocess=False)
    with capture_in_process(tmp / "trace"):
        llm = make_llm(write_model(tmp / "model"))
        outs = family_workload(llm)
    llm.llm_engine.engine_core.shutdown()
    del llm
    return tmp / "trace", outs
