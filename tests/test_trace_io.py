"""Trace directories: atomic parts, Hive layout, readers, the version guard, SQL confinement."""

import json
import threading

import duckdb
import polars as pl
import pyarrow.parquet as pq
import pytest

from kmesh_trace import open_trace, schema
from kmesh_trace.errors import CorruptTraceError, KmeshTraceError, QueryRefusedError, SchemaVersionError, TraceNotFoundError
from kmesh_trace.writer import TraceWriter


def small_trace(path):
    w = TraceWriter(path, "e0", {"block_size": 16, "num_usable_blocks": 128})
    w.write("invocations", {
        "request_id": ["r0", "r1"], "seq": [0, 1], "num_prompt_tokens": [3, 4],
        "prompt_token_ids": [[1, 2, 3], [1, 2, 3, 4]], "arrival_ns": [10, 20], "family_id": ["f", "f"],
    })
    w.write("invocations", {"request_id": ["r2"], "seq": [2], "num_prompt_tokens": [5]})
    w.write("block_events", {"seq": [0, 1], "ts_ns": [11, 12], "event": ["allocated", "cached"],
                             "block_id": [1, 1], "ref_cnt": [1, 1], "block_hash": [None, 2**64 - 1]})
    w.close()
    return path


def test_layout_is_hive_partitioned(tmp_path):
    small_trace(tmp_path / "t")
    names = sorted(str(p.relative_to(tmp_path / "t")) for p in (tmp_path / "t").rglob("*") if p.is_file())
    assert names == [
        "block_events/engine=e0/part-00000.parquet",
        "engines/e0.json",
        "engines/e0.loss",
        "invocations/engine=e0/part-00000.parquet",
        "invocations/engine=e0/part-00001.parquet",
        "kmesh_trace.json",
    ]


def test_trace_api_frames_and_sql(tmp_path):
    t = open_trace(small_trace(tmp_path / "t"))
    assert t.row_counts() == {"invocations": 3, "lineage": 0, "block_events": 2, "transfers": 0, "steps": 0}
    inv = t.frame("invocations").sort("seq")
    assert inv["request_id"].to_list() == ["r0", "r1", "r2"]
    assert inv["engine"].unique().to_list() == ["e0"]
    assert isinstance(t.scan("lineage"), pl.LazyFrame) and t.frame("lineage").height == 0
    df = t.sql("SELECT max(block_hash) AS h FROM block_events")
    assert df["h"].to_list() == [2**64 - 1]
    assert t.sql("SELECT count(*) AS n FROM lineage")["n"].to_list() == [0]
    assert t.block_size == 16 and t.num_usable_blocks == 128


def test_duckdb_and_polars_read_the_layout_as_is(tmp_path):
    root = small_trace(tmp_path / "t")
    n = duckdb.sql(f"SELECT count(*) FROM read_parquet('{root}/invocations/*/*.parquet', hive_partitioning=true) WHERE engine='e0'").fetchall()[0][0]
    assert n == 3
    assert pl.scan_parquet(f"{root}/invocations/**/*.parquet", hive_partitioning=True).collect().height == 3


def test_writer_refuses_unknown_columns_and_nulls_in_required_ones(tmp_path):
    w = TraceWriter(tmp_path / "t", "e0")
    with pytest.raises(KmeshTraceError, match="no column"):
        w.write("lineage", {"child_request_id": ["c"], "edge_kind": ["declared"], "bogus": [1]})
    with pytest.raises(KmeshTraceError, match="null"):
        w.write("lineage", {"child_request_id": [None], "edge_kind": ["declared"]})


def test_reader_refuses_a_part_with_another_major_version(tmp_path):
    root = small_trace(tmp_path / "t")
    p = root / "invocations" / "engine=e0" / "part-00001.parquet"
    tbl = pq.read_table(p)
    tbl = tbl.replace_schema_metadata({schema.VERSION_KEY: b"2.0"})
    pq.write_table(tbl, p)
    with pytest.raises(SchemaVersionError, match="schema version 2.0"):
        open_trace(root)


def test_not_a_trace(tmp_path):
    with pytest.raises(TraceNotFoundError):
        open_trace(tmp_path)
    with pytest.raises(TraceNotFoundError):
        open_trace(tmp_path / "missing")


def test_reader_never_sees_a_part_mid_write(tmp_path):
    """A writer thread keeps adding parts; every open sees only whole, readable parts."""
    root = tmp_path / "t"
    w = TraceWriter(root, "e0")
    stop = threading.Event()
    rows = 5000

    def keep_writing():
        i = 0
        while not stop.is_set() and i < 200:
            w.write("block_events", {"seq": list(range(i * rows, (i + 1) * rows)), "ts_ns": [0] * rows,
                                     "event": ["allocated"] * rows})
            i += 1

    th = threading.Thread(target=keep_writing)
    th.start()
    seen = 0
    try:
        for _ in range(50):
            t = open_trace(root)
            n = t.frame("block_events").height
            assert n % rows == 0
            seen = max(seen, n)
    finally:
        stop.set()
        th.join()
    # A temporary file left by a killed writer is never matched.
    (root / "block_events" / "engine=e0" / ".part-99999.parquet.tmp-1").write_bytes(b"PAR1 half written")
    assert open_trace(root).frame("block_events").height == w.num_rows["block_events"]


def test_parts_continue_numbering_when_reopened(tmp_path):
    root = small_trace(tmp_path / "t")
    w = TraceWriter(root, "e0")
    p = w.write("invocations", {"request_id": ["r3"], "seq": [3], "num_prompt_tokens": [1]})
    assert p.name == "part-00002.parquet"


REFUSED = [
    "COPY (SELECT 1) TO '{out}/copy.csv'",
    "COPY invocations TO '{out}/copy.parquet' (FORMAT parquet)",
    "ATTACH '{out}/db.duckdb' AS other",
    "INSTALL httpfs",
    "LOAD httpfs",
    "CREATE TABLE x AS SELECT 1",
    "SET enable_external_access = true",
    "SELECT * FROM read_csv('{out}/secret.csv')",
    "SELECT * FROM read_text('/etc/hostname')",
    "SELECT 1; COPY (SELECT 1) TO '{out}/second.csv'",
    "EXPLAIN ANALYZE COPY (SELECT 1 AS x) TO '{trace}/invocations/engine=e0/part-00000.parquet' (FORMAT parquet)",
    "COPY (SELECT 1 AS x) TO '{trace}/invocations/engine=e0/part-00000.parquet' (FORMAT parquet)",
]


@pytest.mark.parametrize("query", REFUSED)
def test_sql_refuses_writes_attach_extensions_and_outside_reads(tmp_path, query, cli):
    root = small_trace(tmp_path / "t")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.csv").write_text("a\n1\n")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    q = query.format(out=outside, trace=root)
    with pytest.raises(QueryRefusedError):
        open_trace(root).sql(q)
    r = cli(["sql", root, q])
    assert r.exit_code == 1
    assert r.stdout == ""
    assert r.stderr.startswith("Error: query refused") and r.stderr.count("\n") == 1
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert open_trace(root).row_counts()["invocations"] == 3


def test_engine_ids_stay_strings(tmp_path):
    w = TraceWriter(tmp_path / "t", "007")
    w.write("lineage", {"child_request_id": ["c"], "edge_kind": ["declared"]})
    t = open_trace(tmp_path / "t")
    assert t.frame("lineage")["engine"].to_list() == ["007"]
    assert t.sql("SELECT engine FROM lineage")["engine"].to_list() == ["007"]
    assert list(t.engines) == ["007"]


@pytest.mark.parametrize("damage", ["bad_json", "not_object", "no_engine_id", "truncated_part", "bad_marker"])
def test_a_damaged_trace_is_one_clear_error(tmp_path, cli, damage):
    root = small_trace(tmp_path / "t")
    if damage == "bad_json":
        (root / "engines" / "e0.json").write_text("{bad")
    elif damage == "not_object":
        (root / "engines" / "e0.json").write_text("[1, 2]")
    elif damage == "no_engine_id":
        (root / "engines" / "e0.json").write_text(json.dumps({"schema_version": "1.0"}))
    elif damage == "truncated_part":
        p = root / "invocations" / "engine=e0" / "part-00001.parquet"
        p.write_bytes(p.read_bytes()[:40])
    else:
        (root / "kmesh_trace.json").write_text("")
    with pytest.raises(CorruptTraceError, match="is damaged"):
        open_trace(root)
    r = cli(["info", root])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: ") and "is damaged" in r.stderr and r.stderr.count("\n") == 1
