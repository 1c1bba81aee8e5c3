"""docs/CAPTURE.md as a server operator pastes it: every command block runs, in order, as written.

The fenced blocks of the page are the commands: ```sh blocks run with bash in one working directory
(the one tagged `terminal-1` in the background, as a second terminal would leave it; it is stopped
with Ctrl-C, SIGINT to its process group, before the first block tagged `after-stop`), ```python
blocks run as scripts with the same Python; ```text blocks are output or fragments, and blocks
tagged `gpu-host` need a GPU (vLLM's `vllm serve` console script, LMCache) and are only checked to
be tagged. The one change made to the commands: the port (8000 on the page) is a free one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import background  # tests/ is on sys.path
from requires import skip_module_without

# Looked up, not imported: importing vLLM here would slow the collection and this file's own script.
skip_module_without("vllm")
skip_module_without("openai", "the worked example uses the openai package (pip install -e '.[dev]')")

DOC = Path(__file__).resolve().parents[1] / "docs" / "CAPTURE.md"
FENCE = re.compile(r"^```([a-z]*)(?: ([\w-]+))?\n(.*?)^```$", re.MULTILINE | re.DOTALL)
START_TIMEOUT_S = 400


def blocks() -> list[tuple[str, str | None, str]]:
    return [(m.group(1), m.group(2), m.group(3)) for m in FENCE.finditer(DOC.read_text())]


def test_every_block_is_a_command_that_runs_here_or_says_where_it_runs():
    text = DOC.read_text()
    found = blocks()
    assert text.count("```") == 2 * len(found)  # every fence parsed
    kinds = {(lang, tag) for lang, tag, _ in found}
    assert kinds <= {("sh", None), ("sh", "terminal-1"), ("sh", "after-stop"), ("sh", "gpu-host"), ("python", None),
                     ("text", None)}, kinds
    outside = FENCE.sub("", text)
    # No command left as an indented block outside the fences (it would not be run).
    assert not re.search(r"^ {4}(kmesh-trace|curl|python|vllm|KMESH_)", outside, re.MULTILINE)
    for lang, tag, body in found:
        if tag == "gpu-host":  # a server started on a GPU host: vLLM, or SGLang for `listen`
            assert "vllm serve" in body or "sglang.launch_server" in body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_blocks(tmp: Path) -> dict:
    """Run the page's blocks in `tmp` as the module docstring says: {"error": why it stopped early or None,
    "stopped_rc": terminal 1's exit status, "outputs": [[block, stdout, stderr], ...] of the blocks run}."""
    port_number = free_port()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own default
    env.pop("KMESH_TRACE_DIR", None)
    port = lambda body: body.replace("8000", str(port_number))  # noqa: E731
    server = None
    log = open(tmp / "terminal-1.log", "w")
    result = {"error": None, "stopped_rc": None, "outputs": []}

    def tail() -> str:
        log.flush()
        return (tmp / "terminal-1.log").read_text()[-4000:]

    def stop() -> int:
        os.killpg(server.pid, signal.SIGINT)  # Ctrl-C in terminal 1
        return server.wait(timeout=180)

    try:
        for lang, tag, body in blocks():
            if tag == "gpu-host" or lang == "text":
                continue
            if tag == "after-stop" and result["stopped_rc"] is None:
                result["stopped_rc"] = stop()
                if result["stopped_rc"] != 0:
                    result["error"] = f"terminal 1 exited with {result['stopped_rc']}:\n{tail()}"
                    return result
            if tag == "terminal-1":
                server = subprocess.Popen(["bash", "-euo", "pipefail", "-c", port(body)], cwd=tmp, env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                continue
            cmd = ["bash", "-euo", "pipefail", "-c", port(body)] if lang == "sh" else [sys.executable, "-c", body]
            try:
                r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                result["error"] = f"this block did not finish within {START_TIMEOUT_S} s:\n{body}\nserver:\n{tail()}"
                return result
            if r.returncode != 0:
                result["error"] = f"{body}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}\n{tail()}"
                return result
            result["outputs"].append([body, r.stdout, r.stderr])
        return result
    finally:
        if server is not None and server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


# The page's commands run in a process of their own (this file is its script: `python THIS_FILE OUT`, which
# writes OUT/result.json), started in the background when the collection ends (tests/background.py), so that it
# runs beside the tests before it.
PAGE = background.job(__name__, "page", lambda out: [sys.executable, __file__, out])


def test_the_worked_example_runs_as_written():
    tmp_path, proc = background.finished(PAGE)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["error"] is None, result["error"]
    assert result["stopped_rc"] == 0
    outputs = result["outputs"]

    summary = json.loads((tmp_path / "capture.json").read_text())
    (e,) = summary["engines"].values()
    assert e["complete"] and e["num_dropped_events"] == 0 and summary["signals"] == ["SIGINT"]
    assert e["rows"]["invocations"] == 4 and (e["declared_edges"], e["dangling_declared_edges"]) == (2, 0)
    assert e["exact_prefix_edges"] >= 1
    children = next(out for body, out, _ in outputs if "from openai import OpenAI" in body)
    assert [line.endswith("cached tokens: 32") for line in children.splitlines()] == [True, True]
    audit = next(out for body, out, _ in outputs if "kmesh-trace audit capture" in body)
    assert "headroom" in audit
    in_process = outputs[-1][1]  # the Python example prints the engine ids it recorded
    assert re.search(r"\['[\w.-]+-\d+-0'\]", in_process), in_process


if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "result.json").write_text(json.dumps(run_blocks(out)))
