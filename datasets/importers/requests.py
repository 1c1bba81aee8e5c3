"""Importer for request datasets, before deployment: the prompts a service will be sent, as token ids.

Three shapes, recognised per record:
- OpenAI-compatible JSONL: a chat request (`messages`, a list of {role, content}) or a completion request
  (`prompt`, a string), at the top level or under `body` (the Batch API's lines); optional `timestamp`
  (seconds, or milliseconds when larger than 1e11), a session or conversation id (`session_id`,
  `conversation_id`) as the family, and `max_tokens` / `max_completion_tokens` as the output length;
- `vllm bench serve`'s custom dataset: JSONL lines {"prompt": ..., "output_tokens": N}; as `vllm bench`
  sends them, the prompt is one user message rendered with the chat template;
- ShareGPT: one JSON file, a list of {"id", "conversations": [{"from": human|gpt|system, "value"}]}: one
  request per human turn, its messages every turn before it (earlier replies as assistant messages), its
  output the gpt reply that follows, its family the conversation.

Tokens: with a tokenizer (`tokenizer.json`, or the directory holding it and `tokenizer_config.json`), chat
messages are rendered with the model's chat template as vLLM renders them (Hugging Face's Jinja2 rules:
a sandboxed environment with trim_blocks and lstrip_blocks, `raise_exception`, `tojson`, the special tokens
of tokenizer_config.json, the generation prompt added) and the rendered text is tokenized without adding
special tokens again (the template wrote them); a completion prompt is tokenized as it is. Those are the
engine's own prompt ids. Without a tokenizer, text becomes UTF-8 bytes (one token per byte, chat messages as
"role: content" lines): the metadata marks the ids approximate and every report says so. Lineage is not
declared: the analyses infer exact-prefix edges from the ids. Arrival: the records' timestamps, else none
(the analyses replay such a file in order, one request after another).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import pyarrow as pa

from kmesh_trace.datasets.importers.common import ImportReport, iter_records
from kmesh_trace.datasets.importers.request_shapes import is_sharegpt
from kmesh_trace.datasets.importers.lmcache_agent import (BYTES_BLOCK_SIZE, TOKENIZER_BLOCK_SIZE, ByteTokenizer,
                                                          FileTokenizer)
from kmesh_trace.errors import InputFormatError
from kmesh_trace.writer import TraceWriter, to_contract

FORMAT = "requests"
#: Keys that give a record's session (its family), in order.
SESSION_KEYS = ("session_id", "conversation_id")
#: Keys that give a record's output length, in order.
OUTPUT_KEYS = ("output_tokens", "max_completion_tokens", "max_tokens")
#: ShareGPT speakers -> chat roles.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "system": "system"}


class ChatTemplate:
    """A tokenizer directory's chat template, rendered as Hugging Face transformers (and so vLLM) renders it."""

    def __init__(self, config_path: Path):
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as e:
            raise InputFormatError(f"{config_path} is not a readable tokenizer_config.json ({e}).") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise InputFormatError(f"{config_path} has no chat_template; chat requests need one to be rendered.")

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(template)
        except jinja2.exceptions.TemplateError as e:
            raise InputFormatError(f"the chat template of {config_path} does not compile ({e}).") from None
        self._special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in config.items()
                         if k.endswith("_token") and isinstance(v, (str, dict))}
        self.sha = hashlib.sha256(template.encode()).hexdigest()[:16]

    def render(self, messages: list[dict]) -> str:
        import jinja2

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._special)
        except jinja2.exceptions.TemplateError as e:
            raise InputFormatError(f"the chat template refused a request: {e}.") from None


class NoChatTemplate(InputFormatError):
    """Chat requests with a tokenizer that has no chat template: every request would fail, so the import does."""


class Renderer:
    """Messages or a prompt -> token ids, as module docstring says."""

    def __init__(self, tokenizer: str | Path | None):
        self.template = None
        if tokenizer is None:
            self.tok, self.approximate = ByteTokenizer(), True
            self.name = self.tok.name
            return
        path = Path(tokenizer)
        if path.is_dir():
            if not (path / "tokenizer.json").is_file():
                raise InputFormatError(f"{path} holds no tokenizer.json.")
            config = path / "tokenizer_config.json"
            self.template = ChatTemplate(config) if config.is_file() else None
            path = path / "tokenizer.json"
        self.tok, self.approximate = FileTokenizer(path), False
        self.name = self.tok.name + (f" chat_template sha256:{self.template.sha}" if self.template else "")

    def chat(self, messages: list[dict]) -> np.ndarray:
        if self.template is None:
            if not self.approximate:
                raise NoChatTemplate("chat requests need the model's chat template: give the tokenizer's directory "
                                       "(tokenizer.json beside tokenizer_config.json with its chat_template).")
            return self.tok.encode("".join(f"{m.get('role')}: {_text(m.get('content'))}\n" for m in messages)
                                   + "assistant: ")
        return self.tok.encode(self.template.render(messages))

    def text(self, text: str) -> np.ndarray:
        return self.tok.encode(text)


def _text(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a content list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


@dataclass
class RequestsReport(ImportReport):
    tokenizer: str = ""
    block_size: int = 0
    token_ids_approximate: bool = True
    num_without_timestamp: int = 0
    num_without_output_length: int = 0

    SUMMARY_KEYS: ClassVar[tuple[str, ...]] = ("num_lines", "num_blank_lines", "num_invocations",
                                               "num_without_timestamp", "num_without_output_length",
                                               "num_malformed_lines")


@dataclass
class _Row:
    request_id: str
    family_id: str | None
    prompt: np.ndarray
    output: np.ndarray | None
    num_output_tokens: int
    arrival_ns: int | None


def _arrival_ns(v: Any) -> int | None:
    if type(v) not in (int, float) or v < 0:
        return None
    return int(v * 1e6) if v > 1e11 else int(v * 1e9)  # milliseconds, else seconds


def _output_length(obj: dict) -> int | None:
    for k in OUTPUT_KEYS:
        v = obj.get(k)
        if type(v) is int and v >= 0:
            return v
    return None


def _jsonl_rows(path: Path, r: Renderer, report: RequestsReport, on_bytes) -> list[_Row]:
    rows = []
    for lineno, obj in iter_records(path, report, on_bytes):
        body = obj["body"] if isinstance(obj.get("body"), dict) else obj
        try:
            if isinstance(body.get("messages"), list):
                prompt = r.chat([m for m in body["messages"] if isinstance(m, dict)])
            elif isinstance(body.get("prompt"), str):
                custom = "output_tokens" in body  # vllm bench serve's custom dataset: one user message, templated
                prompt = (r.chat([{"role": "user", "content": body["prompt"]}]) if custom and r.template is not None
                          else r.text(body["prompt"]))
            else:
                report.malformed(f"{path.name}:{lineno}", "no messages list or prompt string")
                continue
        except NoChatTemplate:
            raise
        except InputFormatError as e:
            report.malformed(f"{path.name}:{lineno}", str(e))
            continue
        out = _output_length(body)
        report.num_without_output_length += out is None
        arrival = _arrival_ns(obj.get("timestamp", body.get("timestamp")))
        report.num_without_timestamp += arrival is None
        family = next((str(obj[k]) for k in SESSION_KEYS if obj.get(k) is not None), None)
        rid = str(obj.get("custom_id") or obj.get("request_id") or f"line-{lineno}")
        rows.append(_Row(rid, family, prompt, None, out or 0, arrival))
    return rows


def _sharegpt_rows(path: Path, data: list, r: Renderer, report: RequestsReport) -> list[_Row]:
    rows = []
    for k, conv in enumerate(data):
        report.num_lines += 1
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            report.malformed(f"{path.name}[{k}]", "no conversations list")
            continue
        cid = str(conv.get("id", k))
        messages: list[dict] = []
        for t, turn in enumerate(turns):
            role = SHAREGPT_ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
            if role is None:
                report.malformed(f"{path.name}[{k}].conversations[{t}]", "unknown speaker")
                break
            messages.append({"role": role, "content": _text(turn.get("value"))})
            if role != "user":
                continue
            reply = turns[t + 1] if t + 1 < len(turns) and isinstance(turns[t + 1], dict) else None
            output = r.text(_text(reply.get("value"))) if reply and SHAREGPT_ROLES.get(reply.get("from")) == "assistant" \
                else None
            try:
                prompt = r.chat(list(messages))
            except NoChatTemplate:
                raise
            except InputFormatError as e:
                report.malformed(f"{path.name}[{k}]", str(e))
                break
            report.num_without_timestamp += 1
            rows.append(_Row(f"{cid}:{t}", cid, prompt, output, 0 if output is None else len(output), None))
    return rows


def import_requests(src: str | Path, out: str | Path, *, engine_id: str = "import-requests",
                    tokenizer: str | Path | None = None, block_size: int | None = None,
                    on_bytes: Callable[[int], None] | None = None) -> RequestsReport:
    """Import a request dataset (module docstring) into the trace directory `out`."""
    src = Path(src)
    if not src.is_file():
        raise InputFormatError(f"{src} is not a readable file.")
    r = Renderer(tokenizer)
    block_size = block_size or (BYTES_BLOCK_SIZE if r.approximate else TOKENIZER_BLOCK_SIZE)
    report = RequestsReport(FORMAT, str(src), str(out), engine_id, tokenizer=r.name, block_size=block_size,
                            token_ids_approximate=r.approximate)
    data = None
    if src.suffix.lower() == ".json":
        try:
            data = json.loads(src.read_bytes())
        except ValueError as e:
            raise InputFormatError(f"{src} is not JSON ({e}).") from None
        if on_bytes is not None:
            on_bytes(src.stat().st_size)
        if not is_sharegpt(data):
            raise InputFormatError(f"{src} is not a ShareGPT list of conversations.")
    rows = _sharegpt_rows(src, data, r, report) if data is not None else _jsonl_rows(src, r, report, on_bytes)
    meta = {"block_size": block_size, "engine": "request dataset", "tokenizer": r.name,
            "token_ids_approximate": r.approximate,
            "capture_config": {"format": FORMAT, "source": str(src), "tokenizer": r.name, "block_size": block_size}}
    with TraceWriter(out, engine_id, meta, source=f"import:{FORMAT}") as writer:
        if rows:
            writer.write("invocations", _table(rows))
        report.num_invocations = len(rows)
        writer.update_metadata(num_malformed_lines=report.num_malformed_lines, malformed_lines=report.malformed_lines)
    return report


def _table(rows: list[_Row]) -> pa.Table:
    def ids(arrays: list[np.ndarray | None]) -> pa.ListArray:
        offsets = np.zeros(len(arrays) + 1, np.int64)
        np.cumsum([0 if a is None else len(a) for a in arrays], out=offsets[1:])
        values = np.concatenate([a for a in arrays if a is not None] or [np.zeros(0, np.int32)]).astype(np.int32)
        mask = pa.array([a is None for a in arrays])
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values), mask=mask)

    seen: dict[str, int] = {}
    request_ids = []
    for row in rows:  # ids unique within the partition: a repeated custom_id gets a suffix
        n = seen.get(row.request_id, 0)
        seen[row.request_id] = n + 1
        request_ids.append(row.request_id if n == 0 else f"{row.request_id}#{n}")
    return to_contract("invocations", {
        "request_id": request_ids,
        "seq": pa.array(range(len(rows)), pa.int64()),
        "family_id": [row.family_id for row in rows],
        "num_prompt_tokens": [len(row.prompt) for row in rows],
        "num_output_tokens": [row.num_output_tokens for row in rows],
        "prompt_token_ids": ids([row.prompt for row in rows]),
        "output_token_ids": ids([row.output for row in rows]),
        "arrival_ns": pa.array([row.arrival_ns for row in rows], pa.int64()),
    })
