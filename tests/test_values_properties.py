"""Property tests of the boundary: random and hostile input to every importer and every file
the tools read never raises outside the one error path (KmeshTraceError), never yields a value outside
the schema's domains, and the weka fast and plain paths agree on nested structures. Examples are few
(the suite runs on two cores); each property is checked on the input classes that broke it before."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmesh_trace import schema
from kmesh_trace.errors import KmeshTraceError

FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5))
json_values = st.recursive(json_scalars, lambda kids: st.one_of(st.lists(kids, max_size=3),
                                                                st.dictionaries(st.text(max_size=4), kids, max_size=3)),
                           max_leaves=8)
hostile_numbers = st.one_of(st.integers(-5, 50), st.sampled_from([-1, 0, 2**40, 2**63, 2**64, 1e300, -1e300, 0.5, True,
                                                                  None, "7", [1], {"a": 1}]))


# ---- weka: nested conversations, fast and plain paths ----------------------------------------------

def _ids(draw, n_in, block):
    n = n_in // block if type(n_in) is int and 0 < n_in < 10_000 else 1
    kind = draw(st.sampled_from(["ok", "ok", "ok", "ok", "neg", "huge", "zero_lead", "placeholder", "str", "short"]))
    base = draw(st.integers(0, 2**40 - 100))
    ids = list(range(base, base + n))
    if kind == "neg" and ids:
        ids[0] = -3
    elif kind == "huge" and ids:
        ids[-1] = 2**64 + 1
    elif kind == "placeholder":
        return draw(st.sampled_from([-1, -2, -(2**52), 0]))  # what a forged placeholder would be
    elif kind == "str":
        return "1,2"
    elif kind == "short":
        ids = ids[:-1]
    return ids


@st.composite
def weka_entries(draw, depth=0):
    entries = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["n", "n", "n", "subagent" if depth < 3 else "n", "junk"]))
        t = draw(st.one_of(st.floats(0, 100, allow_nan=False), st.sampled_from([-1.0, 1e300, 0, "3"])))
        if kind == "junk":
            entries.append(draw(st.one_of(json_values, st.just({"type": "x", "t": 1}))))
        elif kind == "subagent":
            e = {"type": "subagent", "t": t, "requests": draw(weka_entries(depth + 1))}
            agent = draw(st.one_of(st.none(), st.sampled_from(["sub1", "sub2", "sub3", "m", "a/b", "x", "sub2.1", ""])))
            if agent is not None:
                e["agent_id"] = agent
            if draw(st.booleans()):
                e["hash_ids"] = [5, 6]  # an id list where no request is: ignored by both paths
            entries.append(e)
        else:
            n_in = draw(hostile_numbers)
            e = {"type": "n", "t": t, "in": n_in, "out": draw(hostile_numbers), "hash_ids": _ids(draw, n_in, 4)}
            for key in ("api_time", "ttft"):
                if draw(st.booleans()):
                    e[key] = draw(st.one_of(st.floats(0, 10, allow_nan=False), st.sampled_from([-1, 1e300, "x"])))
            if draw(st.integers(0, 5)) == 0:
                e["extra"] = {"hash_ids": [9, 9]}
            entries.append(e)
    return entries


@st.composite
def weka_files(draw) -> bytes:
    conv = {"id": "c", "block_size": 4, "requests": draw(weka_entries()),
            "hash_id_scope": draw(st.sampled_from([None, "local", "global"]))}
    if draw(st.integers(0, 4)) == 0:
        conv["hash_ids"] = [1, 2]
    # Compact, the form whose id lists the fast path cuts out; now and then a space that keeps a list in.
    text = json.dumps(conv, separators=(",", ":")).encode()
    if draw(st.integers(0, 6)) == 0:
        text = text.replace(b'"hash_ids":[', b'"hash_ids": [', draw(st.integers(1, 3)))
    if draw(st.integers(0, 6)) == 0:
        text = text.replace(b",", b", ", 1)
    return text


def _shape(got):
    if isinstance(got, str):
        return got
    top, reader, values = got
    return (top, sorted(reader.bad), [(r.t, r.thread, r.where, r.n_in, r.n_out, r.api_time, r.ttft,
                                       values[r.start:r.end].tolist()) for r in sorted(reader.reqs, key=lambda r: r.where)],
            [(t.number, t.parent, t.start, t.agent_id, t.label) for t in reader.threads])


@FEW
@given(weka_files())
def test_weka_fast_and_plain_paths_agree_and_stay_in_domain(data):
    from kmesh_trace.datasets.importers.weka import MAX_SECONDS, _file_table, read_conversation

    fast = read_conversation(data, "c.json", 0, None, set(), fast=True)
    plain = read_conversation(data, "c.json", 0, None, set(), fast=False)
    assert _shape(fast) == _shape(plain)
    if isinstance(plain, str):
        return
    top, reader, values = plain
    table, edges = _file_table(top["id"], reader, values, 0, 0.0, top["block_size"])
    assert schema.domain_violations("invocations", table) == []
    ids = table.column("request_id").to_pylist()
    assert len(ids) == len(set(ids)), ids  # identity never invented twice
    labels = [t.label for t in reader.threads]
    assert len(labels) == len(set(labels))
    assert all(r.n_in >= 1 and r.t <= MAX_SECONDS for r in reader.reqs)
    for col in ("arrival_ns", "first_token_ns", "finish_ns"):
        assert all(0 <= v < 2**63 for v in table.column(col).to_pylist() if v is not None)
    assert {e["parent_request_id"] for e in edges} <= set(ids)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(weka_files(), min_size=1, max_size=3))
def test_weka_import_never_raises_outside_the_error_path(tmp_path_factory, files):
    from kmesh_trace.datasets.importers.weka import import_weka

    d = tmp_path_factory.mktemp("w")
    for i, data in enumerate(files):
        (d / f"{i}.json").write_bytes(data.replace(b'"id": "c"', f'"id": "c{i}"'.encode()))
    try:
        r = import_weka(d, d.parent / (d.name + "-t"))
    except KmeshTraceError:
        return
    assert r.num_invocations >= 0 and r.num_files == len(files)


# ---- lmcache-agent ------------------------------------------------------------------------------------

lm_records = st.fixed_dictionaries({}, optional={
    "input": st.one_of(st.text(max_size=20), json_values), "output": st.one_of(st.text(max_size=10), json_values),
    "timestamp": st.one_of(st.floats(allow_nan=False), st.integers(-2**70, 2**70), st.sampled_from([1e300, -1e300])),
    "session_id": st.one_of(st.none(), st.sampled_from(["s1", "s2"]), json_values)})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(lm_records.map(lambda r: json.dumps(r).encode()),
                          st.sampled_from([b"", b"{", b"[1]", b"\xff\xfe", b'{"input": NaN}'])), min_size=1, max_size=6))
def test_lmcache_agent_import_keeps_values_in_domain(tmp_path_factory, lines):
    from kmesh_trace.datasets.importers.lmcache_agent import import_lmcache_agent
    from kmesh_trace.trace import open_trace

    d = tmp_path_factory.mktemp("lm")
    (d / "src").mkdir()
    (d / "src" / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    out = d.parent / (d.name + "-t")
    try:
        r = import_lmcache_agent(d, out)
    except KmeshTraceError:
        return
    with open_trace(out) as t:  # opening enforces the domains: an impossible value would raise here
        inv = t.frame("invocations")
    assert inv.height == r.num_invocations
    assert all(v is None or abs(v) < 2**63 for v in inv.get_column("arrival_ns").to_list())


# ---- files the tools read: config.json, replay results, journals ----------------------------------------

def _mutated(good: dict, draw) -> object:
    choice = draw(st.integers(0, 3))
    if choice == 0:
        return draw(json_values)
    obj = dict(good)
    for key in draw(st.lists(st.sampled_from(sorted(good) + ["text_config"]), max_size=3)):
        obj[key] = draw(st.one_of(hostile_numbers, json_values))
    return obj


@FEW
@given(st.data())
def test_model_config_gives_a_positive_size_or_one_error(tmp_path_factory, data):
    from kmesh_trace.oracle.tier_costs import kv_bytes_from_config

    good = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "hidden_size": 32, "torch_dtype": "bfloat16"}
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    raw = data.draw(st.one_of(st.just(None), st.binary(max_size=30)))
    p.write_bytes(raw if raw is not None else json.dumps(_mutated(good, data.draw)).encode())
    try:
        n = kv_bytes_from_config(p)
    except KmeshTraceError:
        return
    assert type(n) is int and n > 0


@FEW
@given(st.data())
def test_restore_results_give_positive_costs_or_one_error(tmp_path_factory, data):
    from kmesh_trace.oracle.tier_costs import restore_costs_from_results

    good = {"routes": {"host": {"timer1": {"p50_ms": 2.0, "p95_ms": 3.0}, "mode": "x"}},
            "store_bytes": 1 << 20, "num_store_restores": 2}
    d = tmp_path_factory.mktemp("run")
    summary = _mutated(good, data.draw)
    if data.draw(st.booleans()) and isinstance(summary, dict):
        summary["routes"] = {"host": {"timer1": {"p50_ms": data.draw(hostile_numbers),
                                                 "p95_ms": data.draw(hostile_numbers)}}}
    (d / "summary.json").write_text(json.dumps(summary))
    if data.draw(st.booleans()):
        (d / "bench.json").write_text(json.dumps(_mutated({"h2d_copy_ms_per_restore": 1.0, "bytes": 100, "files": 1},
                                                          data.draw)))
    try:
        costs, _ = restore_costs_from_results(d)
    except KmeshTraceError:
        return
    for c in costs.values():
        assert math.isfinite(c.gbps) and c.gbps > 0 and c.latency_s >= 0
        assert c.gbps_p95 is None or (math.isfinite(c.gbps_p95) and c.gbps_p95 > 0)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(column=st.sampled_from(["restore_id", "chunk_index", "offset_bytes", "size_bytes", "sha256", "file", "chunk_key"]),
       value=st.one_of(st.integers(-2**63, 2**63 - 1), st.text(max_size=70), st.sampled_from(["../x", "/etc/passwd", ""])))
def test_a_damaged_journal_is_one_error(tmp_path_factory, column, value):
    import pyarrow.parquet as pq

    from kmesh_trace.native.store import JOURNAL, open_store, plan_uniform, prepare

    d = tmp_path_factory.mktemp("store")
    prepare(d, plan_uniform(2, 2, 4096))
    j = pq.read_table(d / JOURNAL)
    field = j.schema.field(column)
    try:
        arr = pa.array([value] * j.num_rows).cast(field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        return
    pq.write_table(j.set_column(j.schema.get_field_index(column), field, arr).replace_schema_metadata(j.schema.metadata),
                   d / JOURNAL)
    try:
        store = open_store(d)
    except KmeshTraceError:
        return
    for rid, chunks in store.restores.items():
        assert rid >= 0 and all(c.chunk_index >= 0 and c.size_bytes > 0 and c.offset_bytes >= 0 for c in chunks)


# ---- flags ----------------------------------------------------------------------------------------------

@FEW
@given(st.one_of(st.text(max_size=12), st.floats().map(repr), st.integers(-2**70, 2**70).map(str)))
def test_flag_parsers_give_a_value_in_domain_or_refuse(text):
    from kmesh_trace.values import MAX_SECONDS, bounded_int, finite_float, identifier

    for lo, hi, lo_open in ((0, 100, False), (0, 1e12, True), (0, MAX_SECONDS, False)):
        try:
            v = finite_float(lo, hi, lo_open=lo_open)(text)
        except ValueError:
            continue
        assert math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
    try:
        n = bounded_int(1, 2**31 - 1)(text)
        assert 1 <= n <= 2**31 - 1
    except ValueError:
        pass
    try:
        name = identifier(text)
        assert name == text and name.isprintable() and "/" not in name
    except ValueError:
        pass


# ---- analyses assert their own outputs ---------------------------------------------------------------

def _walk(obj, path=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, obj


@pytest.mark.parametrize("args", [
    ["headroom", "--scenario", "fork-tree", "--capacity-blocks", "8,16,64"],
    ["pressure", "--scenario", "hold-stress", "--capacity-blocks", "16,64"],
    ["tiers", "--scenario", "agent-small", "--host", "64", "--host-gbps", "10", "--prefill-tokens-per-s", "1000"],
])
def test_analysis_outputs_stay_in_their_domains(cli, args):
    """Every hit or fraction ratio in [0, 1], every token and block count >= 0, every number finite."""
    r = cli([*args, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout, parse_constant=lambda c: pytest.fail(f"{c} in --json output"))
    checked = 0
    for path, v in _walk(d):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        leaf = path.rsplit(".", 1)[-1].split("[")[0]
        assert math.isfinite(v), path
        if "ratio" in leaf and "gain" not in leaf and "to_" not in leaf:
            assert 0 <= v <= 1, (path, v)
            checked += 1
        if leaf.endswith(("_tokens", "_blocks")) and not leaf.startswith(("net", "delta", "gain", "saved")):
            assert v >= 0, (path, v)
            checked += 1
    assert checked > 0
