"""A damaged trace never answers wrongly: every command that reads it says what is wrong with which file
in one line, and the audit reports the damage as blocking findings."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kmesh_trace import schema
from kmesh_trace.audit.capture import audit_capture
from kmesh_trace.errors import CorruptTraceError
from kmesh_trace.trace import open_trace
from kmesh_trace.writer import TraceWriter

BS = 16


def _prompt(family: int, n: int) -> list[int]:
    return [family * 1000 + i for i in range(n)]


def family_trace(path):
    """Two families of three requests sharing a 64-token ancestor, in two invocation parts."""
    rows = []
    for fam in range(2):
        for child in range(3):
            rows.append({"request_id": f"f{fam}c{child}", "seq": len(rows), "num_prompt_tokens": 80,
                         "num_output_tokens": 4, "prompt_token_ids": _prompt(fam, 64) + [child] * 16,
                         "output_token_ids": [1, 2, 3, 4], "arrival_ns": 10 * len(rows), "family_id": f"f{fam}",
                         "finish_ns": 10 * len(rows) + 5, "status": "finished", "num_cached_tokens": 0})
    with TraceWriter(path, "e0", {"block_size": BS, "num_usable_blocks": 6, "engine_index": 0}) as w:
        for half in (rows[:3], rows[3:]):
            w.write("invocations", {k: [r[k] for r in half] for k in half[0]})
    return path


def part(root, n=1, table="invocations"):
    return root / table / "engine=e0" / f"part-{n:05d}.parquet"


def _rewrite(root, fn):
    """Rewrite part 1 of the invocations with `fn(table) -> table` (written by plain pyarrow)."""
    p = part(root)
    pq.write_table(fn(pq.read_table(p)), p)
    return p


def damage(root, kind):
    """Apply one kind of damage; returns the file the error must name."""
    p = part(root)
    if kind == "wrong_table":
        t = pq.read_table(p)
        lineage = pa.table({"child_request_id": ["x"], "edge_kind": ["declared"]}).cast(
            pa.schema([pa.field("child_request_id", pa.string()), pa.field("edge_kind", pa.string())]))
        pq.write_table(lineage.replace_schema_metadata({schema.VERSION_KEY: b"1.0", schema.TABLE_KEY: b"lineage"}), p)
        del t
    elif kind == "wrong_type":
        _rewrite(root, lambda t: t.set_column(t.schema.get_field_index("seq"), "seq", t["seq"].cast(pa.string())))
    elif kind == "missing_column":
        _rewrite(root, lambda t: t.drop_columns(["num_prompt_tokens"]))
    elif kind == "extra_column":
        _rewrite(root, lambda t: t.append_column("surprise", pa.array([1] * t.num_rows)))
    elif kind == "flipped_footer":
        data = bytearray(p.read_bytes())
        for i in range(len(data) - 200, len(data) - 8):
            data[i] ^= 0xFF
        p.write_bytes(bytes(data))
    elif kind == "non_utf8_part_metadata":
        _rewrite(root, lambda t: t.replace_schema_metadata({schema.VERSION_KEY: b"1.0", schema.TABLE_KEY: b"\xff\xfe"}))
    elif kind == "non_utf8_engine_metadata":
        p = root / "engines" / "e0.json"
        p.write_bytes(p.read_bytes().replace(b'"e0"', b'"e0\xff"', 1))
    elif kind == "metadata_wrong_type":
        p = root / "engines" / "e0.json"
        meta = json.loads(p.read_text())
        meta["block_size"] = "16"
        p.write_text(json.dumps(meta))
    elif kind == "duplicate_part":
        shutil.copyfile(part(root, 0), part(root, 2))
        p = part(root, 2)
    elif kind == "required_nulls":
        def nulls(t):
            t = t.cast(pa.schema([f.with_nullable(True) for f in t.schema], metadata=t.schema.metadata))
            i = t.schema.get_field_index("request_id")
            return t.set_column(i, t.schema.field(i), pa.array([None] + t["request_id"].to_pylist()[1:], pa.string()))
        _rewrite(root, nulls)
    elif kind in ("fifo_part", "fifo_engine_metadata"):  # a read would block forever, deaf to Ctrl-C
        p = p if kind == "fifo_part" else root / "engines" / "e0.json"
        p.unlink()
        os.mkfifo(p)
    else:
        raise AssertionError(kind)
    return p


KINDS = ["wrong_table", "wrong_type", "missing_column", "extra_column", "flipped_footer", "non_utf8_part_metadata",
         "non_utf8_engine_metadata", "metadata_wrong_type", "duplicate_part", "required_nulls", "fifo_part",
         "fifo_engine_metadata"]


def test_clean_trace_opens_without_problems(tmp_path):
    t = open_trace(family_trace(tmp_path / "t"))
    assert t.problems == []
    assert t.row_counts()["invocations"] == 6


@pytest.mark.parametrize("kind", KINDS)
def test_opening_refuses_damage_naming_the_file(tmp_path, kind):
    root = family_trace(tmp_path / "t")
    bad = damage(root, kind)
    with pytest.raises(CorruptTraceError) as e:
        open_trace(root)
    assert str(bad) in str(e.value) or bad.name in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", [
    ["headroom", "{t}", "--json"],
    ["pressure", "{t}", "--capacity-blocks", "6", "--json"],
    ["export", "perfetto", "{t}", "--out", "{tmp}/timeline.json"],
    ["sql", "{t}", "SELECT count(*) FROM invocations"],
    ["info", "{t}"],
])
def test_every_command_reports_damage_in_one_line(tmp_path, cli, kind, command):
    root = family_trace(tmp_path / "t")
    bad = damage(root, kind)
    r = cli([a.format(t=root, tmp=tmp_path) for a in command])
    assert r.exit_code == 1, r.output
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, r.stderr
    assert bad.name in r.stderr
    assert "unexpected" not in r.stderr


@pytest.mark.parametrize("kind,code", [
    ("wrong_table", "damaged_part"), ("wrong_type", "damaged_part"), ("missing_column", "damaged_part"),
    ("flipped_footer", "damaged_part"), ("metadata_wrong_type", "invalid_metadata"),
    ("duplicate_part", "duplicate_part"), ("required_nulls", "null_in_required_column"),
])
def test_audit_blocks_on_contract_violations(tmp_path, cli, kind, code):
    root = family_trace(tmp_path / "t")
    damage(root, kind)
    result = audit_capture(root)
    found = {p.code: p for p in result.problems}
    assert code in found and found[code].severity == "blocking"
    assert not result.verdict["headroom"]["qualified"]
    r = cli(["audit", "capture", root, "--json"])
    assert r.exit_code == 3
    assert code in {p["code"] for p in json.loads(r.stdout)["problems"]}


def test_a_duplicated_part_changes_no_count_in_the_audit(tmp_path):
    root = family_trace(tmp_path / "t")
    damage(root, "duplicate_part")
    result = audit_capture(root)
    assert result.rows["invocations"] == 6  # the copy is left out, visibly (a blocking finding)


def test_rows_repeated_across_parts_are_a_blocking_finding(tmp_path):
    root = family_trace(tmp_path / "t")
    t = pq.read_table(part(root, 0))
    pq.write_table(t.replace_schema_metadata(t.schema.metadata), part(root, 2), compression="snappy")  # other bytes
    result = audit_capture(root)
    dup = {p.message.split(" a ")[1].split()[0]: p for p in result.problems if p.code == "duplicate_rows"}
    assert {k: (p.severity, p.count) for k, p in dup.items()} == {"request_id": ("blocking", 3), "seq": ("blocking", 3)}


def test_headroom_refuses_repeated_request_ids(tmp_path, cli):
    root = family_trace(tmp_path / "t")
    t = pq.read_table(part(root, 0))
    pq.write_table(t, part(root, 2), compression="snappy")
    r = cli(["headroom", root, "--json"])
    assert r.exit_code == 1
    assert "f0c0" in r.stderr and "twice" in r.stderr and r.stderr.count("\n") == 1


def test_flipped_data_page_is_named_when_a_read_fails(tmp_path, cli):
    """Bytes flipped inside a data page pass the footer checks; the read that trips over them is traced
    back to the file (the search reads whole parts, on the failure path only)."""
    root = family_trace(tmp_path / "t")
    p = part(root)
    data = bytearray(p.read_bytes())
    size = pq.read_metadata(p).serialized_size
    for i in range(8, len(data) - size - 8):  # everything between the magic and the footer
        data[i] ^= 0x5A
    p.write_bytes(bytes(data))
    r = cli(["headroom", root, "--json"])
    assert r.exit_code == 1
    assert r.stderr.startswith("Error: ") and r.stderr.count("\n") == 1, r.stderr
    assert p.name in r.stderr


def test_a_part_that_predates_a_nullable_column_reads_it_as_nulls(tmp_path):
    """A trace written before the contract added a nullable column (invocations' agent_id and agent_type
    came with the agentic importers) stays readable: the column reads as nulls in polars and DuckDB; a
    part without a required column is still refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kmesh_trace import schema
    from kmesh_trace.trace import open_trace
    from kmesh_trace.writer import TraceWriter

    w = TraceWriter(tmp_path / "t", "e0", {"source": "import:test", "block_size": 16})
    w.write("invocations", {"request_id": ["r0", "r1"], "seq": [0, 1], "num_prompt_tokens": [20, 40],
                            "num_output_tokens": [1, 1], "prompt_block_hashes": [[1], [1, 2]]})
    w.close()
    part = next((tmp_path / "t" / "invocations").rglob("*.parquet"))
    old = pq.read_table(part)
    md = old.schema.metadata
    old = old.drop_columns(["agent_id", "agent_type"]).replace_schema_metadata(md)
    pq.write_table(old, part)
    with open_trace(tmp_path / "t") as t:
        assert t.frame("invocations")["agent_id"].to_list() == [None, None]
        assert t.sql("SELECT count(*) AS n, count(agent_type) AS a FROM invocations").row(0) == (2, 0)
    required = next(c.name for c in schema.table("invocations").columns if not c.nullable and c.name != "request_id")
    pq.write_table(pa.table(old).drop_columns([required]).replace_schema_metadata(md), part)
    with pytest.raises(Exception, match=f"{required}.*missing"):
        open_trace(tmp_path / "t")
