"""The shapes of a request dataset's records (`requests.py`), told apart without its dependencies: the input
sniffer asks these before any columnar library loads."""

from __future__ import annotations

from typing import Any


def is_request_record(record: Any) -> bool:
    """An OpenAI-compatible request (chat `messages` or completion `prompt`, at the top or under `body`) or a
    `vllm bench serve` custom-dataset line ({"prompt", "output_tokens"})."""
    if isinstance(record, dict) and isinstance(record.get("body"), dict):
        record = record["body"]
    return isinstance(record, dict) and (isinstance(record.get("messages"), list) or isinstance(record.get("prompt"), str))


def is_sharegpt(value: Any) -> bool:
    """A ShareGPT file: a list of conversations ({"conversations": [...]})."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict) and "conversations" in value[0]
