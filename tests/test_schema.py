"""The contract itself: every column documented, typed, and the version guard."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kmesh_trace import schema
from kmesh_trace.errors import SchemaVersionError
from kmesh_trace.writer import TraceWriter


def test_every_table_of_the_contract_is_declared():
    assert set(schema.TABLES) == {"invocations", "lineage", "block_events", "transfers", "steps"}


def test_every_column_has_type_nullability_and_a_sentence():
    for t in schema.TABLES.values():
        assert t.doc.endswith(".")
        names = [c.name for c in t.columns]
        assert len(names) == len(set(names)), t.name
        for c in t.columns:
            assert isinstance(c.type, pa.DataType)
            assert c.doc.endswith("."), (t.name, c.name)
            if c.name.endswith("_ns"):
                assert c.unit == "ns" and c.type == pa.int64(), c.name
            if c.name.startswith("num_") and c.name.endswith("_tokens"):
                assert c.unit == "tokens", c.name


def test_invocations_hold_token_ids_and_block_hashes():
    inv = schema.INVOCATIONS
    assert inv.column("prompt_token_ids").type == pa.list_(pa.int32())
    assert inv.column("prompt_block_hashes").type == pa.list_(pa.uint64())
    assert "block_size" in schema.METADATA_FIELDS


def test_json_form_shape():
    d = json.loads(json.dumps(schema.as_dict()))
    assert d["schema_version"] == schema.SCHEMA_VERSION
    assert list(d["tables"]) == ["invocations", "lineage", "block_events", "transfers", "steps"]
    cols = {c["name"]: c for c in d["tables"]["block_events"]["columns"]}
    assert cols["block_hash"] == {
        "name": "block_hash", "type": "uint64", "unit": None, "nullable": True,
        "doc": "Low 64 bits of the block hash, as vLLM's KV events publish it (cached, evicted, touched).",
    }
    assert cols["ts_ns"]["unit"] == "ns" and cols["ts_ns"]["nullable"] is False
    assert d["tables"]["invocations"]["columns"][8]["type"] == "list<int32>"  # prompt_token_ids


def test_parts_carry_the_schema_version(tmp_path):
    w = TraceWriter(tmp_path / "t", "e0")
    p = w.write("lineage", {"child_request_id": ["c"], "edge_kind": ["declared"]})
    md = pq.read_schema(p).metadata
    assert md[schema.VERSION_KEY] == schema.SCHEMA_VERSION.encode()
    assert md[schema.TABLE_KEY] == b"lineage"


@pytest.mark.parametrize("version", ["2.0", "0.9", None, "x"])
def test_unknown_major_version_is_refused(version):
    with pytest.raises(SchemaVersionError):
        schema.check_version(version, "somewhere")


def test_minor_versions_are_read():
    schema.check_version("1.7", "somewhere")


def test_every_rule_names_a_column_of_the_contract():
    schema.check_rules()
    assert set(schema.VOCABULARIES) >= {("block_events", "event"), ("lineage", "edge_kind"), ("invocations", "status")}
    with pytest.raises(KeyError, match="has no column 'nope'"):
        schema.INVOCATIONS.select("request_id", "nope")
    with pytest.raises(KeyError, match="has no value 'bought'"):
        schema.values("block_events", "event", "held", "bought")


def test_the_audit_and_readers_take_their_names_from_the_contract():
    from kmesh_trace.audit import capture as audit_capture
    from kmesh_trace.oracle import workload

    assert {(t, c) for t, cols in audit_capture.FILLED_WHEN.items() for c in cols} == set(schema.FILLED_WHEN)
    assert set(workload.COLUMNS) <= set(schema.INVOCATIONS.column_names)


def test_every_metadata_field_has_one_typed_record():
    assert set(schema.METADATA_TYPES) == set(schema.METADATA_FIELDS) == set(schema.METADATA)
    for name, f in schema.METADATA.items():
        assert f.type in (str, int, bool, dict, list), name
        assert f.minimum is None or f.type is int, name
        assert f.doc.endswith(".") and len(f.doc) > 20, name


@pytest.mark.parametrize("name, bad, good", [
    ("token_ids_approximate", "yes", True), ("tokenizer", 7, "utf-8-bytes"), ("arrival", ["users", 8], "users:8"),
    ("duplicate_records", "a.jsonl:3", ["a.jsonl:3: repeats a.jsonl:1"]), ("import_counts", 12, {"num_files": 1}),
])
def test_import_metadata_fields_are_typed_too(name, bad, good):
    """The five fields importers write were once untyped: a wrong type now reads as damage, like any field."""
    assert schema.metadata_type_error(name, good) is None
    assert f"field {name} is" in schema.metadata_type_error(name, bad)


def test_engines_view_in_sql_and_scan(tmp_path):
    from kmesh_trace.datasets.workloads.fork_tree import write_fork_tree
    from kmesh_trace.trace import open_trace

    with open_trace(write_fork_tree(tmp_path / "t", num_usable_blocks=300)) as t:
        scanned = t.scan("engines").collect()
        queried = t.sql("SELECT * FROM engines")
    assert scanned.columns[:len(schema.METADATA_FIELDS)] == list(schema.METADATA_FIELDS)
    assert queried.columns == scanned.columns
    row = queried.row(0, named=True)
    assert (row["engine_id"], row["block_size"], row["num_usable_blocks"]) == ("fork-tree", 16, 300)
    assert scanned.row(0, named=True) == row  # the same view both ways; nested values as JSON text
    assert set(json.loads(row["num_dropped_events"]).values()) == {0}
