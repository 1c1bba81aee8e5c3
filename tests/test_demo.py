"""The main job end to end (reduced size): a real CPU vLLM engine under capture, then the report.

The report must agree with the same analyses run separately on the captured trace, and the
Perfetto timeline must validate and match the invocations table.
"""

import json
import sys

import pytest

import background  # tests/ is on sys.path
from kmesh_trace import open_trace

pytestmark = pytest.mark.engine


# A subprocess, as a user runs it: the engine and its capture live and end with the command. It starts in
# the background when the collection ends (tests/background.py), so it runs beside the tests before this module.
DEMO = background.job(__name__, "demo", lambda out: [sys.executable, "-m", "kmesh_trace.cli", "demo", "--out", out,
                                                     "--size", "small"],
                      env={"VLLM_LOGGING_LEVEL": "WARNING"})


@pytest.fixture(scope="module")
def demo():
    out, proc = background.finished(DEMO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def test_demo_writes_every_artifact(demo):
    out, proc = demo
    for name in ("report.json", "report.html", "headroom.png", "headroom.svg", "pressure.png", "pressure.svg", "timeline.json",
                 "trace/kmesh_trace.json"):
        assert (out / name).is_file(), name
    assert (out / "headroom.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Headroom at the engine's" in proc.stdout and "Retention pressure" in proc.stdout
    # The panel's pool size says how many blocks are usable, the count every table gives.
    report = json.loads((out / "report.json").read_text())["workload"]
    usable = f"{report['num_usable_blocks']} usable: vLLM keeps one as its null block"
    assert report["num_usable_blocks"] == report["num_gpu_blocks"] - 1
    assert usable in " ".join(proc.stdout.replace("│", " ").split()), proc.stdout[:2000]


def test_capture_is_complete_and_matches_the_engine(demo):
    out, _ = demo
    report = json.loads((out / "report.json").read_text())
    assert report["capture_check"]["ok"], report["capture_check"]
    trace = open_trace(out / "trace")
    (meta,) = trace.engines.values()
    assert meta["complete"] is True
    assert sum(meta["num_dropped_events"].values()) == 0
    assert trace.row_counts() == report["info"]["tables"]
    assert report["info"]["tables"]["invocations"] == report["workload"]["num_requests"]
    # The pool was small enough to evict.
    assert trace.sql("SELECT count(*) AS n FROM block_events WHERE event = 'evicted'")["n"][0] > 0


def test_report_agrees_with_the_commands_run_separately(demo, cli):
    """What the demo printed is what `kmesh-trace audit capture|headroom|pressure --json` say."""
    out, _ = demo
    report = json.loads((out / "report.json").read_text())
    trace = out / "trace"

    def run(*args):
        r = cli(list(args))
        assert r.exit_code in (0, 3), r.stderr
        return json.loads(r.stdout)

    assert run("audit", "capture", trace, "--json")["verdict"] == report["audit"]["verdict"]
    caps = ",".join(map(str, report["headroom"]["capacities"]))
    hr = run("headroom", trace, "--capacity-blocks", caps, "--policies", "lru,vllm,belady", "--json")
    # The command also gives seconds (a prefill cost fitted to the capture); the report gives tokens.
    assert [{k: v for k, v in r.items() if k != "prefill_seconds"} for r in hr["results"]] == report["headroom"]["results"]
    assert hr["headroom_tokens"] == report["headroom"]["headroom_tokens"]
    pr = run("pressure", trace, "--json")
    for key in ("saved_child_tokens", "displaced_hit_tokens", "net_cached_tokens", "arms", "holds", "num_families"):
        assert pr[key] == report["pressure"][key], key
    sweep = run("pressure", trace, "--capacity-blocks", caps, "--json")["sweep"]
    assert sweep == report["pressure_sweep"]
    # Belady is a bound: never more prefill than the engine itself computed.
    stock = next(r for r in report["headroom"]["results"] if r["policy"] == "stock")
    bound = next(r for r in report["headroom"]["results"]
                 if r["policy"] == "belady" and r["capacity_blocks"] == stock["capacity_blocks"])
    assert bound["prefill_tokens"] <= stock["prefill_tokens"]
    # The report's token totals are the engine's own: the captured stock equals the RequestOutputs' sum.
    info = run("sql", trace, "SELECT sum(num_prompt_tokens) - sum(num_cached_tokens) AS p FROM invocations", "--format", "json")
    assert info == [{"p": stock["prefill_tokens"]}]


def test_timeline_validates_and_matches_invocations(demo):
    from kmesh_trace.apps.perfetto import validate_trace_events

    out, _ = demo
    events = json.loads((out / "timeline.json").read_text())
    assert validate_trace_events(events) == []
    inv = open_trace(out / "trace").frame("invocations")
    phases = {("queued", "arrival_ns", "first_scheduled_ns"), ("prefill", "first_scheduled_ns", "first_token_ns"),
              ("decode", "first_token_ns", "finish_ns")}
    slices = {(e["name"], e["args"]["request_id"]): e for e in events["traceEvents"] if e.get("ph") == "X" and "request_id" in e.get("args", {})}
    for name, start, end in phases:
        for row in inv.to_dicts():
            e = slices[(name, row["request_id"])]
            assert e["dur"] == pytest.approx((row[end] - row[start]) / 1000, abs=1e-3)
    # Starts on one axis: each request's prefill begins where its queued slice ends.
    for rid in inv["request_id"].to_list():
        q, p = slices[("queued", rid)], slices[("prefill", rid)]
        assert q["ts"] + q["dur"] == pytest.approx(p["ts"], abs=1e-3)


def test_demo_page_opens_in_chromium_with_the_reports_numbers(demo, tmp_path):
    """The demo's HTML page in a real headless Chromium: no console message, not blank, and its headroom
    and pressure tables are the report's (which the test above ties to the commands' --json)."""
    from browser import chromium, load
    from report_page import ReportPage

    if chromium() is None:
        pytest.skip("no Chromium installed: `apt-get install -y chromium` (make install-browser)")
    out, _ = demo
    report = json.loads((out / "report.json").read_text())
    loaded = load(out / "report.html", tmp_path / "page.png")
    assert loaded.console == []
    dom = ReportPage()
    dom.feed(loaded.dom)
    # The page pivots headroom as the CLI does: one row per capacity, one column per policy.
    page = {r["capacity_blocks"]: r for r in dom.records("headroom-pivot")}
    for r in report["headroom"]["results"]:  # the page adds the infinite cache to the report's policies
        assert page[r["capacity_blocks"]][r["policy"]] == r["hit_ratio"]
    assert {r["arm"]: r["hit_tokens"] for r in dom.records("pressure-arms")} == {
        arm: report["pressure"]["arms"][arm]["hit_tokens"] for arm in ("stock", "held")}
    assert dom.records("lineage-summary")[0]["num_edges"] == report["workload"]["num_children"]


def test_the_demo_ends_with_the_exact_next_commands(tmp_path):
    """Not on PATH (a fresh `make demo`): every command names the executable by its real path, and the
    activate script beside it; on PATH: plain `kmesh-trace`."""
    from kmesh_trace.cli.demo import CPU_SERVE_FLAGS, SERVE, next_steps

    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "kmesh-trace"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    (bin_dir / "activate").write_text("")
    lines = next_steps("demo-out/report.html", "demo-out/trace", argv0=str(exe), path="/usr/bin")
    assert lines[2] == f"  kmesh-trace is not on PATH: run it as {exe}, or `source {bin_dir / 'activate'}` first"
    assert f"  {exe} capture --out my-trace -- {SERVE}{CPU_SERVE_FLAGS}" in lines
    assert f"  {exe} advise demo-out/trace   # the answer: what to change or buy, rung by rung" in lines
    assert f"  {exe} advise my-trace" in lines
    assert f"  {exe} report my-trace --out my-report.html" in lines
    assert any(line.startswith("  open demo-out/report.html") for line in lines)
    on_path = next_steps("p.html", "t", argv0=str(exe), path=str(bin_dir))
    assert "  kmesh-trace report my-trace --out my-report.html" in on_path
    assert not any("not on PATH" in line for line in on_path)
