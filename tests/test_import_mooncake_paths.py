"""Both Mooncake import paths agree on every input: the Arrow fast path and the plain
line-by-line path are fuzzed against each other with hypothesis, on lines built to trip the fast path
(two records on a line, a record split over two, invalid UTF-8 in an ignored field, out-of-range numbers)."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmesh_trace.datasets.importers.mooncake import _fast_table, _line_counts, import_mooncake
from kmesh_trace.trace import open_trace


def _record(ts, n_in, n_out, extra=None, hashes=None) -> dict:
    if hashes is None:
        sane = type(n_in) is int and 0 < n_in <= 4096
        hashes = list(range(n_in * 7, n_in * 7 + -(-n_in // 512))) if sane else [1]
    rec = {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": hashes}
    rec.update(extra or {})
    return rec


timestamps = st.one_of(st.integers(0, 10**7), st.floats(0, 1e7, allow_nan=False), st.integers(2**53, 2**64),
                       st.sampled_from([1e300, -1.5, 0.0000004, 9007199254.740993]))
lengths = st.one_of(st.integers(1, 2048), st.sampled_from([0, -1, 2**63, 2**64, 10.0, 1e300, True, "10", None]))
records = st.builds(_record, timestamps, lengths, st.one_of(st.integers(0, 100), st.sampled_from([-3, 2**70, 1.0])))


def _dump(rec) -> bytes:
    try:
        return json.dumps(rec).encode()
    except (TypeError, ValueError):
        return b"{}"


@st.composite
def lines(draw) -> bytes:
    kind = draw(st.sampled_from(["ok", "ok", "ok", "blank", "two_on_one", "split", "bad_utf8", "nan", "dup_key",
                                 "garbage", "not_object", "nested_first"]))
    rec = draw(records)
    good = _dump(_record(1, 10, 2))
    if kind == "ok":
        return _dump(rec)
    if kind == "blank":
        return draw(st.sampled_from([b"", b"  ", b"\t\r", b" \r"]))
    if kind == "two_on_one":
        return _dump(rec) + draw(st.sampled_from([b" ", b"", b"\t"])) + good
    if kind == "split":
        text = _dump(rec)
        commas = [i + 1 for i, c in enumerate(text) if c == 0x2C] or [1]
        cut = draw(st.sampled_from(commas + [draw(st.integers(1, max(1, len(text) - 1)))]))
        return text[:cut] + b"\n" + text[cut:]
    if kind == "bad_utf8":
        return _dump(rec)[:-1] + b', "note": "\xff\xfe"}'
    if kind == "nan":
        return _dump(rec).replace(b'"output_length": ', b'"output_length": NaN, "x": ', 1)
    if kind == "dup_key":
        return _dump(rec)[:-1] + b', "input_length": 5}'
    if kind == "garbage":
        return _dump(rec) + b"x"
    if kind == "not_object":
        return b"[" + _dump(rec) + b"]"
    return b'{"meta": {"a": 1}\n, "timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}'


@st.composite
def files(draw) -> bytes:
    body = b"\n".join(draw(st.lists(lines(), min_size=1, max_size=12)))
    if draw(st.booleans()):
        body += b"\n"
    if draw(st.booleans()):
        body = b"\xef\xbb\xbf" + body
    return body


def _import_both(tmp_path, data: bytes, n: int):
    src = tmp_path / f"in{n}.jsonl"
    src.write_bytes(data)
    out = {}
    for fast in (True, False):
        dst = tmp_path / f"t{n}-{fast}"
        rep = import_mooncake(src, dst, fast=fast).to_dict()
        rep["malformed_lines"] = sorted(rep["malformed_lines"])  # the plain path lists bad hashes per batch
        rep.pop("out")
        frame = open_trace(dst).frame("invocations").drop("engine").sort("seq")
        out[fast] = (rep, frame.to_dicts())
    return out


_COUNTER = iter(range(10**9))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(files())
def test_fast_and_plain_paths_agree_on_any_file(tmp_path, data):
    out = _import_both(tmp_path, data, next(_COUNTER))
    assert out[True] == out[False]


def test_two_records_on_a_line_and_one_split_over_two_keep_the_plain_counts(tmp_path):
    """The counts balance (3 records, 3 lines), so a row count alone cannot see it; the plain path
    finds two malformed lines and one good one."""
    rec = json.dumps(_record(1, 10, 2)).encode()
    cut = rec.index(b", ") + 1  # between two fields, where JSON allows a newline
    data = rec + b" " + rec + b"\n" + rec[:cut] + b"\n" + rec[cut:] + b"\n"
    assert _line_counts(data) is None  # the fast path hands this file over
    assert _fast_table(data) is not None and _fast_table(data).num_rows == 3  # what Arrow alone would accept
    out = _import_both(tmp_path, data, 0)
    assert out[True] == out[False]
    assert out[True][0]["num_invocations"] == 0 and out[True][0]["num_malformed_lines"] == 3


def test_invalid_utf8_in_an_ignored_field_is_malformed_on_both_paths(tmp_path):
    rec = json.dumps(_record(1, 10, 2)).encode()
    data = rec + b"\n" + rec[:-1] + b', "note": "\xff"}\n'
    out = _import_both(tmp_path, data, 0)
    assert out[True] == out[False]
    assert out[True][0]["num_invocations"] == 1 and out[True][0]["malformed_lines"] == ["in0.jsonl:2: invalid UTF-8"]


def test_large_integer_timestamps_round_alike(tmp_path):
    """Beyond 2**53 ns a float product is no longer exact; the plain path's integers decide there."""
    data = json.dumps(_record(4_000_000_000_001, 10, 2)).encode() + b"\n"
    out = _import_both(tmp_path, data, 0)
    assert out[True] == out[False]
    assert out[True][1][0]["arrival_ns"] == 4_000_000_000_001 * 1_000_000
