"""The cuFile route's mode choice (gds or compat) is made before libcufile reads its configuration; these
checks need no GPU: they run the choice in a fresh process so the environment they set stays there."""

import json
import os
import subprocess
import sys

import pytest

from kmesh_trace.native import cufile
from kmesh_trace.native.gpu import RouteUnavailable


def test_auto_follows_the_nvidia_fs_module(monkeypatch, tmp_path):
    monkeypatch.delenv("KMESH_CUFILE_MODE", raising=False)
    monkeypatch.setattr(cufile, "NVIDIA_FS", tmp_path / "absent")
    assert cufile.choose_mode() == "compat"
    (tmp_path / "present").mkdir()
    monkeypatch.setattr(cufile, "NVIDIA_FS", tmp_path / "present")
    assert cufile.choose_mode() == "gds"
    assert cufile.choose_mode("compat") == "compat"


def test_env_override_and_bad_value(monkeypatch):
    monkeypatch.setenv("KMESH_CUFILE_MODE", "GDS")
    assert cufile.choose_mode() == "gds"
    monkeypatch.setenv("KMESH_CUFILE_MODE", "fast")
    with pytest.raises(RouteUnavailable, match="KMESH_CUFILE_MODE"):
        cufile.choose_mode()


def _configure_in_child(env: dict) -> dict:
    code = ("import json, os; from kmesh_trace.native import cufile; cufile._configure_compat(); "
            "print(json.dumps({k: os.environ.get(k) for k in ('CUFILE_FORCE_COMPAT_MODE', 'CUFILE_ENV_PATH_JSON')}))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("CUFILE_")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_compat_writes_a_private_config_that_allows_it():
    env = _configure_in_child({})
    assert env["CUFILE_FORCE_COMPAT_MODE"] == "true"
    cfg = json.loads(open(env["CUFILE_ENV_PATH_JSON"]).read())
    assert cfg["properties"]["allow_compat_mode"] is True


def test_compat_respects_the_users_own_config(tmp_path):
    mine = tmp_path / "cufile.json"
    mine.write_text("{}")
    env = _configure_in_child({"CUFILE_ENV_PATH_JSON": str(mine)})
    assert env["CUFILE_ENV_PATH_JSON"] == str(mine)
    assert env["CUFILE_FORCE_COMPAT_MODE"] == "true"


def test_udev_record_missing_is_a_precondition_with_its_remedy(monkeypatch, tmp_path):
    if os.major(os.stat(tmp_path).st_dev) == 0:
        pytest.skip(f"{tmp_path} is not on a block device here")
    monkeypatch.setattr(cufile, "UDEV_DATA", tmp_path / "udev" / "data")
    monkeypatch.delenv("KMESH_CUFILE_UDEV", raising=False)
    with pytest.raises(RouteUnavailable, match="no udev record.*KMESH_CUFILE_UDEV=write"):
        cufile.udev_step(tmp_path)


def test_udev_record_written_on_request_then_found(monkeypatch, tmp_path):
    dev = os.stat(tmp_path).st_dev
    if os.major(dev) == 0:
        pytest.skip(f"{tmp_path} is not on a block device here")
    monkeypatch.setattr(cufile, "UDEV_DATA", tmp_path / "udev" / "data")
    monkeypatch.setenv("KMESH_CUFILE_UDEV", "write")
    assert "written by kmesh-trace" in cufile.udev_step(tmp_path)
    record = (tmp_path / "udev" / "data" / f"b{os.major(dev)}:{os.minor(dev)}").read_text()
    assert "E:ID_FS_USAGE=filesystem" in record and "E:ID_FS_TYPE=" in record
    assert "ID_FS_TYPE=unknown" not in record  # the type comes from the mount table
    monkeypatch.delenv("KMESH_CUFILE_UDEV")
    assert "udev describes the disk" in cufile.udev_step(tmp_path)


def test_a_directory_not_on_a_disk_is_refused():
    if not os.path.isdir("/proc/self") or os.major(os.stat("/proc/self").st_dev) != 0:
        pytest.skip("no pseudo filesystem to test with")
    with pytest.raises(RouteUnavailable, match="not on a block device"):
        cufile.udev_step("/proc/self")
