"""What `make test` prints while it runs: a line whenever nothing showed for the heartbeat's period (what the
suite waits for), and how to run the tests that skipped for want of the public datasets.

The suite's own conftest.py is loaded as a plugin into a pytest run of a small test file in a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

SLOW = '''
import time, pytest
from heartbeat import waiting

@pytest.fixture(scope="module")
def slow():
    with waiting("starting a pretend server"):
        time.sleep(4)

def test_slow(slow):
    pass

def test_reads_public_data(shared_datasets):
    pass
'''


def test_a_silent_fixture_gets_a_line_naming_it_and_skipped_public_data_says_how(tmp_path):
    (tmp_path / "test_slow.py").write_text(SLOW)
    env = {**os.environ, "PYTHONPATH": str(TESTS), "KMESH_HEARTBEAT_S": "1", "KMESH_DATASETS": str(tmp_path / "none")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "--rootdir",
                        str(tmp_path), "-c", os.devnull, str(tmp_path / "test_slow.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    beats = [line for line in r.stdout.splitlines() if "still running:" in line]
    assert beats, r.stdout
    assert ("test_slow.py::test_slow: set-up for" in beats[-1] and "setting up fixture `slow`" in beats[-1]
            and "starting a pretend server (" in beats[-1]), beats
    hint = "set KMESH_DATASETS to a directory holding mooncake/, weka-claude-code/ and lmcache-agent-trace/"
    header = [line for line in r.stdout.splitlines() if line.startswith("public datasets: not found at")]
    assert header and hint in header[0], r.stdout
    assert f"1 test skipped: public datasets not found at {tmp_path / 'none'}. To run them, {hint}" in r.stdout
