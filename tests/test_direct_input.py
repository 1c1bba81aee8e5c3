"""A public JSONL read straight into the workload (and the peer figures; kmesh_trace.sources
`read_directly`): the same workload as the imported trace gives, the same bad lines counted, and no polars,
pyarrow or duckdb loaded for it."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys

import numpy as np
import pytest

from bailian_data import generate_bailian
from kmesh_trace.sources import importer, read_directly
from kmesh_trace.oracle.workload import Workload
from kmesh_trace.trace import open_trace

_BAD_MOONCAKE = [
    '{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}', "not json", "", "   ",
    '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, -2]}',
    '{"timestamp": 1, "input_length": 600.0, "output_length": 1, "hash_ids": [1, 2]}',
    '{"timestamp": NaN, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}', "[1, 2]",
    '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, 18446744073709551616]}',
    '{"timestamp": 1, "input_length": 600, "output_length": true, "hash_ids": [1, 2]}',
    '{"timestamp": 1e400, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}',
    '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2], "extra": {"nested": [1]}}',
    '{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}{"timestamp": 2}',
]


def _mooncake(path, n=400, *, seed=0, bad=(), unordered=False, bom=False):
    rng = random.Random(seed)
    lines, t = [], 0.0
    for i in range(n):
        n_in = rng.randint(1, 4000)
        t += rng.choice([0, 1, 250.5]) if not unordered or i % 5 else -rng.randint(0, 3000)
        hashes = [rng.randrange(40) if j < 2 else rng.randrange(1 << 64) for j in range(-(-n_in // 512))]
        lines.append(json.dumps({"timestamp": t, "input_length": n_in, "output_length": rng.randint(0, 300),
                                 "hash_ids": hashes}))
    for b in bad:
        lines.insert(rng.randrange(len(lines) + 1), b)
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + ("\n".join(lines) + "\n").encode())
    return path


def _bailian(path, *, seed=0, malformed_every=0, shuffled=False):
    generate_bailian(path, num_sessions=60, max_turns=5, seed=seed, malformed_every=malformed_every)
    if shuffled:  # children before their parents, a dangling parent, a repeated chat id
        lines = path.read_text().splitlines()
        random.Random(seed).shuffle(lines)
        lines.append(json.dumps({"chat_id": 99999, "parent_chat_id": 88888, "timestamp": 1.5, "input_length": 20,
                                 "output_length": 3, "type": "text", "turn": 2, "hash_ids": [1, 2]}))
        lines.append(lines[3])
        path.write_text("\n".join(lines) + "\n")
    return path


def _cases(tmp_path):
    yield "mooncake", _mooncake(tmp_path / "clean.jsonl")
    yield "mooncake", _mooncake(tmp_path / "bom-unordered.jsonl", seed=1, unordered=True, bom=True)
    yield "mooncake", _mooncake(tmp_path / "bad.jsonl", seed=2, bad=_BAD_MOONCAKE)
    yield "bailian", _bailian(tmp_path / "bailian.jsonl")
    yield "bailian", _bailian(tmp_path / "bailian-bad.jsonl", seed=1, malformed_every=7)
    yield "bailian", _bailian(tmp_path / "bailian-shuffled.jsonl", seed=2, shuffled=True)


def _requests(w: Workload) -> list[dict]:
    return [dataclasses.asdict(r) for r in w.requests]


def _stream(w: Workload) -> dict:
    s = w.stream
    return {f.name: (getattr(s, f.name).tolist() if isinstance(getattr(s, f.name), np.ndarray) else getattr(s, f.name))
            for f in dataclasses.fields(s)}


def test_the_workload_read_directly_is_the_imported_traces(tmp_path):
    for fmt, src in _cases(tmp_path):
        report = importer(fmt)(src, tmp_path / f"{src.stem}-trace", engine_id=f"import-{fmt}")
        heard = []
        public = read_directly(src, on_import=heard.append)
        assert public is not None and public.format == fmt, src
        with open_trace(tmp_path / f"{src.stem}-trace") as t:
            assert public.engines.keys() == t.engines.keys()
            for key in ("block_size", "source", "complete", "num_malformed_lines", "malformed_lines", "engine",
                        "capture_config"):
                assert public.metadata[key] == t.metadata[key], (src, key)
            for requests in (True, False):
                want, got = Workload.from_trace(t, requests=requests), Workload.from_trace(public, requests=requests)
                assert (got.requests is None) == (want.requests is None), src
                if want.requests is not None:
                    assert _requests(got) == _requests(want), src
                assert _stream(got) == _stream(want), src
                assert (got.block_size, got.num_usable_blocks, got.edges, got.num_partitions, got.stock_tokens) == \
                       (want.block_size, want.num_usable_blocks, want.edges, want.num_partitions, want.stock_tokens)
        assert report.num_invocations == len(public.invocations_in_memory) > 0
        assert heard[0].startswith(f"read {src} as {fmt} input: {report.num_invocations:,} requests")
        assert (f"{report.num_malformed_lines:,} malformed lines skipped" in heard[0]) == bool(report.num_malformed_lines)


def test_both_mooncake_readers_agree(tmp_path):
    from kmesh_trace.datasets.importers import mooncake

    for _, src in _cases(tmp_path):
        if src.name.startswith("bailian"):
            continue
        fast, plain = mooncake.read_mooncake(src), mooncake.read_mooncake(src, fast=False)
        assert _mooncake_columns(fast[0]) == _mooncake_columns(plain[0]) and fast[1] == plain[1], src


def _mooncake_columns(cols) -> dict:
    return {k: v.tolist() if isinstance(v, np.ndarray) else list(v) for k, v in cols.__dict__.items()}


def test_the_workload_read_through_the_compiled_reader_is_the_imported_traces(tmp_path):
    """Integer timestamps (the published traces' shape) go through the compiled parse alone
    (native/kernels/mooncake_lines.c); its workload is the import's, rows out of arrival order too."""
    rng = random.Random(11)
    lines, t = [], 0
    for i in range(300):
        n_in = rng.randint(1, 5000)
        t = max(0, t + (rng.choice([0, 3, 250]) if i % 7 else -rng.randint(0, 900)))
        lines.append(json.dumps({"timestamp": t, "input_length": n_in, "output_length": rng.randint(0, 400),
                                 "hash_ids": [rng.randrange(60) if j < 2 else rng.randrange(1 << 64)
                                              for j in range(-(-n_in // 512))]}))
    lines.insert(5, "")
    src = tmp_path / "plain.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + ("\n".join(lines) + "\n").encode())
    importer("mooncake")(src, tmp_path / "trace", engine_id="import-mooncake")
    public = read_directly(src)
    with open_trace(tmp_path / "trace") as t:
        for requests in (True, False):
            want, got = Workload.from_trace(t, requests=requests), Workload.from_trace(public, requests=requests)
            if want.requests is not None:
                assert _requests(got) == _requests(want)
            assert _stream(got) == _stream(want)


def test_a_float_hash_is_a_bad_line_for_the_import_and_the_direct_reader(tmp_path):
    """pa.array used to truncate a float hash (2.5 -> 2) in the import's plain path; both readers now refuse it
    as require_hash_list does."""
    src = _mooncake(tmp_path / "float.jsonl", n=50,
                    bad=['{"timestamp": 1, "input_length": 600, "output_length": 1, "hash_ids": [1, 2.5]}'])
    report = importer("mooncake")(src, tmp_path / "t", engine_id="import-mooncake")
    public = read_directly(src)
    assert report.num_malformed_lines == public.metadata["num_malformed_lines"] == 1
    assert "not a 64-bit unsigned integer" in report.malformed_lines[0]
    assert report.num_invocations == len(public.invocations_in_memory) == 50


def test_headroom_and_pressure_on_the_file_print_what_they_print_on_the_imported_trace(tmp_path, cli):
    for fmt, src in [*list(_cases(tmp_path))[::2], ("bailian", tmp_path / "bailian-shuffled.jsonl")]:
        cli(["import", fmt, src, "--out", tmp_path / f"{src.stem}-trace"])
        for args in (["headroom", "--window", "last-half", "--json"], ["headroom", "--capacity-blocks", "8,64,256", "--json"],
                     ["headroom", "--policies", "lru,belady", "--window", "last-half"],
                     ["pressure", "--capacity-blocks", "64", "--edges", "declared", "--json"],
                     ["pressure", "--capacity-blocks", "8,64", "--json"]):
            direct, imported = cli([args[0], src, *args[1:]]), cli([args[0], tmp_path / f"{src.stem}-trace", *args[1:]])
            assert direct.exit_code == imported.exit_code, (direct.stderr, imported.stderr)
            assert direct.stdout == imported.stdout, (src, args)
            if imported.exit_code:  # the same refusal
                assert direct.stderr.endswith(imported.stderr), (direct.stderr, imported.stderr)
            assert f"read{src}as{fmt}input" in "".join(direct.stderr.split())  # rich wraps the line


# One Python process runs every command below in turn (instead of a process each: the start-ups were most of
# the time) and prints, after each, which of the columnar libraries it has loaded so far. A library loaded by a
# command stays loaded, so the first command that loads one is the first line that names it.
_COLUMNAR_FREE_COMMANDS = [["tiers", "--capacity-blocks", "64", "--host", "256", "--json"],
                           ["fleet", "--capacity-blocks", "64", "--engines", "2", "--json"],
                           ["headroom", "--policies", "lru,belady", "--json"], ["lineage", "--json"]]


@pytest.fixture(scope="module")
def columnar_libraries_loaded(tmp_path_factory):
    """{(command, "mooncake" | "weka"): the columnar libraries loaded once that command had run on that input}."""
    tmp = tmp_path_factory.mktemp("columnar-free")
    sources = {"mooncake": _mooncake(tmp / "clean.jsonl", n=100), "weka": _weka_dir(tmp / "weka", seed=5)}
    runs = [(command[0], kind, [command[0], str(src), *command[1:]])
            for command in _COLUMNAR_FREE_COMMANDS for kind, src in sources.items()]
    code = ("import json, sys, contextlib, io, kmesh_trace.cli as c\n"
            f"for name, kind, argv in {runs!r}:\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
            "        try:\n"
            "            c._lazy_group().main(argv, prog_name='kmesh-trace')\n"
            "        except SystemExit as e:\n"
            "            assert e.code == 0, (argv, e.code)\n"
            "    loaded = sorted({m.split('.')[0] for m in sys.modules} & {'polars', 'pyarrow', 'duckdb'})\n"
            "    print(json.dumps([name, kind, loaded]), flush=True)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [(name, kind) for name, kind, _ in lines] == [(name, kind) for name, kind, _ in runs]
    return {(name, kind): loaded for name, kind, loaded in lines}


def test_headroom_on_a_jsonl_file_loads_neither_polars_nor_pyarrow_nor_duckdb(columnar_libraries_loaded):
    assert columnar_libraries_loaded["headroom", "mooncake"] == []


@pytest.mark.parametrize("name", ["conversation_trace.jsonl", "synthetic_trace.jsonl"])
def test_the_mooncake_samples_read_directly_as_imported(tmp_path, shared_datasets, name):
    src = shared_datasets / "mooncake" / name
    importer("mooncake")(src, tmp_path / "t", engine_id="import-mooncake")
    public = read_directly(src)
    with open_trace(tmp_path / "t") as t:
        assert _stream(Workload.from_trace(public, requests=False)) == _stream(Workload.from_trace(t, requests=False))
        assert _requests(Workload.from_trace(public)) == _requests(Workload.from_trace(t))


# ---- weka directories, and tiers, fleet and lineage read as they are ---------------------------------------

def _weka_dir(d, *, seed=0, num_files=4, bad=False):
    """Conversations with nested sub-agents, requests out of time order, and (`bad`) malformed entries and files."""
    rng = random.Random(seed)
    d.mkdir()

    def request(t):
        n = rng.randint(1, 12)
        return {"t": t, "type": "n", "in": n * 4 + rng.randint(0, 3), "out": rng.choice([None, 3, 40]),
                "hash_ids": [rng.randrange(6) if j < 2 else rng.randrange(1 << 20) for j in range(n)],
                "api_time": rng.choice([None, 0.5, 2.0]), "ttft": 0.1, "stop": rng.choice(["end_turn", "max_tokens"])}

    def thread(depth, t0):
        entries = []
        for _ in range(rng.randint(1, 6)):
            t = round(t0 + rng.uniform(0, 30), 3)
            if depth < 2 and rng.random() < 0.3:
                entries.append({"t": t, "type": "subagent", "agent_id": rng.choice([None, f"a{rng.randrange(3)}"]),
                                "subagent_type": "Explore", "requests": thread(depth + 1, 0.0)})
            else:
                entries.append(request(t))
        rng.shuffle(entries)  # times out of file order
        return entries

    for k in range(num_files):
        conv = {"id": f"c{k}", "block_size": 4, "hash_id_scope": "global" if k == 1 else "local",
                "requests": thread(0, 0.0)}
        if bad and k == 2:
            conv["requests"].append({"t": -1, "type": "n", "in": 8, "out": 1, "hash_ids": [1, 2]})
            conv["requests"].append({"t": 1, "type": "n", "in": 8, "out": 1, "hash_ids": [1, "x"]})
            conv["requests"].append({"t": 1, "type": "n", "in": 8, "out": 1, "hash_ids": [1, 2, 3]})
        text = json.dumps(conv)
        (d / f"c{k}.json").write_bytes((b"\xef\xbb\xbf" if bad and k == 0 else b"") + text.encode())
    if bad:
        (d / "broken.json").write_text('{"id": "x", "block_size": 4, "requests": [')
    return d


def _all_cases(tmp_path):
    yield from _cases(tmp_path)
    yield "weka", _weka_dir(tmp_path / "weka", seed=3)
    yield "weka", _weka_dir(tmp_path / "weka-bad", seed=4, bad=True)


def test_a_weka_directory_read_directly_is_its_import(tmp_path):
    for fmt, src in _all_cases(tmp_path):
        if fmt != "weka":
            continue
        report = importer(fmt)(src, tmp_path / f"{src.name}-trace", engine_id="import-weka")
        public = read_directly(src)
        assert public is not None and public.format == "weka"
        with open_trace(tmp_path / f"{src.name}-trace") as t:
            for key in ("block_size", "source", "complete", "num_malformed_lines", "malformed_lines", "engine",
                        "capture_config", "arrival", "import_counts"):
                assert public.metadata[key] == t.metadata[key], (src, key)
            assert public.row_counts() == {k: v for k, v in t.row_counts().items() if k in ("invocations", "lineage")}
            for requests in (True, False):
                want, got = Workload.from_trace(t, requests=requests), Workload.from_trace(public, requests=requests)
                if requests:
                    assert _requests(got) == _requests(want) and any(r.finish_ns is not None for r in got.requests)
                assert _stream(got) == _stream(want)
            for merged in (True, False):
                assert _requests(Workload.from_trace(public, merged=merged)) == _requests(Workload.from_trace(t, merged=merged))
        assert report.num_malformed_lines == public.metadata["num_malformed_lines"]
        assert bool(report.num_malformed_lines) == src.name.endswith("bad")


_COMMANDS = (
    ["tiers", "--capacity-blocks", "40", "--host", "200", "--json"],
    ["tiers", "--capacity-blocks", "30", "--host", "100", "--ssd", "400", "--prefill-tokens-per-s", "5000"],
    ["tiers", "--capacity-blocks", "30", "--sweep-host", "0,50,200", "--json"],
    ["tiers"],  # refused the same way: an import records no usable blocks
    ["fleet", "--capacity-blocks", "16,64", "--engines", "1,3", "--json"],
    ["fleet", "--capacity-blocks", "32", "--engines", "2", "--edges", "inferred"],
    ["fleet", "--capacity", "1MiB", "--kv-bytes-per-token", "1024", "--engines", "2", "--csv"],
    ["lineage", "--json"], ["lineage"], ["lineage", "--csv"], ["lineage", "--edges", "declared", "--json"],
)
_WEKA_ONLY = (["headroom", "--window", "last-half", "--json"], ["headroom", "--capacity-blocks", "8,64"],
              ["pressure", "--capacity-blocks", "64", "--edges", "declared", "--json"])


def test_tiers_fleet_and_lineage_on_the_input_print_what_they_print_on_its_import(tmp_path, cli):
    for fmt, src in _all_cases(tmp_path):
        trace = tmp_path / f"{src.name}-imported"
        assert cli(["import", fmt, src, "--out", trace]).exit_code == 0
        for args in _COMMANDS + (_WEKA_ONLY if fmt == "weka" else ()):
            direct, imported = cli([args[0], src, *args[1:]]), cli([args[0], trace, *args[1:]])
            assert direct.exit_code == imported.exit_code, (src, args, direct.stderr, imported.stderr)
            want = imported.stdout
            if args[0] == "tiers":  # tiers names its input as given
                want = want.replace(json.dumps(str(trace)), json.dumps(str(src)))
            assert direct.stdout == want, (src, args)
            if imported.exit_code:  # the same refusal
                assert direct.stderr.endswith(imported.stderr), (direct.stderr, imported.stderr)
            assert f"read{src}as{fmt}input" in "".join(direct.stderr.split()), (src, args)


@pytest.mark.parametrize("command", [c[0] for c in _COLUMNAR_FREE_COMMANDS])
def test_tiers_fleet_lineage_and_headroom_read_a_file_or_weka_directory_without_the_columnar_libraries(
        columnar_libraries_loaded, command):
    assert columnar_libraries_loaded[command, "mooncake"] == [] and columnar_libraries_loaded[command, "weka"] == []


def test_an_empty_or_unreadable_weka_directory_is_refused_as_its_import_refuses_it(tmp_path, cli):
    d = tmp_path / "w"
    d.mkdir()
    (d / "broken.json").write_text("{")
    for command in (["tiers", "--capacity-blocks", "8"], ["fleet", "--capacity-blocks", "8"], ["lineage"]):
        r = cli([command[0], d, *command[1:]])
        assert r.exit_code == 1 and r.stderr.count("Error:") == 1, (command, r.stderr)
        assert "holds no request readable as weka input" in "".join(r.stderr.split("\n")), r.stderr


# ---- the id parser (native/kernels/parse_ids.c) against its plain reference ------------------------------

def test_the_compiled_id_parser_equals_the_plain_one_status_and_ids():
    from kmesh_trace.datasets.importers import weka

    fixed = [b"0", b"1", b"0,1,9223372036854775807", b"9223372036854775808", b"18446744073709551616", b"01", b"00",
             b"1,,2", b",1", b"1,", b",", b"1a", b"1,2,3,0", b"10,0,007", b"9223372036854775806,5"]
    rng = random.Random(7)
    alphabet = b"0123456789,,,0"
    randoms = [bytes(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(3000)]
    big = [b",".join(b"%d" % rng.randrange(1 << rng.choice([8, 40, 62, 63, 64])) for _ in range(50)) for _ in range(200)]
    seen = set()
    for text in fixed + randoms + big:
        status, got = weka._parse_ids(text)
        want_status, want = weka._parse_ids_plain(text)
        assert (status, got.tolist()) == (want_status, want), text
        seen.add(status)
        if status == weka._IDS_OK:  # what JSON reads, when every item is a plain non-negative int64
            assert got.tolist() == json.loads(b"[" + text + b"]")
    assert seen == {weka._IDS_OK, weka._IDS_EMPTY, weka._IDS_ZERO, weka._IDS_RANGE, weka._IDS_CHAR}  # every code met


def test_weka_id_lists_load_no_columnar_library():
    code = ("import sys, kmesh_trace.datasets.importers.weka as w\n"
            "w.parse_id_lists(b'1,2,3')\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'pyarrow', 'polars'}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"


def _latest_at_or_before_plain(items, t, before):
    """The linear scan the sub-agents' parents were found with (quadratic in sub-agents): the reference."""
    best = None
    for ti, i in items:
        if ti <= t and i < before:
            best = i
        elif ti > t:
            break
    return best


def test_a_sub_agents_parent_by_binary_search_is_the_linear_scans():
    from kmesh_trace.datasets.importers.weka import _latest_at_or_before

    rng = random.Random(11)
    for _ in range(2000):
        times = sorted(rng.choice([0.0, 0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(rng.randint(0, 12)))
        positions = sorted(rng.sample(range(40), len(times)))
        items = list(zip(times, positions))
        t, before = rng.choice([-1.0, 0.0, 0.5, 1.0, 1.7, 2.0, 5.0]), rng.randrange(42)
        assert _latest_at_or_before((times, positions), t, before) == _latest_at_or_before_plain(items, t, before)
