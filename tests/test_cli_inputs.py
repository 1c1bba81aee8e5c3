"""Public traces read as they are (kmesh_trace.sources): a Mooncake or Bailian JSONL
file, a weka directory or file and an LMCache agent directory open as the trace their import writes,
recognised from their content; anything else is one sentence."""

from __future__ import annotations

import json
import shutil

import pytest

from bailian_data import generate_bailian
from kmesh_trace.sources import open_as_trace, sniff
from kmesh_trace.errors import InputFormatError
from kmesh_trace.trace import open_trace


def _same_as_import(src, fmt, tmp_path):
    """The trace `open_input` yields equals the one `import` writes, row for row."""
    from kmesh_trace.sources import importer

    importer(fmt)(src, tmp_path / "imported", engine_id=f"import-{fmt}")
    heard = []
    with open_as_trace(src, on_import=heard.append) as t, open_trace(tmp_path / "imported") as ref:
        got = t.scan("invocations").collect().drop("engine")
        want = ref.scan("invocations").collect().drop("engine")
        assert got.equals(want) and got.height > 0
        assert t.metadata["block_size"] == ref.metadata["block_size"]
        root = t.path
    assert heard and heard[0].startswith(f"read {src} as {fmt} input: {want.height:,} requests")
    assert not root.exists()  # the temporary trace is gone with the command


def test_mooncake_file_reads_as_its_import(tmp_path, shared_datasets):
    src = shared_datasets / "mooncake" / "conversation_trace.jsonl"
    assert sniff(src) == "mooncake"
    _same_as_import(src, "mooncake", tmp_path)


def test_bailian_file_reads_as_its_import(tmp_path):
    src = tmp_path / "bailian.jsonl"
    generate_bailian(src, num_sessions=6)
    assert sniff(src) == "bailian"
    _same_as_import(src, "bailian", tmp_path)


def test_weka_directory_and_file_read_as_their_import(tmp_path, shared_datasets):
    d = tmp_path / "weka"
    d.mkdir()
    for p in sorted((shared_datasets / "weka-claude-code").glob("*.json"))[:2]:
        shutil.copy(p, d / p.name)
    assert sniff(d) == "weka"
    _same_as_import(d, "weka", tmp_path / "dir")
    one = sorted(d.glob("*.json"))[0]
    assert sniff(one) == "weka"


def test_lmcache_agent_directory_is_recognised(tmp_path, shared_datasets):
    assert sniff(shared_datasets / "lmcache-agent-trace") == "lmcache-agent"


def test_a_trace_directory_opens_as_itself(tmp_path):
    from kmesh_trace.datasets.workloads.fork_tree import write_fork_tree

    write_fork_tree(tmp_path / "t")
    assert sniff(tmp_path / "t") is None
    with open_as_trace(tmp_path / "t", on_import=pytest.fail) as t:
        assert t.path == (tmp_path / "t")


@pytest.mark.parametrize("content, why", [
    ('{"text": "hello"}\n', "first record is not Mooncake, Bailian, weka or request-dataset input"),
    ("not json at all\n", "first record is not Mooncake, Bailian, weka or request-dataset input"),
    ("", "first record is not Mooncake, Bailian, weka or request-dataset input"),
])
def test_other_files_are_one_sentence(tmp_path, content, why):
    p = tmp_path / "x.jsonl"
    p.write_text(content)
    with pytest.raises(InputFormatError, match=why):
        sniff(p)


@pytest.mark.parametrize("content", ['{"prompt": "hello"}\n', '{"messages": [{"role": "user", "content": "hi"}]}\n',
                                     '{"custom_id": "1", "body": {"messages": []}}\n'])
def test_request_datasets_are_recognised(tmp_path, content):
    p = tmp_path / "x.jsonl"
    p.write_text(content)
    assert sniff(p) == "requests"


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(InputFormatError, match="does not exist"):
        sniff(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputFormatError, match="neither a trace directory"):
        sniff(tmp_path / "empty")


def test_a_file_of_malformed_mooncake_lines_is_refused(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": -1, "input_length": "x", "hash_ids": [1]}) for _ in range(3)))
    with pytest.raises(InputFormatError, match="holds no request readable as mooncake"):
        with open_as_trace(p):
            pass


@pytest.mark.parametrize("command", [
    ["headroom", "--policies", "lru,belady"],
    ["headroom", "--capacity-blocks", "8,32"],
    ["pressure", "--capacity-blocks", "32"],
    ["tiers", "--capacity-blocks", "32", "--host", "64"],
    ["fleet", "--engines", "2", "--capacity-blocks", "16"],
    ["lineage"],
])
def test_commands_read_a_public_file_as_its_import(tmp_path, cli, command):
    """Each analysis on a Bailian JSONL file prints exactly what it prints on the file's import."""
    from kmesh_trace.sources import importer

    src = tmp_path / "bailian.jsonl"
    generate_bailian(src, num_sessions=8)
    importer("bailian")(src, tmp_path / "imported", engine_id="import-bailian")
    direct = cli([command[0], str(src), *command[1:], "--json"])
    imported = cli([command[0], str(tmp_path / "imported"), *command[1:], "--json"])
    assert direct.exit_code == 0, direct.stderr
    assert imported.exit_code == 0, imported.stderr
    got, want = json.loads(direct.stdout), json.loads(imported.stdout)
    assert got.pop("trace", str(src)) == str(src) and want.pop("trace", None) in (None, str(tmp_path / "imported"))
    assert got == want
    assert f"read {src} as bailian input" in " ".join(direct.stderr.split())


def test_headroom_reads_the_mooncake_file_as_its_import(tmp_path, cli, shared_datasets):
    src = shared_datasets / "mooncake" / "conversation_trace.jsonl"
    from kmesh_trace.sources import importer

    importer("mooncake")(src, tmp_path / "imported", engine_id="import-mooncake")
    args = ["--window", "last-half", "--policies", "lru,belady-prefix", "--json"]
    direct, imported = cli(["headroom", str(src), *args]), cli(["headroom", str(tmp_path / "imported"), *args])
    assert direct.exit_code == imported.exit_code == 0, direct.stderr
    assert json.loads(direct.stdout) == json.loads(imported.stdout)


def _agent_line(i: int) -> str:
    return json.dumps({"timestamp": 1_760_000_000 + i, "session_id": "s", "input": "x" * (i + 1), "output": "y"}) + "\n"


def test_a_directory_of_other_programs_jsonl_is_not_an_agent_corpus(tmp_path, cli):
    d = tmp_path / "tmp"
    (d / "app").mkdir(parents=True)
    (d / "app" / "events.jsonl").write_text('{"level": "info", "msg": "started", "ts": 1}\n')
    (d / "agent.jsonl").write_text(_agent_line(0) + _agent_line(1))
    r = cli(["headroom", d])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {d} holds .jsonl files that are not LMCache agent traces (1 of 2, e.g. "
                                "app/events.jsonl: no input and timestamp or output in its first record); give a "
                                "directory of one format.")
    (d / "app" / "events.jsonl").unlink()
    (d / "blank.jsonl").write_text("\n")  # blank: no format either way
    assert sniff(d) == "lmcache-agent"


def test_a_directory_above_a_trace_names_the_trace(tmp_path, cli):
    from kmesh_trace.datasets.workloads.fork_tree import write_fork_tree

    write_fork_tree(tmp_path / "demo-out" / "trace")
    (tmp_path / "demo-out" / "summary.json").write_text('{"headroom": 1}')
    r = cli(["headroom", tmp_path / "demo-out"])
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {tmp_path / 'demo-out'} is not a trace directory, but "
                                f"{tmp_path / 'demo-out' / 'trace'} is: give that.")


def test_a_directory_of_json_files_that_are_not_conversations_is_refused(tmp_path):
    (tmp_path / "a.json").write_text('{"id": "a", "block_size": 4, "hash_id_scope": "local", "requests": []}')
    (tmp_path / "package.json").write_text('{"name": "x", "version": "1.0.0"}')
    with pytest.raises(InputFormatError, match=r"not weka conversations \(1 of 2, e.g. package.json\)"):
        sniff(tmp_path)


def _mooncake_line(ids, pad: str = "") -> str:
    return '{"timestamp": 0, "input_length": %d, "output_length": 1, "hash_ids": [%s%s]}\n' % (
        512 * len(ids), ", ".join(map(str, ids)), pad)


@pytest.mark.parametrize("first", [
    _mooncake_line(range(300_000)),  # a first line of 2.3 MB: read as the import reads it
    _mooncake_line([1], "," * (3 << 20)),  # padded with commas past the head: one malformed line, as the import
])
def test_a_first_line_longer_than_the_sniffed_head_reads_as_its_import(tmp_path, first):
    src = tmp_path / "long.jsonl"
    src.write_text(first + _mooncake_line([7, 8]))
    assert len(first) > 1 << 20
    assert sniff(src) == "mooncake"
    _same_as_import(src, "mooncake", tmp_path)


def test_a_long_first_record_is_recognised_by_its_head_or_refused_in_one_sentence(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps({"messages": [{"role": "user", "content": "a " * 700_000}]}) + "\n")
    assert sniff(p) == "requests"
    p.write_text(json.dumps({"text": "a " * 700_000}) + "\n")
    with pytest.raises(InputFormatError, match=r"is not a trace directory, and the first 1 MiB of its first record "
                                               r"name no Mooncake, Bailian, weka or request-dataset field;"):
        sniff(p)
    big = tmp_path / "c.json"  # a weka conversation over the head: its keys come first
    big.write_text(json.dumps({"id": "c", "block_size": 64, "hash_id_scope": "local",
                               "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": list(range(300_000))}]}))
    assert sniff(big) == "weka"
