"""A tokenizer directory's chat template, found where transformers writes it and rendered as vLLM renders it.

Where the template is: `chat_template.jinja` (what transformers' `save_pretrained` writes), else
`chat_template.json` (a processor's `{"chat_template": ...}`), else `tokenizer_config.json`'s `chat_template`
(a string, or a list of named templates whose `default` one is taken). The special tokens the template sees
are `tokenizer_config.json`'s `*_token` entries (and `special_tokens_map.json`'s where the config lacks one).

How it renders: the record's messages are read as vLLM's chat utils read them (`chat_messages.py`, in the
content format detected from the template, `content_format.py`), developer messages become system ones where
the template never names that role, and the template renders in transformers' sandbox with the generation
prompt added, bounded in time and output (`template_bounds.py`). Anything that fails on one record (the
messages, the template's own `raise_exception`, a bound, a missing include) is that record's
`TemplateRecordError`: the importer counts it and goes on.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from kmesh_trace.datasets.importers.chat_messages import MessageError, developer_as_system, parse_messages
from kmesh_trace.datasets.importers.content_format import detect_content_format
from kmesh_trace.datasets.importers.template_bounds import BoundedEnvironment, RenderBoundError
from kmesh_trace.errors import InputFormatError

#: Where a tokenizer directory keeps its chat template, in the order transformers reads them.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


class TemplateRecordError(InputFormatError):
    """One record the template cannot render: the record's error, not the import's."""


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise InputFormatError(f"{path} is not readable JSON ({type(e).__name__}).") from None
    if not isinstance(value, dict):
        raise InputFormatError(f"{path} does not hold a JSON object.")
    return value


def _template_of(value: Any) -> str | None:
    if isinstance(value, list):  # named templates: the default one
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) else None


def find_template(directory: Path) -> tuple[str, Path] | None:
    """(template text, the file it came from) of a tokenizer directory, or None when it has none."""
    for name in TEMPLATE_FILES:
        path = directory / name
        if not path.is_file():
            continue
        if name.endswith(".jinja"):
            try:
                return path.read_text(encoding="utf-8"), path
            except (OSError, UnicodeDecodeError) as e:
                raise InputFormatError(f"{path} is not a readable text file ({type(e).__name__}).") from None
        template = _template_of(_read_json(path).get("chat_template"))
        if template is not None:
            return template, path
    return None


def special_tokens(directory: Path) -> dict[str, str]:
    """The named special tokens the template is rendered with (`bos_token`, `eos_token`, ...)."""
    found: dict[str, str] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        path = directory / name
        if path.is_file():
            for k, v in _read_json(path).items():
                v = v.get("content") if isinstance(v, dict) else v
                if k.endswith("_token") and isinstance(v, str):
                    found[k] = v
    return found


class ChatTemplate:
    """The chat template of a tokenizer directory (module docstring)."""

    def __init__(self, directory: Path, found: tuple[str, Path], placeholders: dict[str, str]):
        text, self.source = found
        self._env = BoundedEnvironment()
        try:
            self._template = self._env.from_string(text)
        except Exception as e:  # a syntax error, or a template nested past the compiler's recursion
            raise InputFormatError(f"the chat template in {self.source} does not compile "
                                   f"({type(e).__name__}: {_first_line(e)}).") from None
        self._text = text
        self.content_format = detect_content_format(text, self._env)
        self.placeholders = placeholders
        self._special = special_tokens(directory)
        self.sha = hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def load(cls, directory: Path, placeholders: dict[str, str]) -> "ChatTemplate | None":
        """The directory's template, or None when it has none."""
        found = find_template(directory)
        return None if found is None else cls(directory, found, placeholders)

    def render(self, messages: list, media: dict[str, int] | None = None) -> str:
        """The prompt text of one record's `messages`; TemplateRecordError when the record cannot be rendered.
        Media parts replaced by placeholders are added to `media` (modality -> count)."""
        try:
            parsed = parse_messages(messages, self.content_format, self.placeholders)
        except MessageError as e:
            raise TemplateRecordError(str(e)) from None
        conversation = developer_as_system(parsed.conversation, self._text)
        context = {**self._special, "messages": conversation, "tools": None, "documents": None,
                   "add_generation_prompt": True}
        try:
            text = self._env.render(self._template, context)
        except RenderBoundError as e:
            raise TemplateRecordError(f"the chat template was stopped: {e}") from None
        except Exception as e:  # the template's own refusal, a missing include, a recursion, a type error
            raise TemplateRecordError(f"the chat template failed ({type(e).__name__}: {_first_line(e)})") from None
        if media is not None:
            for modality, n in parsed.num_media_parts.items():
                media[modality] = media.get(modality, 0) + n
        return text


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "no message")[:160]
