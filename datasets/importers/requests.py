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

Tokens: with a tokenizer (`tokenizer.json`, or the directory holding it and its chat template in any layout
transformers writes), chat messages are read as vLLM's chat utils read them and rendered with the model's chat
template as vLLM renders them, each render bounded in time and output (chat_template.py), and the rendered
text is tokenized without adding special tokens again (the template wrote them); a completion prompt is
tokenized as it is. A record vLLM would refuse (a message that is not an object, an image part for a model
without an image placeholder, a template that refuses it or runs past a bound), a timestamp past 2^62 ns or
an output length past 2^24 tokens is a malformed record, counted with its `file:line`. Those are the
engine's own prompt ids. Without a tokenizer, text becomes UTF-8 bytes (one token per byte, chat messages as
"role: content" lines): the metadata marks the ids approximate and every report says so. Lineage is not
declared: the analyses infer exact-prefix edges from the ids. Arrival: the records' timestamps, else none
(the analyses replay such a file in order, one request after another).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import pyarrow as pa

from kmesh_trace.datasets.importers.chat_messages import parse_messages, placeholders_of
from kmesh_trace.datasets.importers.chat_template import ChatTemplate
from kmesh_trace.datasets.importers.common import ImportReport, RecordError, iter_records
from kmesh_trace.datasets.importers.request_shapes import is_sharegpt
from kmesh_trace.datasets.importers.sharegpt_file import Unparsed, load_conversations
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
#: The largest output length a record may declare: far beyond any model's context (2^24 tokens).
MAX_OUTPUT_TOKENS = 1 << 24
#: The latest arrival a record may declare, in Unix nanoseconds (2^62: the year 2116).
MAX_ARRIVAL_NS = 1 << 62
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bing": "assistant", "bard": "assistant", "system": "system"}


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
            directory, path = path, path / "tokenizer.json"
            self.tok, self.approximate = FileTokenizer(path), False
            self.template = ChatTemplate.load(directory, placeholders_of(self.tok.added_tokens()))
        else:
            self.tok, self.approximate = FileTokenizer(path), False
        self.name = self.tok.name + (f" chat_template sha256:{self.template.sha}" if self.template else "")

    def chat(self, messages: list, media: dict[str, int] | None = None) -> np.ndarray:
        if self.template is None:
            if not self.approximate:
                raise NoChatTemplate("chat requests need the model's chat template: give the tokenizer's directory "
                                     "(tokenizer.json beside chat_template.jinja or tokenizer_config.json with its "
                                     "chat_template).")
            parsed = parse_messages(messages, "string", {})  # vLLM's reading of the messages, then role: text lines
            return self.tok.encode("".join(f"{m['role']}: {m['content']}\n" for m in parsed.conversation)
                                   + "assistant: ")
        return self.tok.encode(self.template.render(messages, media))

    def text(self, text: str) -> np.ndarray:
        return self.tok.encode(text)


def _text(value: Any, where: str) -> str:
    """A ShareGPT turn's value: a string, or nothing for null."""
    if value is None or isinstance(value, str):
        return value or ""
    raise RecordError(f"{where} has a value that is not a string")


def _speaker(turn: Any) -> str | None:
    """The chat role of a ShareGPT turn, or None for an unknown (or non-string) speaker."""
    speaker = turn.get("from") if isinstance(turn, dict) else None
    return SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None


@dataclass
class RequestsReport(ImportReport):
    tokenizer: str = ""
    block_size: int = 0
    token_ids_approximate: bool = True
    num_without_timestamp: int = 0
    num_without_output_length: int = 0
    num_media_placeholders: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

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
    """A record's timestamp (seconds, or milliseconds when above 1e11) in nanoseconds; None for none or a
    negative one; RecordError for one past MAX_ARRIVAL_NS (year 2116) or not finite."""
    if type(v) not in (int, float) or v < 0:
        return None
    scale = 10**6 if v > 1e11 else 10**9  # milliseconds, else seconds
    if type(v) is float and not math.isfinite(v):
        raise RecordError("field timestamp is not finite")
    ns = v * scale if type(v) is int else round(v * scale)
    if ns > MAX_ARRIVAL_NS:
        raise RecordError(f"field timestamp is out of range (past {MAX_ARRIVAL_NS:,} ns)")
    return ns


def _output_length(obj: dict) -> int | None:
    for k in OUTPUT_KEYS:
        v = obj.get(k)
        if type(v) is int and v >= 0:
            if v > MAX_OUTPUT_TOKENS:
                raise RecordError(f"field {k} is out of range (above {MAX_OUTPUT_TOKENS:,} tokens)")
            return v
    return None


def _jsonl_rows(path: Path, r: Renderer, report: RequestsReport, on_bytes) -> list[_Row]:
    rows = []
    for lineno, obj in iter_records(path, report, on_bytes):
        try:
            rows.append(_jsonl_row(obj, lineno, r, report))
        except NoChatTemplate:
            raise
        except (InputFormatError, RecordError) as e:  # the record's error: counted, the import goes on
            report.malformed(f"{path.name}:{lineno}", str(e))
    return rows


def _jsonl_row(obj: dict, lineno: int, r: Renderer, report: RequestsReport) -> _Row:
    body = obj["body"] if isinstance(obj.get("body"), dict) else obj
    out = _output_length(body)
    arrival = _arrival_ns(obj.get("timestamp", body.get("timestamp")))
    if isinstance(body.get("messages"), list):
        prompt = r.chat(body["messages"], report.num_media_placeholders)
    elif isinstance(body.get("prompt"), str):
        custom = "output_tokens" in body  # vllm bench serve's custom dataset: one user message, templated
        prompt = (r.chat([{"role": "user", "content": body["prompt"]}]) if custom and r.template is not None
                  else r.text(body["prompt"]))
    else:
        raise RecordError("no messages list or prompt string")
    report.num_without_output_length += out is None
    report.num_without_timestamp += arrival is None
    family = next((str(obj[k]) for k in SESSION_KEYS if obj.get(k) is not None), None)
    rid = str(obj.get("custom_id") or obj.get("request_id") or f"line-{lineno}")
    return _Row(rid, family, prompt, None, out or 0, arrival)


def _sharegpt_rows(path: Path, data: list, r: Renderer, report: RequestsReport) -> list[_Row]:
    rows = []
    for k, conv in enumerate(data):
        report.num_lines += 1
        if isinstance(conv, Unparsed):
            report.malformed(f"{path.name}[{k}]", conv.reason)
            continue
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            report.malformed(f"{path.name}[{k}]", "no conversations list")
            continue
        try:
            rows.extend(_conversation_rows(conv, turns, k, path.name, r, report))
        except NoChatTemplate:
            raise
        except (InputFormatError, RecordError) as e:
            report.malformed(f"{path.name}[{k}]", str(e))
    return rows


def _conversation_rows(conv: dict, turns: list, k: int, name: str, r: Renderer, report: RequestsReport) -> list[_Row]:
    """One request per human turn of ShareGPT conversation `k` (module docstring); RecordError on a bad turn."""
    cid = str(conv.get("id", k))
    rows, messages = [], []
    for t, turn in enumerate(turns):
        role = _speaker(turn)
        if role is None:
            raise RecordError(f"conversations[{t}] has an unknown speaker")
        messages.append({"role": role, "content": _text(turn.get("value"), f"conversations[{t}]")})
        if role != "user":
            continue
        reply = turns[t + 1] if t + 1 < len(turns) and _speaker(turns[t + 1]) == "assistant" else None
        output = None if reply is None else r.text(_text(reply.get("value"), f"conversations[{t + 1}]"))
        prompt = r.chat(list(messages), report.num_media_placeholders)
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
            data = load_conversations(src.read_bytes())
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
        report.notes = _media_notes(report.num_media_placeholders)
        writer.update_metadata(num_malformed_lines=report.num_malformed_lines, malformed_lines=report.malformed_lines,
                               num_media_placeholders=report.num_media_placeholders, import_notes=report.notes)
    return report


def _media_notes(media: dict[str, int]) -> list[str]:
    """What a reader of prompt lengths must know about media parts replaced by placeholders."""
    if not media:
        return []
    parts = ", ".join(f"{n:,} {m}" for m, n in sorted(media.items()))
    return [f"{parts} part(s) became the model's placeholder token, once each: the engine expands each into the "
            "item's feature tokens, which a request dataset does not tell, so those prompts are longer in service."]


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
