"""The JSONL line reader and classifier: exact kinds for the nasty cases, and Hypothesis fuzzing.

Invariant under fuzzing: nothing raises, and parsed + malformed + blank = physical lines, where the
physical lines are counted independently (`bytes.count`) over the file less a leading BOM.
"""

from __future__ import annotations

import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kmesh_trace.audit.corpus import audit_corpus
from kmesh_trace.jsonl_lines import (
    BLANK,
    BOM,
    MALFORMED,
    RECORD,
    FileRead,
    Malformed,
    classify,
    count_physical_lines,
    iter_physical_lines,
)


@pytest.mark.parametrize("raw, expected", [
    (b'{"a": 1}', (RECORD, {"a": 1})),
    (b'{"a": 1}\r', (RECORD, {"a": 1})),
    (b'  {"a": 1, "a": 2}  ', (RECORD, {"a": 2})),
    (b"", (BLANK, None)),
    (b" \t\r", (BLANK, None)),
    (b"\x0c", (MALFORMED, Malformed("broken_json", 1))),
    (b'{"a": NaN}', (MALFORMED, Malformed("nonstandard_literal"))),
    (b'{"a": -Infinity}', (MALFORMED, Malformed("nonstandard_literal"))),
    (b"[1, 2]", (MALFORMED, Malformed("not_object"))),
    (b'"text"', (MALFORMED, Malformed("not_object"))),
    (b"null", (MALFORMED, Malformed("not_object"))),
    (b'{"a": ', (MALFORMED, Malformed("broken_json", 7))),
    (b'{"a": 1} {"b": 2}', (MALFORMED, Malformed("broken_json", 10))),
    (b'{"a": "\xe2\x82"}', (MALFORMED, Malformed("invalid_utf8", 8))),
    (b'{"a": "\xed\xa0\x80"}', (MALFORMED, Malformed("invalid_utf8", 8))),  # an encoded surrogate
    (BOM + b'{"a": 1}', (MALFORMED, Malformed("broken_json", 1))),  # a BOM is tolerated at file start only
    (b"[" * 100_000 + b"]" * 100_000, (MALFORMED, Malformed("too_deep"))),
    (b'{"n": ' + b"9" * 5000 + b"}", (MALFORMED, Malformed("broken_json"))),  # beyond int-string limits
    (b'{"s": "\\ud800"}', (RECORD, {"s": "\ud800"})),  # an escaped lone surrogate is valid JSON text
])
def test_classify_exact(raw, expected):
    assert classify(raw) == expected


def test_reader_splits_hashes_and_strips_a_leading_bom():
    import hashlib

    data = BOM + b'{"a": 1}\r\n\n  \n{"b": 2}'
    info = FileRead()
    lines = list(iter_physical_lines(io.BytesIO(data), info, chunk_bytes=2))
    assert lines == [b'{"a": 1}\r', b"", b"  ", b'{"b": 2}']
    assert info.bom and info.num_bytes == len(data) and info.sha256 == hashlib.sha256(data).hexdigest()


def test_huge_line_across_many_chunks():
    line = b'{"a": "' + b"x" * 3_000_000 + b'"}'
    info = FileRead()
    lines = list(iter_physical_lines(io.BytesIO(line + b"\n" + line), info, chunk_bytes=4096))
    assert lines == [line, line]
    assert classify(lines[0])[0] == RECORD


# ---- fuzzing -----------------------------------------------------------------------------------

_PIECES = [
    b'{"timestamp": 1700000000, "input": "a", "output": "b"}', b'{"a": 1, "a": 2}', b'{"a": NaN}',
    b'{"a": Infinity}', b"[1]", b"{", b"}", b'"', b"\xe2\x82", b"\xff", BOM, b"\r", b"\r\n", b"\n", b" ", b"\t",
    b"[" * 3000, b"]" * 3000, b'{"a":' * 600, b"}" * 600, b'{"x": "' + b"y" * 70_000 + b'"}', b"1e999", b"\x00",
]

blobs = st.lists(st.one_of(st.sampled_from(_PIECES), st.binary(max_size=40)), max_size=30).map(b"".join)


def _expected_lines(data: bytes) -> int:
    return count_physical_lines(data.removeprefix(BOM))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=blobs, chunk=st.integers(1, 64))
def test_fuzz_reader_and_classifier_account_for_every_line(data, chunk):
    info = FileRead()
    counts = {RECORD: 0, BLANK: 0, MALFORMED: 0}
    lines = []
    for raw in iter_physical_lines(io.BytesIO(data), info, chunk_bytes=chunk):
        lines.append(raw)
        kind, value = classify(raw)
        counts[kind] += 1
        assert (kind == RECORD) == (type(value) is dict)
        assert kind != MALFORMED or value.kind in ("invalid_utf8", "broken_json", "nonstandard_literal", "too_deep", "not_object")
    body = data[len(BOM):] if info.bom else data
    assert info.bom == data.startswith(BOM)
    assert b"\n".join(lines) + (b"\n" if body.endswith(b"\n") else b"") == body
    assert sum(counts.values()) == _expected_lines(data)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(files=st.lists(blobs, min_size=1, max_size=3))
def test_fuzz_corpus_audit_never_crashes_and_counts_every_line(tmp_path_factory, files):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "src").mkdir()
    for i, data in enumerate(files):
        (root / "src" / f"f{i}.jsonl").write_bytes(data)
    d = audit_corpus(root).to_dict()
    expected = sum(_expected_lines(x) for x in files)
    assert d["physical_lines"] == expected
    assert d["parsed_records"] + d["malformed_lines"] + d["blank_lines"] == expected
    assert d["nonempty_lines"] == d["parsed_records"] + d["malformed_lines"]
    assert d["unique_records"] + d["duplicate_records"] == d["parsed_records"]
    assert sum(d["malformed_by_file"].values()) == d["malformed_lines"]
