"""The capture's knobs (capture/config.py): checked where they are given, one line for a bad one, the hold
knobs checked alike."""

from __future__ import annotations

import pytest

from kmesh_trace.capture.config import check_knob, hold_config_from_env
from kmesh_trace.capture.recorder import Recorder
from kmesh_trace.errors import KmeshTraceError


@pytest.mark.parametrize("env, value, line", [
    ("KMESH_TRACE_FLUSH_S", "0", "KMESH_TRACE_FLUSH_S must be a number of seconds > 0 and at most 1,000,000,000, not 0.0."),
    ("KMESH_TRACE_FLUSH_S", "soon", "KMESH_TRACE_FLUSH_S must be a number of seconds > 0 and at most 1,000,000,000, not 'soon'."),
    ("KMESH_TRACE_MAX_BUFFERED_EVENTS", "-5", "KMESH_TRACE_MAX_BUFFERED_EVENTS must be an integer >= 1, not -5."),
    ("KMESH_TRACE_MAX_BUFFERED_REQUESTS", "0", "KMESH_TRACE_MAX_BUFFERED_REQUESTS must be an integer >= 1, not 0."),
    ("KMESH_TRACE_LINEAGE_WINDOW", "0", "KMESH_TRACE_LINEAGE_WINDOW must be an integer >= 1, not 0."),
])
def test_a_bad_knob_in_the_engine_environment_is_one_line_and_no_capture(tmp_path, monkeypatch, env, value, line):
    from kmesh_trace.capture import hooks
    from kmesh_trace.capture.recorder import config_from_env

    from kmesh_trace.errors import KmeshTraceError

    monkeypatch.setenv(env, value)
    with pytest.raises(KmeshTraceError) as e:
        config_from_env()
    assert str(e.value) == line
    # What the plugin does in the engine's Scheduler.__init__: the knobs are read before the
    # scheduler is touched, so nothing is installed and no partition is started.
    lines = []
    assert hooks.try_install(None, str(tmp_path / "t"), lines.append) is None
    assert lines == [f"kmesh-trace: {line} The engine runs uncaptured."]
    assert not (tmp_path / "t").exists()


def test_knobs_are_checked_where_they_are_given(tmp_path):
    from kmesh_trace.capture.session import capture_in_process

    from kmesh_trace.errors import KmeshTraceError

    with pytest.raises(KmeshTraceError, match=r"^max_buffered_events must be an integer >= 1, not 0\.$"):
        Recorder(tmp_path / "r", config={"max_buffered_events": 0})
    with (pytest.raises(KmeshTraceError, match=r"^flush_interval_s must be a number of seconds > 0 and at most 1,000,000,000, not -0\.5\.$"),
          capture_in_process(tmp_path / "s", flush_interval_s=-0.5)):
        pass
    assert not (tmp_path / "r").exists() and not (tmp_path / "s").exists()


def test_hold_knobs_are_checked_like_the_capture_knobs():
    assert hold_config_from_env({}) == {"max_held_blocks": None, "max_families": None, "expiry_s": None}
    assert hold_config_from_env({"KMESH_HOLD_MAX_BLOCKS": "64", "KMESH_HOLD_EXPIRY_S": "2.5"})["expiry_s"] == 2.5
    with pytest.raises(KmeshTraceError, match="KMESH_HOLD_MAX_BLOCKS must be an integer >= 1, not 'lots'"):
        hold_config_from_env({"KMESH_HOLD_MAX_BLOCKS": "lots"})
    with pytest.raises(KmeshTraceError, match="KMESH_HOLD_EXPIRY_S must be a number of seconds > 0"):
        hold_config_from_env({"KMESH_HOLD_EXPIRY_S": "0"})
    check_knob("shutdown_grace_s", 0, "KMESH_TRACE_SHUTDOWN_GRACE_S")  # no grace is allowed


def test_capture_refuses_a_bad_hold_knob_before_running(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("KMESH_HOLD_MAX_FAMILIES", "-1")
    r = cli(["capture", "--out", tmp_path / "t", "--", "true"])
    assert r.exit_code == 1 and "KMESH_HOLD_MAX_FAMILIES must be an integer >= 1, not -1." in r.stderr
