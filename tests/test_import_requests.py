"""Request datasets (OpenAI-compatible JSONL, vllm bench custom, ShareGPT) with a real tokenizer.json (a small BPE
trained here with the tokenizers package) and a chat template written here: the imported prompt ids are the ids
the template and tokenizer give (checked against the literal rendering and against transformers'
apply_chat_template, which vLLM calls), special tokens are not added twice, and every command reads the file."""

from __future__ import annotations

import json

import pytest

tokenizers = pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIAL = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT = [
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Summarise the cache design."}],
     "max_tokens": 64, "timestamp": 1.5, "session_id": "a"},
    {"messages": [{"role": "system", "content": "You are terse."},
                  {"role": "user", "content": "Summarise the cache design."},
                  {"role": "assistant", "content": "Blocks are hashed and reused."},
                  {"role": "user", "content": "Shorter."}],
     "max_tokens": 32, "timestamp": 2.0, "session_id": "a"},
    {"prompt": "Caches reuse blocks", "max_tokens": 8},
]


@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    """A tokenizer directory: a byte-level BPE trained on a few sentences (its post-processor adds <s>, so adding
    special tokens twice would show), and tokenizer_config.json with the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["You are terse.", "Summarise the cache design.", "Blocks are hashed and reused.", "Shorter.",
              "Caches reuse blocks of tokens.", "A prefix cache keeps the blocks of earlier prompts."] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>", "lstrip": False, "rstrip": False, "normalized": False,
                      "single_word": False}, "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return d


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _invocations(trace):
    from kmesh_trace.trace import open_trace

    with open_trace(trace) as t:
        return t.sql("SELECT * FROM invocations ORDER BY seq").to_dicts(), dict(t.metadata)


def _encode(tokdir, text):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokdir / "tokenizer.json")).encode(text, add_special_tokens=False).ids


def test_chat_and_completion_requests_become_the_templates_token_ids(cli, tmp_path, tokdir):
    src = _write(tmp_path / "chat.jsonl", CHAT)
    r = cli(["import", "requests", src, "--out", tmp_path / "t", "--tokenizer", tokdir, "--json"])
    assert r.exit_code == 0, r.stdout + r.stderr
    rows, meta = _invocations(tmp_path / "t")
    first = "<s><|system|>\nYou are terse.</s>\n<|user|>\nSummarise the cache design.</s>\n<|assistant|>\n"
    second = ("<s><|system|>\nYou are terse.</s>\n<|user|>\nSummarise the cache design.</s>\n<|assistant|>\n"
              "Blocks are hashed and reused.</s>\n<|user|>\nShorter.</s>\n<|assistant|>\n")
    assert [r["prompt_token_ids"] for r in rows] == [_encode(tokdir, first), _encode(tokdir, second),
                                                     _encode(tokdir, "Caches reuse blocks")]
    assert rows[0]["prompt_token_ids"].count(_encode(tokdir, "<s>")[0]) == 1  # the template's <s>, not added again
    assert [r["num_output_tokens"] for r in rows] == [64, 32, 8]
    assert [r["arrival_ns"] for r in rows] == [1_500_000_000, 2_000_000_000, None]
    assert [r["family_id"] for r in rows] == ["a", "a", None]
    assert meta["token_ids_approximate"] is False and meta["block_size"] == 16
    assert meta["tokenizer"].startswith("tokenizers:tokenizer.json sha256:") and "chat_template sha256:" in meta["tokenizer"]


def test_the_rendering_is_transformers_own(tmp_path, tokdir):
    """vLLM renders chat requests through transformers' apply_chat_template: the same ids."""
    transformers = pytest.importorskip("transformers")
    from kmesh_trace.datasets.importers.requests import import_requests

    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(tokdir))
    src = _write(tmp_path / "chat.jsonl", CHAT[:2])
    import_requests(src, tmp_path / "t", tokenizer=tokdir)
    rows, _ = _invocations(tmp_path / "t")
    for row, req in zip(rows, CHAT):
        assert row["prompt_token_ids"] == list(hf.apply_chat_template(req["messages"], add_generation_prompt=True,
                                                                      tokenize=True, return_dict=False))


def test_vllm_bench_custom_lines_are_one_templated_user_message(cli, tmp_path, tokdir):
    src = _write(tmp_path / "custom.jsonl", [{"prompt": "Shorter.", "output_tokens": 10}])
    r = cli(["import", "requests", src, "--out", tmp_path / "t", "--tokenizer", tokdir])
    assert r.exit_code == 0, r.stderr
    (row,), _ = _invocations(tmp_path / "t")
    assert row["prompt_token_ids"] == _encode(tokdir, "<s><|user|>\nShorter.</s>\n<|assistant|>\n")
    assert row["num_output_tokens"] == 10


def test_sharegpt_turns_become_requests_with_their_replies_as_output(cli, tmp_path, tokdir):
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps([{"id": "c1", "conversations": [
        {"from": "human", "value": "Summarise the cache design."}, {"from": "gpt", "value": "Blocks are reused."},
        {"from": "human", "value": "Shorter."}, {"from": "gpt", "value": "Reuse."}]}]))
    r = cli(["import", "requests", src, "--out", tmp_path / "t", "--tokenizer", tokdir])
    assert r.exit_code == 0, r.stderr
    rows, _ = _invocations(tmp_path / "t")
    assert [r["request_id"] for r in rows] == ["c1:0", "c1:2"] and {r["family_id"] for r in rows} == {"c1"}
    assert rows[1]["prompt_token_ids"] == _encode(
        tokdir, "<s><|user|>\nSummarise the cache design.</s>\n<|assistant|>\nBlocks are reused.</s>\n<|user|>\n"
                "Shorter.</s>\n<|assistant|>\n")
    assert rows[0]["output_token_ids"] == _encode(tokdir, "Blocks are reused.")
    assert rows[1]["num_output_tokens"] == len(_encode(tokdir, "Reuse."))


def test_without_a_tokenizer_the_ids_are_bytes_and_marked_approximate(cli, tmp_path):
    src = _write(tmp_path / "chat.jsonl", CHAT)
    r = cli(["import", "requests", src, "--out", tmp_path / "t"])
    assert r.exit_code == 0, r.stderr
    rows, meta = _invocations(tmp_path / "t")
    assert rows[2]["prompt_token_ids"] == list(b"Caches reuse blocks")
    assert rows[0]["prompt_token_ids"] == list(b"system: You are terse.\nuser: Summarise the cache design.\nassistant: ")
    assert meta["token_ids_approximate"] is True and meta["block_size"] == 64


def test_every_command_reads_a_request_file_and_advise_takes_the_tokenizer(cli, tmp_path, tokdir):
    src = _write(tmp_path / "chat.jsonl", CHAT)
    r = cli(["headroom", src, "--capacity-blocks", "4", "--json"])  # bytes: recognised and imported on the way in
    assert r.exit_code == 0, r.stderr
    assert "approximate" in r.stderr
    r = cli(["advise", src, "--tokenizer", tokdir, "--capacity-blocks", "8", "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["block_size"] == 16 and not any("approximate" in n for n in d["notes"])
    want = sum(len(_encode(tokdir, t)) for t in (
        "<s><|system|>\nYou are terse.</s>\n<|user|>\nSummarise the cache design.</s>\n<|assistant|>\n",
        "<s><|system|>\nYou are terse.</s>\n<|user|>\nSummarise the cache design.</s>\n<|assistant|>\n"
        "Blocks are hashed and reused.</s>\n<|user|>\nShorter.</s>\n<|assistant|>\n", "Caches reuse blocks"))
    assert d["num_prompt_tokens"] == want


def test_headroom_tiers_and_report_take_the_tokenizer_too(cli, tmp_path, tokdir):
    """--tokenizer and --block-size (one shared block of flags) in every command that reads a request dataset."""
    src = _write(tmp_path / "chat.jsonl", CHAT)
    want = sum(len(_encode(tokdir, t)) for t in (
        "<s><|system|>\nYou are terse.</s>\n<|user|>\nSummarise the cache design.</s>\n<|assistant|>\n",
        "<s><|system|>\nYou are terse.</s>\n<|user|>\nSummarise the cache design.</s>\n<|assistant|>\n"
        "Blocks are hashed and reused.</s>\n<|user|>\nShorter.</s>\n<|assistant|>\n", "Caches reuse blocks"))
    r = cli(["headroom", src, "--tokenizer", tokdir, "--capacity-blocks", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["block_size"] == 16 and "approximate" not in r.stderr
    r = cli(["tiers", src, "--tokenizer", tokdir, "--block-size", "8", "--capacity-blocks", "4", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["block_size"] == 8 and "approximate" not in r.stderr
    r = cli(["report", src, "--tokenizer", tokdir, "--out", tmp_path / "r.html", "--json"])
    assert r.exit_code == 0, r.stderr
    advise = json.loads(r.stdout)["advise"]
    assert advise["num_prompt_tokens"] == want and advise["block_size"] == 16
    trace = tmp_path / "t"
    assert cli(["import", "requests", src, "--out", trace]).exit_code == 0
    for command in (["headroom", trace], ["tiers", trace, "--capacity-blocks", "4"], ["report", trace, "--out",
                                                                                       tmp_path / "r2.html"]):
        r = cli([*command, "--tokenizer", tokdir])
        assert (r.exit_code, r.stderr) == (1, "Error: --tokenizer and --block-size apply to a request dataset "
                                              "(OpenAI-compatible JSONL, ShareGPT, vllm bench custom).\n"), command


def test_bad_tokenizers_are_one_sentence(cli, tmp_path, tokdir):
    src = _write(tmp_path / "chat.jsonl", CHAT)
    r = cli(["import", "requests", src, "--out", tmp_path / "t", "--tokenizer", tmp_path / "missing.json"])
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines() == [f"Error: tokenizer file {tmp_path / 'missing.json'} does not exist."]
    r = cli(["import", "requests", src, "--out", tmp_path / "t2", "--tokenizer", tokdir / "tokenizer.json"])
    assert r.exit_code == 1 and r.stderr.strip().startswith("Error: chat requests need the model's chat template")
    r = cli(["advise", tmp_path, "--tokenizer", tokdir])
    assert r.exit_code == 1 and r.stderr.startswith("Error: ")
