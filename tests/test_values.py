"""The values: every outside value crosses one typed boundary (kmesh_trace.values, the
schema's domains). One test per defect class, each failing without its fix: impossible values refused
(class 2), importers keeping identity (class 3), unbounded flags and files refused in one line (class 5),
messages that name what failed (class 8)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.writer import TraceWriter

ERROR_PREFIX = "Error: "


def one_error_line(r, *needles: str) -> str:
    """The run failed with exit 1 and one `Error:` line (never 'unexpected ...'), holding each needle."""
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 1, (r.exit_code, r.stdout, r.stderr)
    assert len(lines) == 1 and lines[0].startswith(ERROR_PREFIX), r.stderr
    assert "unexpected" not in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def trace_with(path: Path, **columns) -> Path:
    """A two-request capture (block size 4) whose invocation columns are overridden by `columns`."""
    cols = {"request_id": ["a", "b"], "seq": [0, 1], "num_prompt_tokens": [8, 12],
            "prompt_token_ids": [list(range(8)), list(range(12))], "arrival_ns": [100, 200],
            "num_cached_tokens": [0, 4]}
    cols.update(columns)
    with TraceWriter(path, "e0", {"block_size": 4, "num_usable_blocks": 8}) as w:
        w.write("invocations", cols)
    return path


# ---- class 2: impossible values pass ---------------------------------------------------------------

@pytest.mark.parametrize("columns, rule", [
    ({"num_prompt_tokens": [-8, 12], "prompt_token_ids": [None, list(range(12))]}, "num_prompt_tokens >= 0"),
    ({"num_cached_tokens": [0, 40]}, "num_cached_tokens <= num_prompt_tokens"),
])
def test_an_impossible_value_is_refused_on_open_and_listed_by_the_audit(tmp_path, cli, columns, rule):
    root = trace_with(tmp_path / "t", **columns)
    for cmd in (["headroom", root, "--capacity-blocks", "4"], ["pressure", root, "--capacity-blocks", "4"],
                ["tiers", root], ["info", root]):
        one_error_line(cli(cmd), "breaks the contract", rule)
    r = cli(["audit", "capture", root, "--json"])
    assert r.exit_code == 3
    found = [p for p in json.loads(r.stdout)["problems"] if p["code"] == "out_of_domain" and rule in p["message"]]
    assert len(found) == 1 and found[0]["count"] == 1 and found[0]["severity"] == "blocking"


def test_an_importer_cannot_write_an_impossible_row(tmp_path):
    from kmesh_trace.errors import KmeshTraceError

    with TraceWriter(tmp_path / "t", "e0", {"block_size": 4}, source="import:test") as w:
        with pytest.raises(KmeshTraceError, match="outside the contract"):
            w.write("invocations", {"request_id": ["a"], "seq": [0], "num_prompt_tokens": [-1]})


def test_metadata_below_its_least_value_is_refused(tmp_path, cli):
    root = trace_with(tmp_path / "t")
    meta = root / "engines" / "e0.json"
    m = json.loads(meta.read_text())
    m["block_size"] = 0
    meta.write_text(json.dumps(m))
    one_error_line(cli(["info", root]), "block_size is 0, below its least value 1")


def _config(tmp_path, **fields) -> Path:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, **fields}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_model_config_reads_a_good_config(tmp_path):
    from kmesh_trace.oracle.tier_costs import kv_bytes_from_config

    assert kv_bytes_from_config(_config(tmp_path)) == 2 * 2 * 2 * 8 * 2  # K and V, layers, kv heads, dim, bf16


@pytest.mark.parametrize("content, needle", [
    (json.dumps({"num_hidden_layers": -3, "num_attention_heads": 4, "head_dim": 8}), "num_hidden_layers"),
    (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 0, "head_dim": 8}), "num_attention_heads"),
    (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 0, "head_dim": 8}), "num_key_value_heads"),
    (json.dumps({"num_hidden_layers": 2.5, "num_attention_heads": 4, "head_dim": 8}), "num_hidden_layers"),
    (json.dumps({"num_hidden_layers": True, "num_attention_heads": 4, "head_dim": 8}), "num_hidden_layers"),
    (json.dumps([1, 2]), "expected `object`, got `array`"),
    (json.dumps("config"), "expected `object`, got `str`"),
    (b"\xff\xfe not utf-8", "is not JSON"),
    (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4}), "neither head_dim nor hidden_size"),
    (json.dumps({"num_hidden_layers": 2, "num_attention_heads": 64, "hidden_size": 8}), "smaller than"),
    (json.dumps({"text_config": {"num_hidden_layers": -1, "num_attention_heads": 4, "head_dim": 8}}), "text_config"),
    ("[" * 100_000, "expected `object`"),
    ('{"num_hidden_layers": ' + "[" * 100_000, "model config"),
    # a shape whose KV bytes per token pass 1 TiB: one sentence, never an int64 overflow further on
    (json.dumps({"num_hidden_layers": 99999999999, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "hidden_size": 4096}), "gives 409,599,999,995,904 KV bytes per token, outside 1 to 1,099,511,627,776"),
])
def test_a_garbage_model_config_is_one_error(tmp_path, cli, content, needle):
    p = tmp_path / "config.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    one_error_line(cli(["tiers", "--scenario", "fork-tree", "--model-config", p, "--host", "16"]), needle)


def test_token_bytes_are_exact_or_one_error():
    from kmesh_trace.values import MAX_INT64, kv_bytes_refusal, token_bytes

    assert token_bytes(2**23 - 1, 2**40, "t") == (2**23 - 1) * 2**40
    assert token_bytes(MAX_INT64, 1, "t") == MAX_INT64
    with pytest.raises(KmeshTraceError, match=r"^t \(8,388,608 tokens at 1,099,511,627,776 KV bytes per token\) "
                                              r"come to 9,223,372,036,854,775,808 bytes, past the int64"):
        token_bytes(2**23, 2**40, "t")
    assert kv_bytes_refusal(2**40, "x") is None
    assert kv_bytes_refusal(2**40 + 1, "x").startswith("x gives 1,099,511,627,777 KV bytes per token")
    assert kv_bytes_refusal(0, "x").startswith("x gives 0 KV bytes per token")


def _results(tmp_path, summary, bench=None) -> Path:
    d = tmp_path / "run"
    d.mkdir()
    (d / "summary.json").write_bytes(summary if isinstance(summary, bytes) else json.dumps(summary).encode())
    if bench is not None:
        (d / "bench.json").write_text(json.dumps(bench))
    return d


GOOD_SUMMARY = {"routes": {"host": {"timer1": {"p50_ms": 2.0, "p95_ms": 4.0}}}, "store_bytes": 4 << 20,
                "num_store_restores": 2}


def test_restore_results_give_positive_throughputs(tmp_path):
    from kmesh_trace.oracle.tier_costs import restore_costs_from_results

    costs, _ = restore_costs_from_results(_results(tmp_path, GOOD_SUMMARY))
    assert costs["ssd"].gbps == pytest.approx((2 << 20) / 2e-3 / 1e9) and costs["ssd"].gbps > 0


@pytest.mark.parametrize("summary, bench, needle", [
    ({**GOOD_SUMMARY, "routes": {"host": {"timer1": {"p50_ms": -2.0}}}}, None, "timer1.p50_ms: expected `float` > 0.0"),
    ({**GOOD_SUMMARY, "store_bytes": -5}, None, "store_bytes"),
    ([GOOD_SUMMARY], None, "expected `object`, got `array`"),
    ("summary", None, "expected `object`, got `str`"),
    (b"\xff\x00", None, "not JSON"),
    ({**GOOD_SUMMARY, "routes": ["host"]}, None, "field routes"),
    (GOOD_SUMMARY, {"h2d_copy_ms_per_restore": -1.0, "bytes": 100, "files": 1}, "h2d_copy_ms_per_restore"),
    (GOOD_SUMMARY, {"h2d_copy_ms_per_restore": 1.0, "bytes": 100, "files": 0}, "files"),
])
def test_garbage_restore_results_are_one_error(tmp_path, cli, summary, bench, needle):
    d = _results(tmp_path, summary, bench)
    one_error_line(cli(["tiers", "--scenario", "fork-tree", "--restore-results", d, "--ssd", "16"]), needle)


def test_negative_restore_times_in_restores_parquet_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kmesh_trace.errors import InputFormatError
    from kmesh_trace.oracle.tier_costs import restore_costs_from_results

    d = _results(tmp_path, GOOD_SUMMARY)
    pq.write_table(pa.table({"route": ["host"], "kind": ["measured"], "num_bytes": [1 << 20], "timer1_ns": [-5],
                             "accepted": [True]}), d / "restores.parquet")
    with pytest.raises(InputFormatError, match="not positive"):
        restore_costs_from_results(d)


def test_json_output_never_holds_nan_or_infinity():
    """RFC 8259 has no NaN or Infinity: --json writes null for an undefined number (0/0)."""
    from kmesh_trace.values import json_text

    text = json_text({"ratio": math.nan, "rows": [1.5, math.inf, -math.inf], "nested": {"x": (math.nan,)}})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in JSON")) == {
        "ratio": None, "rows": [1.5, None, None], "nested": {"x": [None]}}


def test_emit_writes_strict_json(tmp_path, capsys):
    from kmesh_trace.cli.common import Output, emit

    emit(Output(json=True), {"hit_ratio": math.nan})
    assert json.loads(capsys.readouterr().out) == {"hit_ratio": None}
    emit(Output(json=True, out=tmp_path / "o.json"), {"hit_ratio": math.nan})
    assert capsys.readouterr().out == ""  # --out: the file, and nothing on stdout
    assert json.loads((tmp_path / "o.json").read_text()) == {"hit_ratio": None}


def _lineage_trace(path: Path, edges: list[tuple[str, str]]) -> Path:
    ids = sorted({x for e in edges for x in e})
    with TraceWriter(path, "e0", {"block_size": 4, "num_usable_blocks": 8}) as w:
        w.write("invocations", {"request_id": ids, "seq": list(range(len(ids))), "num_prompt_tokens": [8] * len(ids),
                                "prompt_token_ids": [list(range(8))] * len(ids), "arrival_ns": list(range(len(ids)))})
        w.write("lineage", {"child_request_id": [c for c, _ in edges], "parent_request_id": [p for _, p in edges],
                            "declared_parent_id": [p for _, p in edges], "edge_kind": ["declared"] * len(edges)})
    return path


def test_a_lineage_cycle_is_found_by_the_audit_and_refused_by_the_report(tmp_path, cli):
    root = _lineage_trace(tmp_path / "t", [("a", "c"), ("b", "a"), ("c", "b"), ("d", "a")])
    r = cli(["audit", "capture", root, "--json"])
    cycles = [p for p in json.loads(r.stdout)["problems"] if p["code"] == "lineage_cycle"]
    assert r.exit_code == 3 and len(cycles) == 1 and cycles[0]["severity"] == "blocking"
    one_error_line(cli(["lineage", root]), "1 cycle(s)", "cannot be its own ancestor")


def test_a_self_parent_is_reported_not_dropped(tmp_path, cli):
    root = _lineage_trace(tmp_path / "t", [("a", "a"), ("b", "a")])
    r = cli(["audit", "capture", root, "--json"])
    found = [p for p in json.loads(r.stdout)["problems"] if p["code"] == "lineage_self_parent"]
    assert len(found) == 1 and found[0]["locations"] == ["lineage:e0:a<-a"]
    r = cli(["lineage", root, "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["num_self_parent_edges"] == 1 and d["num_dangling_edges"] == 0 and d["num_edges"] == 1
    assert any("own parent" in n for n in d["notes"])


def test_lineage_cycles_helper():
    from kmesh_trace.lineage import lineage_cycles

    assert lineage_cycles({"a": "b", "b": "c", "c": "a", "d": "d", "e": "a", "f": None}) == (["d"], [["a", "b", "c"]])
    chain = {i: i - 1 for i in range(1, 200_000)}  # deep but acyclic: linear, no recursion
    assert lineage_cycles(chain) == ([], [])


# ---- class 3: importers invent or lose identity ------------------------------------------------------

def _weka(tmp_path, requests, name="c.json", **top) -> Path:
    d = tmp_path / "src"
    d.mkdir(parents=True, exist_ok=True)
    # Compact, as kv-cache-tester writes it: the form whose id lists the fast path cuts out.
    (d / name).write_text(json.dumps({"id": name, "block_size": 4, "requests": requests, **top}, separators=(",", ":")))
    return d


def _req(t=0.0, n=8, ids=(1, 2)):
    return {"type": "n", "t": t, "in": n, "out": 1, "hash_ids": list(ids)}


@pytest.mark.parametrize("fast", [True, False])
def test_weka_an_anonymous_subagent_after_one_named_like_it_keeps_ids_unique(tmp_path, fast):
    import polars as pl

    from kmesh_trace.datasets.importers.weka import import_weka
    from kmesh_trace.trace import open_trace

    reqs = [_req(), {"type": "subagent", "t": 1.0, "agent_id": "sub2", "requests": [_req()]},
            {"type": "subagent", "t": 2.0, "requests": [_req()]},
            {"type": "subagent", "t": 3.0, "agent_id": "m", "requests": [_req()]}]
    import_weka(_weka(tmp_path, reqs), tmp_path / "t", fast=fast)
    with open_trace(tmp_path / "t") as t:
        ids = t.frame("invocations").get_column("request_id").to_list()
    assert len(ids) == len(set(ids)) == 4
    assert set(ids) == {"c.json/m/0", "c.json/sub2/0", "c.json/sub2.1/0", "c.json/sub3/0"}


@pytest.mark.parametrize("outside", [
    {"hash_ids": [7, 8]},  # a list at the top of the file
    {"meta": {"hash_ids": [7, 8]}},
])
@pytest.mark.parametrize("forged", [-1, -2])
def test_weka_fast_path_never_borrows_an_id_list_from_outside_the_request(tmp_path, outside, forged):
    """A request whose hash_ids is the number the fast path used as a placeholder stays malformed on
    both paths (the fast path once read the ids of a list elsewhere in the file for it: list k was
    -1-k, so -2 named the second list, the one outside any request)."""
    from kmesh_trace.datasets.importers.weka import import_weka

    bad = {"type": "n", "t": 0.0, "in": 8, "out": 1, "hash_ids": forged}
    reports = [import_weka(_weka(tmp_path / str(fast), [bad, _req(1.0)], **outside), tmp_path / f"t{fast}", fast=fast)
               for fast in (True, False)]
    for r in reports:
        assert (r.num_invocations, r.num_malformed_entries) == (1, 1)
        assert r.malformed_lines == ["c.json: requests[0]: field hash_ids missing or not a list"]


def test_weka_an_unreadable_file_is_counted_and_the_rest_imported(tmp_path):
    import os

    from kmesh_trace.datasets.importers.weka import import_weka

    d = _weka(tmp_path, [_req()], name="a.json")
    _weka(tmp_path, [_req()], name="b.json")
    bad = d / "b.json"
    os.chmod(bad, 0)
    try:
        if os.access(bad, os.R_OK):
            pytest.skip("running as a user who reads any file (root): no unreadable file to make")
        r = import_weka(d, tmp_path / "t")
    finally:
        os.chmod(bad, 0o644)
    assert (r.num_files, r.num_unreadable_files, r.num_invocations) == (2, 1, 1)
    assert r.malformed_lines == ["b.json: unreadable (Permission denied)"]


def test_weka_a_read_error_is_counted_and_the_rest_imported(tmp_path):
    """A disk error reading one file (as root, permissions cannot stage it): counted, the others imported."""
    from kmesh_trace.datasets.importers import weka

    d = _weka(tmp_path, [_req()], name="a.json")
    _weka(tmp_path, [_req()], name="b.json")
    real = Path.read_bytes

    def failing(self):
        if self.name == "b.json":
            raise OSError(5, "Input/output error", str(self))
        return real(self)

    mp = pytest.MonkeyPatch()
    mp.setattr(Path, "read_bytes", failing)
    try:
        r = weka.import_weka(d, tmp_path / "t")
    finally:
        mp.undo()
    assert (r.num_unreadable_files, r.num_invocations) == (1, 1)


def test_lmcache_agent_an_empty_directory_is_refused(tmp_path, cli):
    (tmp_path / "src" / "source-a").mkdir(parents=True)
    one_error_line(cli(["import", "lmcache-agent", tmp_path / "src", "--out", tmp_path / "t"]), "holds no .jsonl")
    assert not (tmp_path / "t").exists()


def test_weka_ids_parse_as_json_would():
    from kmesh_trace.datasets.importers.weka import _NotFast, parse_id_lists

    assert parse_id_lists(b"0,1,9223372036854775807").tolist() == [0, 1, (1 << 63) - 1]
    for bad in (b"9223372036854775808", b"01", b"1,,2", b",1", b"1,", b"99999999999999999999"):
        with pytest.raises(_NotFast):
            parse_id_lists(bad)


# ---- class 5: flags and files unbounded ---------------------------------------------------------------

@pytest.mark.parametrize("args, flag", [
    (["tiers", "--scenario", "fork-tree", "--within", "nan", "--sweep-host", "0,8"], "--within"),
    (["tiers", "--scenario", "fork-tree", "--host", "8", "--early-prep", "--prep-lead-s", "inf"], "--prep-lead-s"),
    (["tiers", "--scenario", "fork-tree", "--host", "8", "--host-gbps", "nan"], "--host-gbps"),
    (["tiers", "--scenario", "fork-tree", "--host", "8", "--host-gbps", "2", "--host-latency-ms", "-1"], "--host-latency-ms"),
    (["tiers", "--scenario", "fork-tree", "--host", "8", "--ssd-gbps", "-2"], "--ssd-gbps"),
    (["tiers", "--scenario", "fork-tree", "--gpu-blocks", "0"], "--gpu-blocks"),
    (["fleet", "x", "--overload", "inf"], "--overload"),
    (["pressure", "--scenario", "hold-stress", "--expiry-s", "1e300"], "--expiry-s"),
    (["headroom", "--scenario", "fork-tree", "--prefill-tokens-per-s", "nan"], "--prefill-tokens-per-s"),
    (["headroom", "--scenario", "fork-tree", "--attention-factor", "-inf"], "--attention-factor"),
    (["replay", "run", "x", "--depth", "0"], "--depth"),
    (["replay", "prepare", "--out", "x", "--chunks", "-1"], "--chunks"),
    (["import", "lmcache-agent", "x", "--out", "y", "--block-size", "0"], "--block-size"),
    (["import", "weka", "x", "--out", "y", "--engine-id", "evil\n"], "--engine-id"),
    (["import", "weka", "x", "--out", "y", "--engine-id", "a\x1b[31mb"], "--engine-id"),
])
def test_a_flag_outside_its_domain_is_refused_naming_it(cli, args, flag):
    one_error_line(cli(args), f"Invalid value for '{flag}'")


def test_sql_memory_limit_beyond_any_machine_is_one_error(tmp_path, cli):
    root = trace_with(tmp_path / "t")
    one_error_line(cli(["sql", root, "SELECT 1", "--memory-limit", "18446744073709551616"]), "--memory-limit must be at most")


@pytest.mark.parametrize("fast", [True, False])
def test_weka_huge_times_are_malformed_entries_not_a_crash(tmp_path, fast):
    from kmesh_trace.datasets.importers.weka import import_weka

    reqs = [_req(), _req(t=1e300), {**_req(1.0), "api_time": 1e300},
            {"type": "subagent", "t": 1e300, "requests": [_req()]}]
    r = import_weka(_weka(tmp_path, reqs), tmp_path / "t", fast=fast)
    assert (r.num_invocations, r.num_malformed_entries) == (1, 3)


def test_weka_a_stagger_beyond_the_clock_is_refused(cli, tmp_path):
    d = _weka(tmp_path, [_req()])
    one_error_line(cli(["import", "weka", d, "--out", tmp_path / "t", "--arrival", "stagger:1e300"]), "--arrival")


def test_lmcache_agent_a_huge_timestamp_leaves_the_arrival_unknown(tmp_path):
    from kmesh_trace.datasets.importers.lmcache_agent import import_lmcache_agent

    src = tmp_path / "src" / "s"
    src.mkdir(parents=True)
    (src / "a.jsonl").write_text(json.dumps({"input": "hi", "output": "yo", "timestamp": 1e300}) + "\n")
    r = import_lmcache_agent(tmp_path / "src", tmp_path / "t")
    assert (r.num_invocations, r.num_records_without_timestamp) == (1, 1)


def test_a_negative_restore_id_in_a_journal_is_refused(tmp_path):
    import pyarrow.parquet as pq

    from kmesh_trace.native.store import JOURNAL, StoreError, open_store, plan_uniform, prepare

    prepare(tmp_path / "s", plan_uniform(1, 1, 4096))
    j = pq.read_table(tmp_path / "s" / JOURNAL)
    ids = j.column("restore_id").to_pylist()
    j = j.set_column(j.schema.get_field_index("restore_id"), j.schema.field("restore_id"),
                     __import__("pyarrow").array([-1 - i for i in ids], j.schema.field("restore_id").type))
    pq.write_table(j, tmp_path / "s" / JOURNAL)
    with pytest.raises(StoreError, match="must be integers >= 0"):
        open_store(tmp_path / "s")


def test_a_directory_nested_1100_deep_is_walked(tmp_path, cli):
    import os

    d = tmp_path / "corpus" / "src"
    d.mkdir(parents=True)
    fd = os.open(d, os.O_RDONLY)
    try:  # build it relative to an fd: the absolute path exceeds PATH_MAX
        for _ in range(1100):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        w = os.open("x.jsonl", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(w, b'{"input": "a", "output": "b"}\n')
        os.close(w)
    finally:
        os.close(fd)
    from kmesh_trace.audit.inventory import walk

    try:
        inv = walk(tmp_path / "corpus")
        assert len(inv.sources["src"].jsonl) == 1 and len(inv.directories) == 1101
    finally:  # remove it bottom-up here: pytest's recursive clean-up of old tmp dirs cannot go 1,100 deep
        fds = [os.open(d, os.O_RDONLY)]
        for _ in range(1100):
            fds.append(os.open("d", os.O_RDONLY, dir_fd=fds[-1]))
        os.unlink("x.jsonl", dir_fd=fds[-1])
        for parent, child in zip(reversed(fds[:-1]), reversed(fds[1:])):
            os.close(child)
            os.rmdir("d", dir_fd=parent)
        os.close(fds[0])


# ---- class 8: messages ---------------------------------------------------------------------------------

def test_an_interrupted_import_speaks_of_the_import(tmp_path, cli):
    root = trace_with(tmp_path / "t")
    meta = root / "engines" / "e0.json"
    m = json.loads(meta.read_text())
    m.update(complete=False, source="import:weka")
    meta.write_text(json.dumps(m))
    line = one_error_line(cli(["pressure", root, "--capacity-blocks", "4"]), "weka import never finished")
    assert "Rerun the capture" not in line


def test_a_read_error_inside_a_jsonl_file_names_the_file(tmp_path, monkeypatch):
    from kmesh_trace.datasets.importers import common
    from kmesh_trace.errors import InputFormatError

    p = tmp_path / "m.jsonl"
    p.write_text('{"a": 1}\n' * 3)

    def broken(*a, **k):
        yield 1, b'{"a": 1}'
        raise OSError(5, "Input/output error")  # what a failing disk gives a reader mid-file: no file name

    monkeypatch.setattr(common, "_lines", broken)
    rep = common.ImportReport("x", str(p), "o", "e")
    with pytest.raises(InputFormatError, match=f"cannot read {p}: Input/output error"):
        list(common.iter_records(p, rep))


def test_a_tier_capacity_beyond_int64_blocks_is_one_error():
    from kmesh_trace.oracle.tier_costs import parse_capacity

    with pytest.raises(KmeshTraceError, match="at most"):
        parse_capacity("99999999999999999999", None, "--host")
    with pytest.raises(KmeshTraceError, match="at most"):
        parse_capacity("999999999999999999999TiB", 16, "--host")


@pytest.mark.parametrize("text", ["9" * 5000, "9" * 400 + "GiB", "1" + "0" * 400 + ".5TB"])
def test_a_capacity_of_hundreds_of_digits_is_one_error(text):
    from kmesh_trace.oracle.tier_costs import parse_capacity

    with pytest.raises(KmeshTraceError, match="must be at most"):
        parse_capacity(text, 16, "--capacity")
