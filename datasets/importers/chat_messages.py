"""Chat messages as vLLM reads them before its chat template: a port of vLLM's chat utils
(`vllm/renderers/chat_utils`, 0.32 and 0.33), tested equal to `parse_chat_messages` on random
conversations (tests/test_chat_messages_vllm.py).

vLLM's rules, for a text-only model:
- the template's *content format* is detected from its syntax tree: "openai" when the template loops over a
  message's content (it takes a list of parts), "string" otherwise;
- a message's content: null becomes no parts, a string one text part; text parts (`text`, `input_text`,
  `output_text`, `refusal`, `thinking`, a bare string) are joined with "\\n" in the string format and kept as
  `{"type": "text", "text": ...}` parts in the openai format; a part whose text is null is skipped;
- a system message loses Claude Code's attribution header line; an assistant message keeps its tool calls
  (arguments parsed to an object, `{}` when they are not one) and its reasoning; a tool message keeps
  `tool_call_id`, and its text parts are joined; `name` and `task` are kept when they are strings;
- a `developer` message becomes `system` when the template never names the developer role, and the system
  messages are then merged into one at the front.

Image, audio and video parts: vLLM refuses them on a text-only model. Where the tokenizer defines the
modality's placeholder token (`<image>`, Qwen's `<|image_pad|>`, ...), a part becomes that placeholder once
(at the front of the text, as vLLM places them, or as a `{"type": MODALITY}` part in the openai format) and
the import notes that the engine expands each into the item's feature tokens, which a request dataset cannot
know; otherwise the record is refused. Every other departure from vLLM's request schema (a message that is
not an object, a role that is not a string, a part of an unknown type, a text that is not a string) is the
record's error: `MessageError`, counted as the record's malformed reason by the importer.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kmesh_trace.errors import InputFormatError

#: Part types read as text, and the key holding each one's text.
TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}
#: Part types that carry media, and their modality.
MEDIA_PART_TYPES = {"image_url": "image", "input_image": "image", "image_pil": "image", "image_embeds": "image",
                    "audio_url": "audio", "input_audio": "audio", "audio_embeds": "audio",
                    "video_url": "video", "video_embeds": "video"}
#: Placeholder strings of well-known models, by modality: (token the tokenizer must define, text put in the
#: prompt), first match wins.
PLACEHOLDERS = {
    "image": (("<|image_pad|>", "<|vision_start|><|image_pad|><|vision_end|>"), ("<start_of_image>", "<start_of_image>"),
              ("<image>", "<image>"), ("<|image|>", "<|image|>"), ("[IMG]", "[IMG]")),
    "audio": (("<|AUDIO|>", "<|audio_bos|><|AUDIO|><|audio_eos|>"), ("<start_of_audio>", "<start_of_audio>"),
              ("<audio>", "<audio>"), ("<|audio|>", "<|audio|>")),
    "video": (("<|video_pad|>", "<|vision_start|><|video_pad|><|vision_end|>"), ("<video>", "<video>")),
}
#: Known keys of a content part (vLLM's content-part types): others travel with an openai-format part.
KNOWN_PART_FIELDS = frozenset({"type", "text", "refusal", "thinking", "closed", "image_url", "input_image", "image_pil",
                               "image_embeds", "audio_url", "input_audio", "audio_embeds", "video_url", "video_embeds",
                               "prompt_embeds", "data", "uuid", "name", "detail", "file_id", "file", "format",
                               "tool_reference"})
CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"


class MessageError(InputFormatError):
    """A record's messages that vLLM would refuse: the record is malformed, the import goes on."""


def placeholders_of(vocabulary: set[str]) -> dict[str, str]:
    """The placeholder text of each modality whose token is in the tokenizer's `vocabulary` (added tokens)."""
    found = {}
    for modality, options in PLACEHOLDERS.items():
        for token, text in options:
            if token in vocabulary:
                found[modality] = text
                break
    return found


@dataclass
class ChatParse:
    """One record's messages as the template receives them, and the media parts met on the way."""

    conversation: list[dict]
    num_media_parts: dict[str, int] = field(default_factory=dict)


@dataclass
class _Parts:
    """The parsed parts of one message."""

    items: list = field(default_factory=list)
    media: list[str] = field(default_factory=list)


def parse_messages(messages: list, content_format: str, placeholders: dict[str, str]) -> ChatParse:
    """vLLM's `parse_chat_messages` for a text-only model (module docstring); MessageError on what it refuses."""
    result = ChatParse([])
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise MessageError(f"message {i} is not an object")
        if not isinstance(message.get("role"), str):
            raise MessageError(f"message {i} has no role string")
        result.conversation.append(_message(message, i, content_format, placeholders, result.num_media_parts))
    _postprocess(result.conversation)
    return result


def _message(message: dict, i: int, content_format: str, placeholders: dict[str, str], media: dict) -> dict:
    role, content = message["role"], message.get("content")
    if content is None:
        content = []
    elif isinstance(content, str):
        content = [{"type": "text", "text": content}]
    elif not isinstance(content, list):
        raise MessageError(f"message {i} has content that is neither a string, a list nor null")
    if role == "system":
        content = _strip_billing_header(content)
    parts = _Parts()
    for part in content:
        _part(part, i, content_format == "openai", parts)
    for modality in parts.media:
        if modality not in placeholders:
            raise MessageError(f"message {i} has an {modality} part and the tokenizer defines no {modality} "
                               "placeholder (a text-only model refuses it)")
        media[modality] = media.get(modality, 0) + 1
    out = {"role": role, "content": _joined(parts, content_format, placeholders)}
    _carry_fields(message, role, out)
    return out


def _joined(parts: _Parts, content_format: str, placeholders: dict[str, str]) -> Any:
    if content_format == "openai":
        return parts.items
    text = "\n".join(parts.items)
    missing: list[str] = []
    for p, n in Counter(placeholders[m] for m in parts.media).items():
        n -= text.count(p)  # a placeholder the user wrote already stands for its item
        if n < 0:
            raise MessageError(f"a message holds more {p} placeholders than items")
        missing.extend([p] * n)
    return "\n".join(missing + [text]) if text else "\n".join(missing)  # vLLM puts them before the text


def _part(part: Any, i: int, wrap: bool, parts: _Parts) -> None:
    if isinstance(part, str):
        _add(parts, {"type": "text", "text": part} if wrap else part)
        return
    if not isinstance(part, dict):
        raise MessageError(f"message {i} has a content part that is not an object")
    kind = _part_type(part, i)
    if kind in TEXT_PART_KEYS:
        text = part.get(TEXT_PART_KEYS[kind])
        if text is None:
            return  # vLLM skips a text part without text
        if not isinstance(text, str):
            raise MessageError(f"message {i} has a {kind} part whose text is not a string")
        _add(parts, ({"type": "text", "text": text} | _extra(part)) if wrap else text)
    elif kind == "tool_reference":
        name = part.get("name")
        _add(parts, {"type": "tool_reference", "name": name} if wrap else name)
    elif kind in MEDIA_PART_TYPES:
        parts.media.append(MEDIA_PART_TYPES[kind])
        if wrap:
            parts.items.append({"type": MEDIA_PART_TYPES[kind]} | _extra(part))
    else:
        raise MessageError(f"message {i} has a content part of unsupported type {str(kind)[:40]!r}")


def _add(parts: _Parts, item: Any) -> None:
    if item:  # vLLM keeps only truthy parts: an empty text is dropped in the string format
        parts.items.append(item)


def _part_type(part: dict, i: int) -> str:
    kind = part.get("type")
    if isinstance(kind, str) and part.get("uuid") is None:
        return kind
    if kind is None or part.get("uuid") is not None:
        for key in (*MEDIA_PART_TYPES, "tool_reference"):
            if key in part:
                return key
        raise MessageError(f"message {i} has a content part without a type")
    raise MessageError(f"message {i} has a content part whose type is not a string")


def _extra(part: dict) -> dict:
    return {k: v for k, v in part.items() if k not in KNOWN_PART_FIELDS}


def _strip_billing_header(parts: list) -> list:
    """vLLM drops Claude Code's per-request attribution line from system text (it would defeat the cache)."""
    out = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, dict) and part.get(
            "type") == "text" else None
        if not (isinstance(text, str) and text.startswith(CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _carry_fields(message: dict, role: str, out: dict) -> None:
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise MessageError("an assistant message has tool_calls that are not a list")
            out["tool_calls"] = list(calls)
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        content = out["content"]
        if isinstance(content, list) and not any(isinstance(p, dict) and p.get("type") != "text" for p in content):
            texts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
            out["content"] = "\n".join(texts) if texts else ""
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    if role == "developer":
        out["tools"] = message.get("tools")


def _postprocess(conversation: list[dict]) -> None:
    """Tool-call arguments as objects (vLLM's `_postprocess_messages`)."""
    for message in conversation:
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if not isinstance(calls, list):
            continue
        if not calls:
            message.pop("tool_calls")
            continue
        for call in calls:
            if not isinstance(call, dict):
                raise MessageError("an assistant tool call is not an object")
            function = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(function, dict):
                raise MessageError("an assistant tool call is not of type function")
            function["arguments"] = _arguments(function.get("arguments"))


def _arguments(value: Any) -> dict:
    if not value:
        return {}
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return {}
    return value if isinstance(value, dict) else {}


def developer_as_system(conversation: list[dict], template: str) -> list[dict]:
    """vLLM's safe_apply_chat_template: a template that never names the developer role gets those messages as
    system messages, merged with the others into one at the front."""
    if not any(m["role"] == "developer" for m in conversation):
        return conversation
    if '"developer"' in template or "'developer'" in template:
        return conversation
    converted = [{k: v for k, v in m.items() if k != "tools"} | {"role": "system"} if m["role"] == "developer" else m
                 for m in conversation]
    system: list[str] = []
    rest, merge = [], False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            rest.append(m)
            continue
        merge = merge or i > 0 or bool(system)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content
                                if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            system.append(content)
    return [{"role": "system", "content": "\n\n".join(system)}, *rest] if merge else converted
