"""`kmesh-trace export mooncake`: a trace's requests as Mooncake JSONL, and the round trips back through the
importer (identical lines; the same headroom at the export's block size)."""

from __future__ import annotations

import json
import random

import pytest

from kmesh_trace.writer import TraceWriter

#: A Mooncake file: shared prefixes (ids 0 and 1), partial last blocks, a float timestamp, ties.
MOONCAKE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 3]},
    {"timestamp": 12.5, "input_length": 1536, "output_length": 40, "hash_ids": [0, 1, 4]},
    {"timestamp": 3001, "input_length": 1, "output_length": 0, "hash_ids": [5]},
]


def _lines(recs) -> str:
    return "".join(json.dumps(r) + "\n" for r in recs)


def test_mooncake_file_import_export_gives_identical_lines(tmp_path, cli):
    src = tmp_path / "m.jsonl"
    src.write_text(_lines(MOONCAKE))
    assert cli(["import", "mooncake", src, "--out", tmp_path / "t"]).exit_code == 0
    r = cli(["export", "mooncake", tmp_path / "t", "--out", tmp_path / "back.jsonl", "--json"])
    assert r.exit_code == 0, r.stdout
    assert (tmp_path / "back.jsonl").read_bytes() == src.read_bytes()
    s = json.loads(r.stdout)
    assert (s["num_lines"], s["num_hash_ids"], s["num_distinct_hash_ids"], s["hash_source"]) == (4, 9, 6, "listed")


@pytest.mark.shared_data
def test_public_mooncake_slice_round_trips_byte_for_byte(tmp_path, cli, shared_datasets):
    src = tmp_path / "slice.jsonl"
    with open(shared_datasets / "mooncake" / "conversation_trace.jsonl", "rb") as f:
        src.write_bytes(b"".join(next(f) for _ in range(3000)))
    assert cli(["import", "mooncake", src, "--out", tmp_path / "t"]).exit_code == 0
    assert cli(["export", "mooncake", tmp_path / "t", "--out", tmp_path / "back.jsonl"]).exit_code == 0
    assert (tmp_path / "back.jsonl").read_bytes() == src.read_bytes()


def test_split_and_grouped_hash_ids_keep_prefix_sharing(tmp_path, cli):
    src = tmp_path / "m.jsonl"
    src.write_text(_lines(MOONCAKE))
    cli(["import", "mooncake", src, "--out", tmp_path / "t"])
    assert cli(["export", "mooncake", tmp_path / "t", "--out", tmp_path / "s.jsonl", "--block-tokens", "256"]).exit_code == 0
    split = [json.loads(x)["hash_ids"] for x in open(tmp_path / "s.jsonl")]
    # 512-token id k becomes (k, 0), (k, 1), numbered in order of first use; a partial block keeps its first halves.
    assert split == [[0, 1, 2, 3, 4], [0, 1, 5], [0, 1, 2, 3, 6, 7], [8]]
    assert cli(["export", "mooncake", tmp_path / "t", "--out", tmp_path / "g.jsonl", "--block-tokens", "1024"]).exit_code == 0
    grouped = [json.loads(x)["hash_ids"] for x in open(tmp_path / "g.jsonl")]
    assert grouped == [[0, 1], [2], [0, 3], [4]]  # ids of hashes 1, 2, 3, 4 (the last of each group), 5
    r = cli(["export", "mooncake", tmp_path / "t", "--out", tmp_path / "x.jsonl", "--block-tokens", "300"])
    assert r.exit_code == 1 and "divisor or a multiple of 512" in r.stdout + r.stderr


def _capture(path, *, output_tokens: int, seed: int = 7, n: int = 40) -> list[dict]:
    """A capture-shaped trace (real TraceWriter) at block size 4: prompts from five shared prefixes."""
    rng = random.Random(seed)
    meta = {"engine_index": 0, "engine": "vllm 0.32.0", "model": "tiny", "block_size": 4, "num_usable_blocks": 24,
            "null_block_id": 0}
    w = TraceWriter(path, "e0", meta, source="capture")
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 20))] for _ in range(5)]
    rows = []
    for i in range(n):
        p = prefixes[rng.randrange(5)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        t = 1_000_000 * (i + 1) + 7
        rows.append({"request_id": f"r{i}", "seq": i, "num_prompt_tokens": len(p), "num_output_tokens": output_tokens,
                     "prompt_token_ids": p, "output_token_ids": list(range(2000, 2000 + output_tokens)),
                     "arrival_ns": t, "first_scheduled_ns": t + 10, "first_token_ns": t + 20, "finish_ns": t + 30,
                     "status": "finished", "num_cached_tokens": 0, "num_preemptions": 0, "family_id": f"f{i % 3}"})
    w.write("invocations", rows)
    w.close()
    return rows


def _headroom(cli, trace) -> dict:
    r = cli(["headroom", trace, "--capacity-blocks", "6,8,16,64", "--allow-incomplete", "--json"])
    assert r.exit_code == 0, r.stdout
    # The model's rows; a capture also has its measured `stock` row, which an import has not.
    return {(x["policy"], x["capacity_blocks"]): (x["hit_tokens"], x["prefill_tokens"])
            for x in json.loads(r.stdout)["results"] if x["policy"] != "stock"}


def test_capture_export_import_gives_the_same_headroom_at_the_block_size(tmp_path, cli):
    rows = _capture(tmp_path / "cap", output_tokens=1)
    r = cli(["export", "mooncake", tmp_path / "cap", "--out", tmp_path / "x.jsonl", "--block-tokens", "4", "--json"])
    assert r.exit_code == 0, r.stdout
    assert json.loads(r.stdout)["hash_source"] == "tokens"
    lines = [json.loads(x) for x in open(tmp_path / "x.jsonl")]
    assert [x["input_length"] for x in lines] == [row["num_prompt_tokens"] for row in rows]
    assert [x["timestamp"] for x in lines] == list(range(40))  # ms after the first arrival
    assert cli(["import", "mooncake", tmp_path / "x.jsonl", "--block-size", "4", "--out", tmp_path / "back"]).exit_code == 0
    before, after = _headroom(cli, tmp_path / "cap"), _headroom(cli, tmp_path / "back")
    assert before == after
    assert before[("vllm", 8)] != before[("vllm", 64)]  # the capacities do differ: the test can fail


def test_an_export_at_another_block_size_reads_back_as_it_is(tmp_path, cli):
    """`headroom FILE` on an export at `--block-tokens 4` reads it at 4 tokens per hash id (inferred from the
    lines' counts), as its import at `--block-size 4` does: no line is malformed."""
    _capture(tmp_path / "cap", output_tokens=1)
    assert cli(["export", "mooncake", tmp_path / "cap", "--out", tmp_path / "x.jsonl", "--block-tokens", "4"]
               ).exit_code == 0
    assert cli(["import", "mooncake", tmp_path / "x.jsonl", "--block-size", "4", "--out", tmp_path / "back"]).exit_code == 0
    r = cli(["headroom", tmp_path / "x.jsonl", "--capacity-blocks", "8,64", "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "malformed" not in r.stderr
    assert _headroom(cli, tmp_path / "x.jsonl") == _headroom(cli, tmp_path / "back")


def test_output_blocks_are_what_the_format_cannot_carry(tmp_path, cli):
    """With 3-token outputs a request completes an output block that the capture's model holds in the pool and
    the Mooncake lines do not list: prompt-only policies still agree, LRU at a small capacity does not."""
    _capture(tmp_path / "cap", output_tokens=3)
    cli(["export", "mooncake", tmp_path / "cap", "--out", tmp_path / "x.jsonl", "--block-tokens", "4"])
    cli(["import", "mooncake", tmp_path / "x.jsonl", "--block-size", "4", "--out", tmp_path / "back"])
    before, after = _headroom(cli, tmp_path / "cap"), _headroom(cli, tmp_path / "back")
    assert before[("infinite", 64)] == after[("infinite", 64)]
    assert before[("lru", 8)] != after[("lru", 8)]


def test_optional_fields_sessions_token_ids_ignore_eos(tmp_path, cli):
    rows = _capture(tmp_path / "cap", output_tokens=1, n=3)
    r = cli(["export", "mooncake", tmp_path / "cap", "--out", tmp_path / "x.jsonl", "--block-tokens", "4",
             "--sessions", "--token-ids", "--ignore-eos"])
    assert r.exit_code == 0, r.stdout
    lines = [json.loads(x) for x in open(tmp_path / "x.jsonl")]
    assert [x["session_id"] for x in lines] == ["f0", "f1", "f2"]
    assert [x["extra"] for x in lines] == [
        {"prompt": row["prompt_token_ids"], "ignore_eos": True} for row in rows]


def test_token_ids_need_a_capture(tmp_path, cli):
    src = tmp_path / "m.jsonl"
    src.write_text(_lines(MOONCAKE))
    cli(["import", "mooncake", src, "--out", tmp_path / "t"])
    r = cli(["export", "mooncake", tmp_path / "t", "--out", tmp_path / "x.jsonl", "--token-ids"])
    assert r.exit_code == 1
    assert "Error: the trace has no prompt token ids (only block hashes); give --vocab-size" in r.stdout + r.stderr
    assert not (tmp_path / "x.jsonl").exists()
    assert [p.name for p in tmp_path.iterdir() if "x.jsonl" in p.name] == []  # no OUT.tmp left behind


def test_token_ids_synthesised_from_hash_ids_share_exactly_the_shared_blocks(tmp_path, cli):
    src = tmp_path / "m.jsonl"
    src.write_text(_lines(MOONCAKE))
    cli(["import", "mooncake", src, "--out", tmp_path / "t"])
    r = cli(["export", "mooncake", tmp_path / "t", "--out", tmp_path / "x.jsonl", "--token-ids", "--vocab-size", "50"])
    assert r.exit_code == 0, r.stdout
    lines = [json.loads(x) for x in open(tmp_path / "x.jsonl")]
    p = [x["extra"]["prompt"] for x in lines]
    assert [len(x) for x in p] == [x["input_length"] for x in lines]
    assert all(2 <= t < 50 for x in p for t in x)
    assert p[0][:1024] == p[2][:1024] and p[0][1024:1100] != p[2][1024:1100]  # ids 0, 1 shared; 2 vs 4
    assert p[1][:512] == p[0][:512] and p[1][512:600] != p[0][512:600]  # id 0 shared; 3 vs 1


def test_import_block_size_is_for_mooncake_and_lmcache_agent_only(tmp_path, cli):
    src = tmp_path / "b.jsonl"
    src.write_text('{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0, "input_length": 16, "output_length": 1, '
                   '"type": "text", "turn": 1, "hash_ids": [1]}\n')
    r = cli(["import", "bailian", src, "--out", tmp_path / "t", "--block-size", "16"])
    assert r.exit_code == 1
    assert "--block-size applies to lmcache-agent, requests and mooncake imports only." in r.stdout + r.stderr
    m = tmp_path / "m.jsonl"
    m.write_text(_lines([{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [7, 8, 9]}]))
    assert cli(["import", "mooncake", m, "--out", tmp_path / "a"]).exit_code == 1  # 3 ids: not 512-token blocks
    r = cli(["import", "mooncake", m, "--out", tmp_path / "b", "--block-size", "16", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["num_invocations"] == 1


@pytest.mark.shared_data
def test_weka_import_export_import_gives_the_same_headroom(tmp_path, cli, shared_datasets):
    src = shared_datasets / "weka-claude-code" / "trace_0001.json"
    assert cli(["import", "weka", src, "--out", tmp_path / "w"]).exit_code == 0
    r = cli(["export", "mooncake", tmp_path / "w", "--out", tmp_path / "w.jsonl", "--block-tokens", "64", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["hash_source"] == "listed"
    assert cli(["import", "mooncake", tmp_path / "w.jsonl", "--block-size", "64", "--out", tmp_path / "back"]).exit_code == 0
    r1 = cli(["headroom", tmp_path / "w", "--capacity-blocks", "256,1024,2048", "--json"])
    r2 = cli(["headroom", tmp_path / "back", "--capacity-blocks", "256,1024,2048", "--json"])
    before, after = json.loads(r1.stdout)["results"], json.loads(r2.stdout)["results"]
    assert [(x["policy"], x["capacity_blocks"], x["hit_tokens"], x["prefill_tokens"]) for x in before] == \
        [(x["policy"], x["capacity_blocks"], x["hit_tokens"], x["prefill_tokens"]) for x in after]
    assert {x["hit_tokens"] for x in before if x["policy"] == "vllm"} == {0, 3023040}
