"""The compiled Mooncake line reader (datasets/importers/mooncake_lines.py, native/kernels/mooncake_lines.c) against
the importer's msgspec and plain readers: on every file it reads, the same columns and report as both; on every
file where the plain reader finds a bad line (and on every line it is not certain about), a give-up, so that
the others decide."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kmesh_trace.datasets.importers import mooncake
from kmesh_trace.datasets.importers.mooncake_lines import read_lines

_FIELDS = ("lineno", "num_prompt_tokens", "num_output_tokens", "arrival_ns", "offsets", "hashes")
_MAX_MS = ((1 << 63) - 1) // 1_000_000


def _columns(cols) -> dict:
    return {name: [int(v) for v in getattr(cols, name)] for name in _FIELDS}


def _plain(src):
    cols, report = mooncake.read_mooncake(src, fast=False)
    return _columns(cols), report


def _msgspec(src):
    data = src.read_bytes()
    counts = mooncake._line_counts(data)
    cols = mooncake._decoded_columns(data, counts[0] - counts[1]) if counts is not None else None
    return None if cols is None else (_columns(cols), counts)


def _check(tmp_path, data: bytes, *, taken: bool | None = None, chunk_bytes: int | None = None):
    """The C reader on `data` agrees with the plain reader (and msgspec where it reads the file); returns whether
    it read the file. `taken`: whether it must have."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    got = read_lines(src) if chunk_bytes is None else read_lines(src, chunk_bytes)
    plain_cols, plain_report = _plain(src)
    if taken is not None:
        assert (got is not None) == taken, data[:300]
    if got is None:
        return False
    assert plain_report.num_malformed_lines == 0, (data[:300], plain_report.malformed_lines)
    assert _columns(got) == plain_cols
    assert (got.num_lines, got.num_blank_lines) == (plain_report.num_lines, plain_report.num_blank_lines)
    assert got.hashes.typecode == "Q" and got.arrival_ns.dtype == np.int64
    decoded = _msgspec(src)
    if decoded is not None:
        assert decoded == (plain_cols, (got.num_lines, got.num_blank_lines))
    fast_cols, fast_report = mooncake.read_mooncake(src)  # the reader the analyses call takes the C path
    assert _columns(fast_cols) == plain_cols and fast_report == plain_report
    assert isinstance(fast_cols.offsets, np.ndarray)
    return True


def _line(ts=5, n_in=700, n_out=3, hashes=None, order=("timestamp", "input_length", "output_length", "hash_ids"),
          sep=", ", colon=": ", comma=", ") -> bytes:
    values = {"timestamp": str(ts), "input_length": str(n_in), "output_length": str(n_out),
              "hash_ids": "[" + comma.join(str(h) for h in (hashes if hashes is not None else
                                                              range(1, 1 + -(-n_in // 512)))) + "]"}
    return ("{" + sep.join(f'"{k}"{colon}{values[k]}' for k in order) + "}").encode()


GOOD = _line()

#: Lines in the plain shape: the C reader takes a file of them.
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
]

#: Lines the C reader must give up on (the msgspec and plain readers decide: some are valid for them).
NEAR_VALID = [
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 5.0'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 5e0'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": 5E2'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -5'),
    GOOD.replace(b'"timestamp": 5', b'"timestamp": -0'),
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
    GOOD[:-1] + b', "extra": 1}',
    GOOD[:-1] + b', "note": "caf\xc3\xa9"}',
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


def _file(lines, *, bom=False, final_newline=True, blanks=()) -> bytes:
    body = list(lines)
    for at, blank in blanks:
        body.insert(at, blank)
    data = b"\n".join(body) + (b"\n" if final_newline else b"")
    return (b"\xef\xbb\xbf" if bom else b"") + data


@pytest.mark.parametrize("bom", [False, True])
@pytest.mark.parametrize("final_newline", [False, True])
def test_plain_lines_are_read_as_the_other_readers_read_them(tmp_path, bom, final_newline):
    blanks = [(0, b""), (3, b"  "), (5, b"\t\r"), (len(VALID), b" \r")]
    assert _check(tmp_path, _file(VALID, bom=bom, final_newline=final_newline, blanks=blanks), taken=True)


@pytest.mark.parametrize("data", [b"", b"\n", b"\n\n  \n", b"\xef\xbb\xbf", b"\xef\xbb\xbf\n", b"\xef\xbb\xbf  \r\n",
                                  b"\xef\xbb\xbf" + GOOD, GOOD, b"\r\n" + GOOD + b"\r\n\r\n"])
def test_blank_lines_and_the_byte_order_mark_are_counted_as_today(tmp_path, data):
    assert _check(tmp_path, data, taken=True)


@pytest.mark.parametrize("bad", range(len(NEAR_VALID)))
@pytest.mark.parametrize("where", [0, 3, 7])
def test_a_line_off_the_plain_shape_gives_up_the_whole_file(tmp_path, bad, where):
    lines = list(VALID[:7])
    lines.insert(where, NEAR_VALID[bad])
    assert not _check(tmp_path, _file(lines, bom=where == 0), taken=False)
    # ... and the readers that decide see what they always saw (the plain one is the reference)
    src = tmp_path / "in.jsonl"
    cols, report = mooncake.read_mooncake(src)
    assert (_columns(cols), report) == _plain(src)


@pytest.mark.parametrize("chunk_bytes", [8, 13, 64, 100, 1000])
def test_lines_across_chunk_boundaries_and_longer_than_the_buffer(tmp_path, chunk_bytes):
    rng = random.Random(chunk_bytes)
    lines = [_line(i, n, i % 7, [rng.randrange(1 << 64) for _ in range(-(-n // 512))])
             for i, n in enumerate(rng.randint(1, 9000) for _ in range(60))]
    data = _file(lines, bom=True, blanks=[(10, b""), (20, b"   ")], final_newline=chunk_bytes % 2 == 0)
    assert _check(tmp_path, data, taken=True, chunk_bytes=chunk_bytes)
    got = read_lines(tmp_path / "in.jsonl", chunk_bytes)
    assert got.num_lines == 62 and got.num_blank_lines == 2 and len(got.arrival_ns) == 60


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
    return _line(rng.choice([0, 1, _MAX_MS, rng.randint(0, 10**9)]), n_in, rng.choice([0, 1, 1 << 32, 42]),
                 hashes, tuple(order), sep=ws() + "," + ws(), colon=ws() + ":" + ws(), comma=ws() + "," + ws())


@pytest.mark.parametrize("seed", range(150))
def test_random_valid_and_near_valid_files(tmp_path, seed):
    """Random plain lines, some mutated a byte or three (a mutation may leave a valid line, or one the other
    readers accept): whenever the C reader reads the file, both others read the same; whenever the plain
    reader finds a bad line, the C reader gave up."""
    rng = random.Random(seed)
    lines = [_random_line(rng) for _ in range(rng.randint(1, 12))]
    mutate = seed % 3 != 0
    if mutate:
        for i in rng.sample(range(len(lines)), rng.randint(1, len(lines))):
            lines[i] = _mutated(rng, lines[i])
    data = _file(lines, bom=rng.random() < 0.3, final_newline=rng.random() < 0.7,
                 blanks=[(rng.randrange(len(lines) + 1), rng.choice([b"", b" ", b"\t\r"]))] if rng.random() < 0.3 else ())
    taken = _check(tmp_path, data, taken=None if mutate else True, chunk_bytes=rng.choice([None, 16, 97]))
    if not taken:
        src = tmp_path / "in.jsonl"
        cols, report = mooncake.read_mooncake(src)
        assert (_columns(cols), report) == _plain(src)


def test_json_dumps_lines_are_read(tmp_path):
    """What json.dumps writes for a record of ints (the shape of the published traces) is the plain shape."""
    rng = random.Random(3)
    recs = [{"timestamp": i * 3, "input_length": n, "output_length": 5, "hash_ids": list(range(-(-n // 512)))}
            for i, n in enumerate(rng.randint(1, 3000) for _ in range(100))]
    assert _check(tmp_path, "\n".join(map(json.dumps, recs)).encode() + b"\n", taken=True)


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_the_published_mooncake_traces(tmp_path, shared_datasets, name):
    src = shared_datasets / "mooncake" / name
    if not src.is_file():
        pytest.skip(f"{src} not found")
    got = read_lines(src)
    assert got is not None, "the published trace is in the plain shape"
    plain_cols, plain_report = _plain(src)
    assert _columns(got) == plain_cols
    assert (got.num_lines, got.num_blank_lines) == (plain_report.num_lines, plain_report.num_blank_lines)
    assert _msgspec(src) == (plain_cols, (got.num_lines, got.num_blank_lines))



def test_token_counts_past_max_tokens_are_malformed_in_every_reader(tmp_path):
    """input_length and output_length above MAX_TOKENS (2**32, as weka's) are the line's error in the compiled,
    msgspec and plain readers alike (before: the C and msgspec readers took output_length up to 2**63 - 1)."""
    from kmesh_trace.datasets.importers.common import MAX_TOKENS

    at_cap = _line(n_out=MAX_TOKENS)
    assert _check(tmp_path, _file([GOOD, at_cap]), taken=True)
    src = tmp_path / "in.jsonl"
    src.write_bytes(_file([GOOD, _line(n_out=MAX_TOKENS + 1)]))
    assert read_lines(src) is None and _msgspec(src) is None
    for fast in (True, False):
        cols, report = mooncake.read_mooncake(src, fast=fast)
        assert _columns(cols)["num_output_tokens"] == [3]
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
    """A line padded with commas sizes no hash column before the parse gives it up (before: 8 bytes a comma,
    1.86 GB for 200 M of them); a plain file's bound is its numbers (three a row beyond its hashes)."""
    from kmesh_trace.datasets.importers.mooncake_lines import CHUNK_BYTES, _Buffer, _column_sizes

    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1' + b"," * 100_000
                    + b"]}\n" + GOOD + b"\n")
    with open(src, "rb") as f, _Buffer(chunk_bytes or CHUNK_BYTES) as buf:
        rows, hashes = _column_sizes(f, buf)
    assert (rows, hashes) == (2, 9)  # no block or chunk boundary falls in a run of digits here
    assert read_lines(src) is None
    src.write_bytes(_file(VALID))
    with open(src, "rb") as f, _Buffer(CHUNK_BYTES) as buf:
        assert _column_sizes(f, buf) == (len(VALID), sum(len(_line_numbers(v)) for v in VALID))


def _line_numbers(line: bytes) -> list[bytes]:
    import re

    return re.findall(rb"[0-9]+", line)
