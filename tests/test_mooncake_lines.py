"""The one Mooncake reader (datasets/importers/mooncake.py): the compiled parse (native/kernels/mooncake_lines.c)
against the plain reader that judges every line it refuses. On any file, reading with the compiled parse gives
the columns, parts and report that the plain reader alone gives; a line in the plain shape is taken by the
parse, any other is refused (and judged by the plain reader)."""

from __future__ import annotations

import json
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kmesh_trace.datasets.importers import mooncake

_FIELDS = ("lineno", "num_prompt_tokens", "num_output_tokens", "arrival_ns", "offsets", "hashes", "part_ends")
_MAX_MS = ((1 << 63) - 1) // 1_000_000


def _columns(cols) -> dict:
    return {name: [int(v) for v in getattr(cols, name)] for name in _FIELDS}


def _read(src, *, fast=True, chunk_bytes=None):
    """(columns, report, lines the compiled parse refused) of `src`."""
    refused = []
    judged = mooncake._Compiled._judged

    def spy(self, raw):
        refused.append(int(self.counts[mooncake._LINES]))
        return judged(self, raw)

    with mock.patch.object(mooncake._Compiled, "_judged", spy), \
            mock.patch.object(mooncake, "CHUNK_BYTES", chunk_bytes or mooncake.CHUNK_BYTES):
        cols, report = mooncake.read_mooncake(src, fast=fast)
    return _columns(cols), report, refused


def _check(tmp_path, data: bytes, *, chunk_bytes: int | None = None) -> list[int]:
    """The compiled parse and the plain reader read `data` alike; returns the lines the parse refused."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    cols, report, refused = _read(src, chunk_bytes=chunk_bytes)
    plain_cols, plain_report, _ = _read(src, fast=False)
    assert (cols, report) == (plain_cols, plain_report), data[:300]
    return refused


def _line(ts=5, n_in=700, n_out=3, hashes=None, order=("timestamp", "input_length", "output_length", "hash_ids"),
          sep=", ", colon=": ", comma=", ") -> bytes:
    values = {"timestamp": str(ts), "input_length": str(n_in), "output_length": str(n_out),
              "hash_ids": "[" + comma.join(str(h) for h in (hashes if hashes is not None else
                                                              range(1, 1 + -(-n_in // 512)))) + "]"}
    return ("{" + sep.join(f'"{k}"{colon}{values[k]}' for k in order) + "}").encode()


GOOD = _line()

#: Lines in the plain shape: the compiled parse takes every one.
VALID = [
    GOOD,
    _line(0, 1, 0, [0]),
    _line(_MAX_MS, 512, 1 << 32, [(1 << 64) - 1]),  # output at MAX_TOKENS
    _line(7, 513, 0, [18446744073709551615, 0]),
    _line(12, 1024, 1, [10, 20]),
    _line(order=("hash_ids", "output_length", "timestamp", "input_length")),
    _line(sep=",", colon=":", comma=","),
    _line(sep=" ,\t", colon=" :\r", comma=" , "),
    b" \t{ \"timestamp\" : 5 , \"input_length\" : 700 , \"output_length\" : 3 , \"hash_ids\" : [ 1 , 2 ] } \r",
    GOOD + b"\r",
    _line(hashes=[12345678901234567890, 9999999999999999999]),
    # a timestamp is any JSON number; other keys may hold flat values
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 5.0'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 5e0'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 5E2'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -5'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -0'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -0.0'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 0.0000025'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 0.0000035'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -2.5e-6'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 1234567.891'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 9007199254.740993'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": %d' % -_MAX_MS),
    GOOD[:-1] + b', "extra": 1}',
    GOOD[:-1] + b', "session_id": "s-1", "": null, "x": true, "y": false}',
    b'{"prompt": [1, -2.5e3, "a b", true, null, ""], ' + GOOD[1:],
    GOOD[:-1] + b', "prompt": [ ], "z": -0.5E+2, "w": " ~!#"}',
]

#: Lines the compiled parse must refuse (the plain reader judges them: some are valid for it).
NEAR_VALID = [
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 05'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": %d' % (_MAX_MS + 1)),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 1e400'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": NaN'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": "5"'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": true'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": null'),
    GOOD.replace(b'"input_length": 700', b'"input_length": +700'),
    GOOD.replace(b'"input_length": 700', b'"input_length": 700.0'),
    GOOD.replace(b'"input_length": 700', b'"input_length": 0700'),
    GOOD.replace(b'"output_length": 3', b'"output_length": -3'),
    GOOD.replace(b'"output_length": 3', b'"output_length": 00'),
    GOOD.replace(b'"output_length": 3', b'"output_length": 9223372036854775808'),
    GOOD.replace(b'"output_length": 3', b'"output_length": 4294967297'),  # past MAX_TOKENS: malformed for all
    GOOD.replace(b'"output_length": 3', b'"output_length": 9223372036854775807'),
    _line(0, 0, 0, []),
    _line(n_in=1 << 63, hashes=[1]),
    _line(n_in=700, hashes=[1]),
    _line(n_in=700, hashes=[1, 2, 3]),
    _line(n_in=512, hashes=[1, 2]),
    _line(hashes=[1, 18446744073709551616]),
    _line(hashes=[1, 100000000000000000000]),
    _line(hashes=[1, -2]),
    _line(hashes=[1, 2.5]),
    GOOD.replace(b"[1, 2]", b'[1, "2"]'),
    GOOD.replace(b"[1, 2]", b"[1, [2]]"),
    GOOD.replace(b"[1, 2]", b"[1, 2,]"),
    GOOD.replace(b"[1, 2]", b"[1 2]"),
    GOOD.replace(b"[1, 2]", b"[01, 2]"),
    GOOD.replace(b"[1, 2]", b"{}"),
    GOOD[:-1] + b', "note": "caf\xc3\xa9"}',
    GOOD[:-1] + b', "note": "a\\u0041"}',
    GOOD[:-1] + b', "\\u0078": 1}',
    GOOD[:-1] + b', "note": "a\x01"}',
    GOOD[:-1] + b', "note": "a\x7f"}',
    GOOD[:-1] + b', "x": [[1]]}',
    GOOD[:-1] + b', "x": {}}',
    GOOD[:-1] + b', "x": 01}',
    GOOD[:-1] + b', "x": 1.}',
    GOOD[:-1] + b', "x": .5}',
    GOOD[:-1] + b', "x": 1e}',
    GOOD[:-1] + b', "x": -}',
    GOOD[:-1] + b', "x": tru}',
    GOOD[:-1] + b', "x": NaN}',
    GOOD[:-1] + b', "x": -Infinity}',
    GOOD[:-1] + b', "x": [1,]}',
    GOOD[:-1] + b', "x": "unterminated}',
    GOOD[:-1] + b', "x": 1' + b"0" * 64 + b"}",
    GOOD[:-1] + b', "x": 1' + b"0" * 5000 + b"}",
    GOOD[:-1] + b', x: 1}',
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 5.'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -05'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": %d' % -(_MAX_MS + 1)),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 9223372036854.775807'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 1' + b"0" * 70 + b".5"),
    GOOD[:-1] + b', "input_length": 700}',
    GOOD[:-1] + b', "meta": {"a": [1]}}',
    GOOD.replace(b'"timestamp"', b'"\\u0074imestamp"'),
    GOOD.replace(b'"timestamp"', b'"timestamp2"'),
    GOOD.replace(b'"timestamp"', b'"Timestamp"'),
    GOOD.replace(b'"timestamp": 5, ', b""),
    GOOD.replace(b', "hash_ids": [1, 2]', b""),
    GOOD + GOOD,
    GOOD + b" " + GOOD,
    GOOD + b"x",
    GOOD + b",",
    GOOD[:-1],
    b"[" + GOOD + b"]",
    b"{}",
    b"\xef\xbb\xbf" + GOOD,  # a byte-order mark beyond the first line
    b"\x0c" + GOOD,
    GOOD + b"\x00",
    GOOD.replace(b", ", b",\x0b"),
    b"not json",
    b"\xff",
    b'{"timestamp": 5,',
]


#: A valid line the compiled parse refuses (a count written as a float).
REFUSED = GOOD.replace(b'"input_length": 700', b'"input_length": 700.0')


def _file(lines, *, bom=False, final_newline=True, blanks=()) -> bytes:
    body = list(lines)
    for at, blank in blanks:
        body.insert(at, blank)
    data = b"\n".join(body) + (b"\n" if final_newline else b"")
    return (b"\xef\xbb\xbf" if bom else b"") + data


@pytest.mark.parametrize("bom", [False, True])
@pytest.mark.parametrize("final_newline", [False, True])
def test_plain_lines_are_read_by_the_compiled_parse_as_the_plain_reader_reads_them(tmp_path, bom, final_newline):
    blanks = [(0, b""), (3, b"  "), (5, b"\t\r"), (len(VALID), b" \r")]
    assert _check(tmp_path, _file(VALID, bom=bom, final_newline=final_newline, blanks=blanks)) == []


@pytest.mark.parametrize("data", [b"", b"\n", b"\n\n  \n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n", b"\xef\xbb\xbf  \r\n",
                                  b"\xef\xbb\xbf" + GOOD, GOOD, b"\r\n" + GOOD + b"\r\n\r\n"])
def test_blank_lines_and_the_byte_order_mark_are_counted_as_today(tmp_path, data):
    assert _check(tmp_path, data) == []


@pytest.mark.parametrize("bad", range(len(NEAR_VALID)))
@pytest.mark.parametrize("where", [0, 3, 7])
def test_a_line_off_the_plain_shape_is_refused_and_judged_by_the_plain_reader(tmp_path, bad, where):
    lines = list(VALID[:7])
    lines.insert(where, NEAR_VALID[bad])
    refused = _check(tmp_path, _file(lines, bom=where == 0))
    assert refused == [where + 1]


@pytest.mark.parametrize("chunk_bytes", [8, 13, 64, 100, 1000])
def test_lines_across_chunk_boundaries_and_longer_than_the_buffer(tmp_path, chunk_bytes):
    rng = random.Random(chunk_bytes)
    lines = [_line(i, n, i % 7, [rng.randrange(1 << 64) for _ in range(-(-n // 512))])
             for i, n in enumerate(rng.randint(1, 9000) for _ in range(60))]
    lines[30] = REFUSED
    data = _file(lines, bom=True, blanks=[(10, b""), (20, b"   ")], final_newline=chunk_bytes % 2 == 0)
    assert _check(tmp_path, data, chunk_bytes=chunk_bytes) == [33]
    cols, report, _ = _read(tmp_path / "in.jsonl", chunk_bytes=chunk_bytes)
    assert report.num_lines == 62 and report.num_blank_lines == 2 and len(cols["arrival_ns"]) == 60


_ALPHABET = b'0123456789 \t\r\n,:{}[]"-+.eE\\x\xc3\xa9'


def _mutated(rng: random.Random, line: bytes) -> bytes:
    b = bytearray(line)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(b) + 1)
        op = rng.random()
        if op < 0.4 and at < len(b):
            b[at] = rng.choice(_ALPHABET)
        elif op < 0.7 and at < len(b):
            del b[at]
        else:
            b.insert(at, rng.choice(_ALPHABET))
    return bytes(b)


def _random_line(rng: random.Random) -> bytes:
    n_in = rng.choice([1, 511, 512, 513, rng.randint(1, 5000)])
    hashes = [rng.choice([0, 1, (1 << 64) - 1, rng.randrange(1 << 64), rng.randrange(100)])
              for _ in range(-(-n_in // 512))]
    order = rng.sample(["timestamp", "input_length", "output_length", "hash_ids"], 4)
    ws = lambda: rng.choice(["", " ", "\t", " \r "])  # noqa: E731
    ts = rng.choice([0, 1, _MAX_MS, rng.randint(0, 10**9), -rng.randint(0, 10**9), rng.randint(0, 10**7) * 0.0000005,
                     rng.uniform(-1e13, 1e13), rng.uniform(0, 1e4), float(rng.randint(0, 10**6))])
    line = _line(ts, n_in, rng.choice([0, 1, 1 << 32, 42]), hashes, tuple(order), sep=ws() + "," + ws(),
                 colon=ws() + ":" + ws(), comma=ws() + "," + ws())
    if rng.random() < 0.3:  # a field the format does not name, with a flat value
        value = rng.choice(['"s-1"', "-1.5e3", "null", "true", '[1, "a", -0.5]', "[]", '""'])
        line = line[:-1] + f'{ws()},{ws()}"{rng.choice(["session_id", "prompt", ""])}"{ws()}:{ws()}{value}}}'.encode()
    return line


def _record(ts, n_in, n_out, extra=None, hashes=None) -> dict:
    if hashes is None:
        sane = type(n_in) is int and 0 < n_in <= 4096
        hashes = list(range(n_in * 7, n_in * 7 + -(-n_in // 512))) if sane else [1]
    rec = {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": hashes}
    rec.update(extra or {})
    return rec


timestamps = st.one_of(st.integers(0, 10**7), st.floats(0, 1e7, allow_nan=False), st.integers(2**53, 2**64),
                       st.floats(-1e13, 1e13, allow_nan=False), st.integers(-10**13, 10**13),
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


@st.composite
def _mutated_plain_line(draw) -> bytes:
    rng = random.Random(draw(st.integers(0, 2**32)))
    line = _random_line(rng)
    return _mutated(rng, line) if draw(st.booleans()) else line


@st.composite
def _files(draw) -> bytes:
    body = b"\n".join(draw(st.lists(st.one_of(lines(), _mutated_plain_line()), min_size=1, max_size=12)))
    if draw(st.booleans()):
        body += b"\n"
    if draw(st.booleans()):
        body = b"\xef\xbb\xbf" + body
    return body


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_files(), st.sampled_from([None, 16, 97]))
def test_the_compiled_parse_and_the_plain_reader_agree_on_any_file(tmp_path, data, chunk_bytes):
    """Random and hostile lines (two records on a line, one split over two, invalid UTF-8 in an ignored field,
    out-of-range numbers, plain lines mutated a byte or three)."""
    _check(tmp_path, data, chunk_bytes=chunk_bytes)


def test_json_dumps_lines_are_read(tmp_path):
    """What json.dumps writes for a record of ints (the shape of the published traces) is the plain shape."""
    rng = random.Random(3)
    recs = [{"timestamp": i * 3, "input_length": n, "output_length": 5, "hash_ids": list(range(-(-n // 512)))}
            for i, n in enumerate(rng.randint(1, 3000) for _ in range(100))]
    assert _check(tmp_path, "\n".join(map(json.dumps, recs)).encode() + b"\n") == []


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_the_published_mooncake_traces(tmp_path, shared_datasets, name):
    src = shared_datasets / "mooncake" / name
    if not src.is_file():
        pytest.skip(f"{src} not found")
    cols, report, refused = _read(src)
    assert refused == [], "the published trace is in the plain shape"
    assert (cols, report) == _read(src, fast=False)[:2]


def test_token_counts_past_max_tokens_are_malformed(tmp_path):
    """input_length and output_length above MAX_TOKENS (2**32, as weka's) are the line's error; the compiled parse
    takes output_length at the cap and refuses it beyond."""
    from kmesh_trace.datasets.importers.common import MAX_TOKENS

    assert _check(tmp_path, _file([GOOD, _line(n_out=MAX_TOKENS)])) == []
    assert _check(tmp_path, _file([GOOD, _line(n_out=MAX_TOKENS + 1)])) == [2]
    cols, report, _ = _read(tmp_path / "in.jsonl")
    assert cols["num_output_tokens"] == [3]
    assert report.malformed_lines == ["in.jsonl:2: field output_length is out of range (above 4294967296)"]


def test_bailian_token_counts_past_max_tokens_are_malformed(tmp_path):
    from kmesh_trace.datasets.importers.bailian import import_bailian

    line = {"chat_id": 1, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 32, "output_length": 4,
            "type": "text", "turn": 1, "hash_ids": [7, 8]}
    src = tmp_path / "b.jsonl"
    src.write_text("\n".join(json.dumps({**line, "chat_id": i, **kv}) for i, kv in
                             enumerate([{}, {"output_length": (1 << 32) + 1}, {"output_length": 1 << 32}], 1)) + "\n")
    rep = import_bailian(src, tmp_path / "t")
    assert (rep.num_invocations, rep.num_malformed_lines) == (2, 1)
    assert rep.malformed_lines == ["b.jsonl:2: field output_length is out of range (above 4294967296)"]


@pytest.mark.parametrize("chunk_bytes", [None, 7, 4096])
def test_the_columns_are_sized_by_the_numbers_not_the_commas(tmp_path, chunk_bytes):
    """A line padded with commas sizes no hash column (before: 8 bytes a comma, 1.86 GB for 200 M of them); a
    plain file's bound is its numbers (three a row beyond its hashes), its rows at most its lines."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1' + b"," * 100_000
                    + b"]}\n" + GOOD + b"\n")
    with open(src, "rb") as f, mooncake.ReadBuffer(chunk_bytes or mooncake.CHUNK_BYTES) as buf:
        rows, hashes = mooncake._column_sizes(f, buf)
    assert (rows, hashes) == (2, 9)  # no block or chunk boundary falls in a run of digits here
    assert _check(tmp_path, src.read_bytes()) == [1]
    src.write_bytes(_file(VALID))
    with open(src, "rb") as f, mooncake.ReadBuffer(mooncake.CHUNK_BYTES) as buf:
        assert mooncake._column_sizes(f, buf) == (len(VALID), sum(len(_line_numbers(v)) for v in VALID))
    src.write_bytes(b"{" * 1000 + b"\n" + GOOD)
    with open(src, "rb") as f, mooncake.ReadBuffer(mooncake.CHUNK_BYTES) as buf:
        assert mooncake._column_sizes(f, buf)[0] == 2


def _line_numbers(line: bytes) -> list[bytes]:
    import re

    return re.findall(rb"[0-9]+", line)


def test_a_hash_fault_is_listed_once_its_batch_is_complete_and_each_batch_is_one_part(tmp_path, monkeypatch):
    """The import takes rows in batches of ROWS_PER_PART lines that are rows or hold a hash fault, and lists a
    batch's hash faults once it is complete: the order the metadata has always listed them in."""
    monkeypatch.setattr(mooncake, "ROWS_PER_PART", 3)
    bad_hash, broken = _line(hashes=[1, 1 << 64]), b"{broken"
    lines = [GOOD, bad_hash, broken, GOOD, broken, bad_hash, GOOD, broken]
    assert _check(tmp_path, _file(lines)) == [2, 3, 5, 6, 8]
    cols, report, _ = _read(tmp_path / "in.jsonl")
    assert [m.split(":")[1] for m in report.malformed_lines] == ["3", "2", "5", "8", "6"]
    assert cols["part_ends"] == [2, 3] and cols["lineno"] == [1, 4, 7]


def test_two_records_on_a_line_and_one_split_over_two_are_malformed(tmp_path):
    rec = json.dumps(_record(1, 10, 2)).encode()
    cut = rec.index(b", ") + 1  # between two fields, where JSON allows a newline
    _check(tmp_path, rec + b" " + rec + b"\n" + rec[:cut] + b"\n" + rec[cut:] + b"\n")
    cols, report, _ = _read(tmp_path / "in.jsonl")
    assert (report.num_invocations, report.num_malformed_lines) == (0, 3)


def test_invalid_utf8_in_an_ignored_field_is_malformed(tmp_path):
    rec = json.dumps(_record(1, 10, 2)).encode()
    _check(tmp_path, rec + b"\n" + rec[:-1] + b', "note": "\xff"}\n')
    _, report, _ = _read(tmp_path / "in.jsonl")
    assert report.num_invocations == 1 and report.malformed_lines == ["in.jsonl:2: invalid UTF-8"]


def test_large_integer_timestamps_are_exact(tmp_path):
    """Beyond 2**53 ns a float product is no longer exact; both readers multiply integers."""
    _check(tmp_path, json.dumps(_record(4_000_000_000_001, 10, 2)).encode() + b"\n")
    cols, _, _ = _read(tmp_path / "in.jsonl")
    assert cols["arrival_ns"] == [4_000_000_000_001 * 1_000_000]


def test_a_file_that_outgrows_its_sizes_is_read_by_the_plain_reader(tmp_path, monkeypatch):
    """Columns too small for the rows (a file that grew between the passes): the plain reader reads it all."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(_file([GOOD, REFUSED, GOOD, b"not json"]))
    want = _read(src, fast=False)[:2]
    for sizes in [(1, 100), (100, 3), (2, 100)]:
        monkeypatch.setattr(mooncake, "_column_sizes", lambda f, buf: sizes)
        assert _read(src)[:2] == want


def test_float_timestamps_round_as_python_rounds_them(tmp_path):
    """The compiled parse's timestamps (strtod, times 1e6, half to even) against Python's on numbers of every
    magnitude, ties and long decimal expansions included."""
    rng = random.Random(7)
    texts = [repr(rng.uniform(-1, 1) * 10 ** rng.randint(-9, 13)) for _ in range(1500)]
    texts += [f"{rng.randint(0, 10**7)}.{rng.choice(['5', '25', '0000005', '0000015', '0000025'])}" for _ in range(500)]
    texts += [f"{rng.randint(0, 9)}.{''.join(rng.choice('0123456789') for _ in range(rng.randint(1, 40)))}e{rng.randint(-8, 12)}"
              for _ in range(1000)]
    lines = [GOOD.replace(b'"timestamp": 5', b'"timestamp": ' + t.encode()) for t in texts]
    refused = _check(tmp_path, _file(lines))
    assert len(refused) < 50  # only the literals past 64 bytes or 2**63 ns
