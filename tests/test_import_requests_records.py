"""Request datasets read as vLLM reads them, and every bad record counted as that record's error: content lists
(text parts joined by a newline, null content as nothing, image parts refused or turned into the model's
placeholder), the tokenizer layouts transformers writes, chat templates bounded in time and output, and
records whose fields are out of range. The import never fails for one record and never says "This is a bug"."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("tokenizers", reason="the tokenizers package is not installed")
pytest.importorskip("transformers", reason="the transformers package is not installed")

from chat_tokenizers import CHATML, PARTS, encode, save_tokenizer  # noqa: E402

USER = {"role": "user", "content": "Shorter."}


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("chatml"))


def _chatml(*turns: tuple[str, str]) -> str:
    return "".join(f"<|im_start|>{r}\n{c}<|im_end|>\n" for r, c in turns) + "<|im_start|>assistant\n"


def _import(tmp_path, rows, tokenizer, name="r.jsonl"):
    from kmesh_trace.datasets.importers.requests import import_requests
    from kmesh_trace.trace import open_trace

    src = tmp_path / name
    src.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    out = tmp_path / f"t{time.monotonic_ns()}"
    report = import_requests(src, out, tokenizer=tokenizer)
    if not report.num_invocations:
        return report, []
    with open_trace(out) as t:
        return report, t.sql("SELECT * FROM invocations ORDER BY seq").to_dicts()


def test_save_pretrained_layout_and_text_parts_joined_by_newlines(tmp_path, chatml):
    assert (chatml / "chat_template.jinja").is_file() and "chat_template" not in json.loads(
        (chatml / "tokenizer_config.json").read_text())
    parts = {"role": "user", "content": [{"type": "text", "text": "Summarise"}, "the", {"type": "text", "text": None},
                                         {"type": "text", "text": "cache."}]}
    tool_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    report, rows = _import(tmp_path, [{"messages": [parts]}, {"messages": [USER, tool_call, USER]}], chatml)
    assert report.num_malformed_lines == 0
    assert rows[0]["prompt_token_ids"] == encode(chatml, _chatml(("user", "Summarise\nthe\ncache.")))
    assert rows[1]["prompt_token_ids"] == encode(chatml, _chatml(("user", "Shorter."), ("assistant", ""),
                                                                 ("user", "Shorter.")))


def test_other_layouts_transformers_writes(tmp_path, chatml):
    import shutil

    d = tmp_path / "processor"
    shutil.copytree(chatml, d)
    (d / "chat_template.jinja").unlink()
    (d / "chat_template.json").write_text(json.dumps({"chat_template": CHATML.replace("<|im_end|>", "<|im_end|>!")}))
    _, rows = _import(tmp_path, [{"messages": [USER]}], d)
    assert rows[0]["prompt_token_ids"] == encode(chatml, "<|im_start|>user\nShorter.<|im_end|>!\n<|im_start|>assistant\n")


def test_image_parts_are_refused_per_record_without_a_placeholder(tmp_path, chatml):
    image = {"role": "user", "content": [{"type": "text", "text": "Shorter."},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    report, rows = _import(tmp_path, [{"messages": [image]}, {"messages": [USER]}, {"messages": [USER, 7]}], chatml)
    assert len(rows) == 1 and report.num_malformed_lines == 2
    assert report.malformed_lines[0].startswith("r.jsonl:1: message 0 has an image part")
    assert report.malformed_lines[1] == "r.jsonl:3: message 1 is not an object"


def test_image_parts_become_the_tokenizers_placeholder_with_a_note(tmp_path):
    d = save_tokenizer(tmp_path / "vl", extra_tokens=("<image>",))
    image = {"role": "user", "content": [{"type": "text", "text": "Shorter."},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    report, rows = _import(tmp_path, [{"messages": [image]}], d)
    assert rows[0]["prompt_token_ids"] == encode(d, _chatml(("user", "<image>\nShorter.")))
    assert report.num_media_placeholders == {"image": 1} and "placeholder" in report.notes[0]
    d2 = save_tokenizer(tmp_path / "vl-parts", template=PARTS, extra_tokens=("<image>",))  # the openai format
    _, rows = _import(tmp_path, [{"messages": [image]}], d2)
    assert rows[0]["prompt_token_ids"] == encode(d2, _chatml(("user", "Shorter.<image>")))


@pytest.mark.parametrize("template, reason", [
    ("{% include 'other.j2' %}", "no loader"),
    ("{% import 'other.j2' as o %}{{ o.x }}", "no loader"),
    ("{% extends 'base.j2' %}", "no loader"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    ("{{ 'x' * 10**10 }}", "stopped"),
    ("{{ messages[0]['content']|center(10**10) }}", "stopped"),
    ("{% if messages[0]['content'] == 'Shorter.' %}{{ raise_exception('no short prompts') }}{% endif %}x",
     "no short prompts"),
])
def test_template_failures_are_the_records_error(tmp_path, template, reason):
    d = save_tokenizer(tmp_path / "tok", template=template)
    report, rows = _import(tmp_path, [{"messages": [USER]}, {"messages": [{"role": "user", "content": "Long."}]}], d)
    assert report.num_malformed_lines >= 1 and reason in report.malformed_lines[0], report.malformed_lines
    assert report.malformed_lines[0].startswith("r.jsonl:1: the chat template")


def test_a_render_is_bounded_in_time(tmp_path, monkeypatch):
    from kmesh_trace.datasets.importers import template_bounds

    monkeypatch.setattr(template_bounds, "RENDER_SECONDS", 0.5)
    loops = ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}x{% endfor %}"
             "{% endfor %}{% endfor %}")
    silent = "{% set xs = range(100000)|list %}{% for i in xs %}{% for j in xs %}{% endfor %}{% endfor %}"
    for template in (loops, silent):
        d = save_tokenizer(tmp_path / str(len(template)), template=template)
        t0 = time.monotonic()
        report, _ = _import(tmp_path, [{"messages": [USER]}, {"prompt": "Shorter."}], d)
        assert time.monotonic() - t0 < 20
        assert report.num_invocations == 1 and report.malformed_lines[0].startswith(
            "r.jsonl:1: the chat template was stopped: the template ran past its 0.5 s bound")


def test_a_render_is_bounded_in_output(tmp_path):
    template = "{% for i in range(100000) %}{% for j in range(1000) %}xxxxxxxxxxxxxxxxxxxx{% endfor %}{% endfor %}"
    d = save_tokenizer(tmp_path / "tok", template=template)
    report, _ = _import(tmp_path, [{"messages": [USER]}], d)
    assert "passed 33,554,432 characters" in report.malformed_lines[0]


def test_a_template_nested_past_the_compiler_is_one_sentence(cli, tmp_path):
    d = save_tokenizer(tmp_path / "tok", template="{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    src = tmp_path / "r.jsonl"
    src.write_text(json.dumps({"messages": [USER]}) + "\n")
    r = cli(["import", "requests", src, "--out", tmp_path / "t", "--tokenizer", d])
    assert r.exit_code == 1 and "This is a bug" not in r.stderr
    assert r.stderr.strip().startswith("Error: the chat template in ") and "does not compile" in r.stderr


@pytest.mark.parametrize("field, value, reason", [
    ("timestamp", 1e10, "timestamp is out of range"),
    ("timestamp", 2**70, "timestamp is out of range"),
    ("timestamp", 2**62 // 10**9 + 1, "timestamp is out of range"),
    ("max_tokens", 2**63, "max_tokens is out of range"),
    ("max_tokens", 10**12, "max_tokens is out of range"),
    ("max_tokens", 2**24 + 1, "max_tokens is out of range"),
])
def test_out_of_range_fields_are_malformed_records(tmp_path, field, value, reason):
    report, rows = _import(tmp_path, [{"prompt": "a", field: value}, {"prompt": "b", "timestamp": 1e9, "max_tokens": 2**24}],
                           None)
    assert len(rows) == 1 and rows[0]["num_output_tokens"] == 2**24 and rows[0]["arrival_ns"] == 10**18
    assert report.num_malformed_lines == 1 and reason in report.malformed_lines[0]


def test_bad_records_are_counted_and_the_import_goes_on(cli, tmp_path, chatml):
    rows = [{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            {"messages": ["not an object"]},
            {"messages": [{"role": "user", "content": {"a": 1}}]},
            "[" * 100_000 + "]" * 100_000,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "[" * 100_000}]}]},
            {"messages": [USER]}]
    src = tmp_path / "r.jsonl"
    src.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    r = cli(["import", "requests", src, "--out", tmp_path / "t", "--tokenizer", chatml, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["num_invocations"] == 2 and d["num_malformed_lines"] == 4
    assert [m.split(": ", 1)[0] for m in d["malformed_lines"]] == ["r.jsonl:1", "r.jsonl:2", "r.jsonl:3", "r.jsonl:4"]


def test_sharegpt_bad_turns_and_deep_conversations_are_counted(cli, tmp_path, chatml):
    good = {"id": "ok", "conversations": [{"from": "human", "value": "Shorter."}, {"from": "gpt", "value": "Yes."}]}
    listed = {"id": "list", "conversations": [{"from": ["human"], "value": "Shorter."}]}
    textual = {"id": "value", "conversations": [{"from": "human", "value": {"text": "Shorter."}}]}
    deep = '{"id": "deep", "conversations": ' + "[" * 100_000 + "]" * 100_000 + "}"
    src = tmp_path / "s.json"
    src.write_text("[" + ", ".join([json.dumps(good), json.dumps(listed), json.dumps(textual), deep]) + "]")
    r = cli(["import", "requests", src, "--out", tmp_path / "t", "--tokenizer", chatml, "--json"])
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["num_invocations"] == 1 and d["num_malformed_lines"] == 3, d["malformed_lines"]
    assert d["malformed_lines"] == ["s.json[1]: conversations[0] has an unknown speaker",
                                    "s.json[2]: conversations[0] has a value that is not a string",
                                    "s.json[3]: nested deeper than a JSON reader allows"]
    r = cli(["headroom", src, "--capacity-blocks", "4", "--json"])  # the sniffer reads it too
    assert r.exit_code == 0 and "This is a bug" not in r.stderr, r.stderr
