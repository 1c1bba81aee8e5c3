"""Empty is an error, words mean one thing, files are written alike (the report and the terminal).

- An import that read input but produced no request exits 1 saying why, and leaves nothing behind;
  every analysis of a trace with no requests says so and exits 1.
- Prefill seconds come only from a usable fit (r2 and median relative error thresholds), else the
  output says why they are missing and how to give a throughput.
- `fleet` says when least-loaded has no load signal (and then equals round-robin).
- A plot file has the permissions of the HTML and JSON beside it (the umask's).
"""

from __future__ import annotations

import json
import os

import pytest

from kmesh_trace.datasets.workloads.fork_tree import fork_tree_rows
from kmesh_trace.oracle.prefill_cost import MAX_USABLE_MEDIAN_RELATIVE_ERROR, MIN_USABLE_R2, PrefillCost
from kmesh_trace.writer import TraceWriter

WEKA_CONVERSATION = {"id": "c", "block_size": 4, "hash_id_scope": "local",
                     "requests": [{"t": 0.0, "type": "n", "in": 8, "out": 3, "hash_ids": [1, 2], "api_time": 1.0}]}


@pytest.mark.parametrize("fmt, content, why", [
    ("mooncake", json.dumps(WEKA_CONVERSATION) + "\n", "every record is malformed (1; most often 'field timestamp"),
    ("mooncake", "\n\n", "it holds no records"),
    ("weka", '{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n',
     "every record is malformed"),
])
def test_an_import_with_no_request_exits_1_saying_why(cli, tmp_path, fmt, content, why):
    if fmt == "weka":
        src = tmp_path / "src"
        src.mkdir()
        (src / "x.json").write_text(content)
    else:
        src = tmp_path / "x.jsonl"
        src.write_text(content)
    r = cli(["import", fmt, src, "--out", tmp_path / "t"])
    assert r.exit_code == 1 and r.stderr.strip().startswith("Error: ") and why in r.stderr, r.stderr
    assert "Nothing was written" in r.stderr or "nothing was written" in r.stderr
    assert not (tmp_path / "t").exists()  # the import made it, and nothing usable is in it


def test_an_empty_import_into_an_existing_trace_leaves_the_trace_as_it_was(cli, tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_text('{"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [1, 2]}\n')
    assert cli(["import", "mooncake", src, "--out", tmp_path / "t"]).exit_code == 0
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "t").rglob("*"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    r = cli(["import", "mooncake", bad, "--out", tmp_path / "t", "--engine-id", "second"])
    assert r.exit_code == 1 and "broken JSON" in r.stderr
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "t").rglob("*")) == before


@pytest.fixture
def empty_trace(tmp_path):
    with TraceWriter(tmp_path / "empty", "e0", {"block_size": 16, "num_usable_blocks": 64}):
        pass
    return tmp_path / "empty"


@pytest.mark.parametrize("command", [
    ["headroom"], ["headroom", "--capacity-blocks", "8"], ["pressure"], ["lineage"], ["tiers"], ["fleet"], ["report"],
])
def test_every_analysis_of_a_trace_with_no_requests_says_so_and_exits_1(cli, tmp_path, empty_trace, command):
    extra = ["--out", str(tmp_path / "r.html")] if command == ["report"] else []
    r = cli([command[0], empty_trace, *command[1:], *extra])
    assert r.exit_code == 1, r.stdout
    assert r.stderr.strip().startswith("Error: ") and "has no requests" in r.stderr, r.stderr
    assert r.stdout == ""


def test_a_fit_is_usable_only_above_the_thresholds():
    good = PrefillCost(1e-4, 0, 1e-3)
    start, end = [0] * 8, [100 * (k + 1) for k in range(8)]
    _, rep = PrefillCost.fit_points(start, end, [good.seconds(s, e) for s, e in zip(start, end)])
    assert rep.usable and rep.why_unusable is None and rep.to_json()["usable"] is True
    # Seconds that do not follow the tokens: the fit explains little and errs a lot.
    noisy = [0.5, 0.01, 0.3, 0.02, 0.6, 0.01, 0.4, 0.9]
    _, rep = PrefillCost.fit_points(start, end, noisy)
    assert not rep.usable
    assert rep.r2 < MIN_USABLE_R2 or rep.median_relative_error > MAX_USABLE_MEDIAN_RELATIVE_ERROR
    assert "not usable" in rep.why_unusable and "--prefill-tokens-per-s" in rep.why_unusable
    assert f"< {MIN_USABLE_R2}" in rep.why_unusable or "median relative error" in rep.why_unusable


def _timed_fork_tree(path, jitter: bool):
    """The fork tree with measured prefills: exact 10 us per token, or seconds unrelated to the tokens."""
    rows = fork_tree_rows()
    noisy = [5, 900, 700, 3, 800, 10]
    for k, row in enumerate(rows):
        row["num_cached_tokens"] = 0
        ms = noisy[k] if jitter else 1 + row["num_prompt_tokens"] * 0.01
        row["first_token_ns"] = row["first_scheduled_ns"] + int(ms * 1e6)
    with TraceWriter(path, "e0", {"block_size": 16, "num_usable_blocks": 512}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    return path


def test_headroom_prints_seconds_only_from_a_usable_fit(cli, tmp_path):
    good = _timed_fork_tree(tmp_path / "good", jitter=False)
    r = cli(["headroom", good, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["prefill_cost_fit"]["usable"] and "ttft_estimate_seconds" in d
    bad = _timed_fork_tree(tmp_path / "bad", jitter=True)
    r = cli(["headroom", bad, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert "ttft_estimate_seconds" not in d and "prefill_cost" not in d
    assert d["prefill_cost_fit"]["usable"] is False and "--prefill-tokens-per-s" in d["prefill_cost_fit"]["why_unusable"]
    assert "not usable" in r.stderr and "--prefill-tokens-per-s" in r.stderr.replace("\n", " ")
    r = cli(["headroom", bad])
    assert "headroom_s" not in r.stdout and "estimated prefill seconds" not in r.stdout
    r = cli(["tiers", bad, "--host", "64", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["prefill_model"] is None and "not usable" in d["prefill"] and d["prefill_fit"]["usable"] is False


def _trace(path, timed: bool):
    rows = fork_tree_rows()
    if not timed:
        for row in rows:
            row["finish_ns"] = None
    with TraceWriter(path, "e0", {"block_size": 16, "num_usable_blocks": 512}) as w:
        w.write("invocations", {k: [r[k] for r in rows] for k in rows[0]})
    return path


def test_fleet_says_when_least_loaded_has_no_load_signal(cli, tmp_path):
    r = cli(["fleet", _trace(tmp_path / "untimed", timed=False), "--engines", "2", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert not d["timed"] and "least-loaded has no load signal" in d["notes"][0]
    runs = {x["policy"]: x for x in d["points"][0]["runs"]}
    assert runs["least-loaded"]["hit_tokens"] == runs["round-robin"]["hit_tokens"]  # what the note says
    r = cli(["fleet", tmp_path / "untimed", "--engines", "2"])
    assert "least-loaded has no load signal" in r.stderr.replace("\n", " ")
    r = cli(["fleet", _trace(tmp_path / "timed", timed=True), "--engines", "2", "--json"])
    assert json.loads(r.stdout)["notes"] == []


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_a_plot_has_the_permissions_of_the_files_beside_it(cli, tmp_path, umask):
    trace = _trace(tmp_path / "t", timed=True)
    old = os.umask(umask)
    try:
        r = cli(["headroom", trace, "--capacity-blocks", "64,128", "--out", tmp_path / "h.json",
                 "--plot", tmp_path / "h.png"])
        assert r.exit_code == 0, r.stderr
        assert cli(["report", trace, "--out", tmp_path / "r.html"]).exit_code == 0
    finally:
        os.umask(old)
    modes = {name: (tmp_path / name).stat().st_mode & 0o777 for name in ("h.json", "h.png", "r.html")}
    assert set(modes.values()) == {0o666 & ~umask}, modes
