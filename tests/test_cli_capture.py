"""`kmesh-trace capture` (kmesh_trace/cli/capture.py): a missing command, the server's own error, knobs refused
before the command runs, exported knobs passed through."""

from __future__ import annotations

import json

import pytest


def test_cli_capture_reports_a_missing_command(tmp_path, cli):
    result = cli(["capture", "--out", tmp_path / "t", "--", "no-such-command-kmesh"])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == "Error: command not found: no-such-command-kmesh; check the command after `--`."


def test_cli_capture_names_the_servers_own_error_when_no_engine_started(tmp_path, cli):
    """A server that dies before its engine starts: the command's output passes through, and the
    capture names the root cause as the server logged it (vLLM's log lines, on stdout), not the
    wrapper exceptions after it."""
    import sys

    script = (
        "import sys\n"
        "print('(VllmWorker-0 pid=9) ERROR 12-01 11:11:52 [multiproc_executor.py:953] Traceback (most recent call last):')\n"
        "print('(VllmWorker-0 pid=9) ERROR 12-01 11:11:52 [multiproc_executor.py:953] ValueError: Available memory on "
        "node 0 (6.41/9.84 GiB) on startup is less than desired CPU memory utilization (0.92, 9.05 GiB).')\n"
        "print('(EngineCore pid=8) ERROR 12-01 11:11:57 [core.py:1510] EngineCore failed to start.')\n"
        "sys.stderr.write('Traceback (most recent call last):\\nRuntimeError: Engine core initialization failed. "
        "See root cause above. Failed core proc(s): {}\\n')\n"
        "sys.exit(1)\n")
    result = cli(["capture", "--out", tmp_path / "t", "--summary", tmp_path / "s.json", "--", sys.executable, "-c", script])
    assert result.exit_code == 1
    assert "EngineCore failed to start." in result.stdout  # passed through
    assert "RuntimeError: Engine core initialization failed." in result.stderr
    root = ("ValueError: Available memory on node 0 (6.41/9.84 GiB) on startup is less than desired CPU memory "
            "utilization (0.92, 9.05 GiB).")
    assert (f"no engine was captured: the command exited with 1 before an engine started; its error: {root}"
            in result.stderr.replace("\n", " "))
    assert json.loads((tmp_path / "s.json").read_text())["server_error"] == root
    ok = cli(["capture", "--out", tmp_path / "t2", "--", sys.executable, "-c", "pass"])
    assert ok.exit_code == 0 and "was the kmesh-trace plugin loaded?" in ok.stderr


@pytest.mark.parametrize("args, line", [
    (["--flush-s", "0"], "Error: --flush-s must be a number of seconds > 0 and at most 1,000,000,000, not 0.0."),
    (["--flush-s", "-1"], "Error: --flush-s must be a number of seconds > 0 and at most 1,000,000,000, not -1.0."),
    (["--max-buffered-events", "0"], "Error: --max-buffered-events must be an integer >= 1, not 0."),
])
def test_cli_capture_refuses_a_bad_knob_before_running_the_command(tmp_path, cli, args, line):
    ran = tmp_path / "ran"
    result = cli(["capture", "--out", tmp_path / "t", *args, "--", "touch", ran])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [line]
    assert not ran.exists() and not (tmp_path / "t").exists()


@pytest.mark.parametrize("env, value, line", [
    ("KMESH_TRACE_MAX_BUFFERED_REQUESTS", "0", "Error: KMESH_TRACE_MAX_BUFFERED_REQUESTS must be an integer >= 1, not 0."),
    ("KMESH_TRACE_LINEAGE_WINDOW", "many", "Error: KMESH_TRACE_LINEAGE_WINDOW must be an integer >= 1, not 'many'."),
])
def test_cli_capture_refuses_a_bad_knob_in_its_environment_before_running_the_command(tmp_path, cli, monkeypatch,
                                                                                      env, value, line):
    monkeypatch.setenv(env, value)  # the command would inherit it, and its engine would run uncaptured
    ran = tmp_path / "ran"
    result = cli(["capture", "--out", tmp_path / "t", "--", "touch", ran])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [line]
    assert not ran.exists() and not (tmp_path / "t").exists()


def test_cli_capture_passes_exported_knobs_through_and_options_win(tmp_path, cli, monkeypatch):
    monkeypatch.setenv("KMESH_TRACE_FLUSH_S", "0.25")
    monkeypatch.setenv("KMESH_TRACE_MAX_BUFFERED_EVENTS", "4096")
    seen = tmp_path / "seen"
    show = f'echo "$KMESH_TRACE_FLUSH_S $KMESH_TRACE_MAX_BUFFERED_EVENTS" > {seen}'
    assert cli(["capture", "--out", tmp_path / "t", "--", "sh", "-c", show]).exit_code == 0
    assert seen.read_text().split() == ["0.25", "4096"]
    assert cli(["capture", "--out", tmp_path / "t2", "--flush-s", "2", "--", "sh", "-c", show]).exit_code == 0
    assert seen.read_text().split() == ["2.0", "4096"]
    monkeypatch.setenv("KMESH_TRACE_FLUSH_S", "0")
    r = cli(["capture", "--out", tmp_path / "t3", "--", "sh", "-c", show])
    assert (r.exit_code, r.stderr.strip()) == (1, "Error: KMESH_TRACE_FLUSH_S must be a number of seconds > 0 and at most 1,000,000,000, not 0.0.")

