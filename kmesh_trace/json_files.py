"""The files the tools read at the boundary (a Hugging Face `config.json`, a `replay run` results directory),
decoded by msgspec into typed, range-checked values, or one InputFormatError sentence naming the file and
the field (see kmesh_trace.values, which re-exports these names)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional, TypeVar

import msgspec

from kmesh_trace.errors import InputFormatError

T = TypeVar("T")


def decode_json(data: bytes, type_: type[T], where: str) -> T:
    """`data` as `type_`, or an InputFormatError saying where and why (not UTF-8, not JSON, a field of
    the wrong type or out of range, nested too deep)."""
    try:
        return msgspec.json.decode(data, type=type_)
    except msgspec.ValidationError as e:
        raise InputFormatError(f"{where}: {_plain(e)}.") from None
    except msgspec.DecodeError as e:
        raise InputFormatError(f"{where} is not JSON text ({_plain(e)}).") from None
    except RecursionError:
        raise InputFormatError(f"{where} nests its JSON too deep to read.") from None


def read_json_file(path: Path, type_: type[T], what: str) -> T:
    """The file at `path` (`what` it is, for the message) decoded as `type_`; an unreadable file is
    an InputFormatError naming it."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputFormatError(f"cannot read {what} {path}: {e.strerror or type(e).__name__}.") from None
    return decode_json(data, type_, f"{what} {path}")


def _plain(e: Exception) -> str:
    """msgspec's message in the project's words: `$.a.b` becomes `field a.b`."""
    text = str(e)
    head, sep, at = text.partition(" - at `$")
    if sep:
        path = at.rstrip("`").lstrip(".")
        return f"field {path}: {head[0].lower()}{head[1:]}" if path else head
    return text[0].lower() + text[1:] if text else "invalid"


Positive = Annotated[int, msgspec.Meta(ge=1)]
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class _TextConfig(msgspec.Struct, forbid_unknown_fields=False):
    """The attention shape of a Hugging Face `config.json` (the fields the KV size needs)."""

    num_hidden_layers: Positive
    num_attention_heads: Positive
    num_key_value_heads: Optional[Positive] = None
    head_dim: Optional[Positive] = None
    hidden_size: Optional[Positive] = None
    torch_dtype: Optional[str] = None
    dtype: Optional[str] = None


class _MaybeNested(msgspec.Struct, forbid_unknown_fields=False):
    text_config: Optional[dict] = None


def read_model_config(path: Path) -> _TextConfig:
    """A Hugging Face `config.json` (its `text_config` when it has one), every KV-shape field a
    positive integer; `head_dim` or `hidden_size` must be given."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise InputFormatError(f"cannot read the model config {path}: {e.strerror or type(e).__name__}.") from None
    where = f"model config {path}"
    outer = decode_json(data, _MaybeNested, where)
    if outer.text_config is not None:
        cfg = _convert(outer.text_config, _TextConfig, f"{where} (text_config)")
    else:
        cfg = decode_json(data, _TextConfig, where)
    if cfg.head_dim is None and cfg.hidden_size is None:
        raise InputFormatError(f"{where} gives neither head_dim nor hidden_size; pass --kv-bytes-per-token instead.")
    return cfg


def _convert(obj: Any, type_: type[T], where: str) -> T:
    try:
        return msgspec.convert(obj, type_)
    except msgspec.ValidationError as e:
        raise InputFormatError(f"{where}: {_plain(e)}.") from None


class Timer(msgspec.Struct, forbid_unknown_fields=False):
    p50_ms: Optional[PositiveFloat] = None
    p95_ms: Optional[PositiveFloat] = None


class RouteSummary(msgspec.Struct, forbid_unknown_fields=False):
    timer1: Optional[Timer] = None
    mode: Optional[str] = None


class ReplaySummary(msgspec.Struct, forbid_unknown_fields=False):
    """`summary.json` of a `replay run --out` directory: the fields the tier costs read."""

    routes: dict[str, Optional[RouteSummary]] = {}
    store_bytes: Optional[NonNegative] = None
    num_store_restores: Optional[NonNegative] = None


class ReplayBench(msgspec.Struct, forbid_unknown_fields=False):
    """`bench.json` of a results directory: the host-to-GPU copy time per restore."""

    h2d_copy_ms_per_restore: Optional[PositiveFloat] = None
    bytes: Optional[NonNegative] = None
    files: Optional[Positive] = None


