"""The one boundary: every value that comes from outside is parsed here, once, where it enters.

Outside values are command-line flags, files the tools read (a Hugging Face `config.json`, a
`replay run` results directory) and the ids a user names. Each becomes a typed, range-checked value
at the boundary, or one `KmeshTraceError` sentence naming what was wrong and where; code past the
boundary trusts what it is given. Files are decoded by msgspec (a vLLM dependency already present):
it refuses wrong types, out-of-range numbers, non-UTF-8 and non-JSON text in one pass, without
building intermediate Python objects, which also suits the importers' hot paths. Numbers in JSON are
always finite (JSON has no NaN or infinity, and msgspec refuses a literal beyond a float's range).

Flags: `finite_float(...)`, `bounded_int(...)` and `identifier` are parsers for
`typer.Option(..., parser=...)`; they refuse NaN, infinities and values outside the flag's domain with
a usage error naming the flag, before the command runs.
"""

from __future__ import annotations

import math
from typing import Any, Callable

#: Largest value of an int64 column (counts, ids, nanosecond times).
MAX_INT64 = (1 << 63) - 1


# ---- flags -------------------------------------------------------------------------------------------
# Parsers for `typer.Option(..., parser=...)`. A refusal is a FlagRefusal (a ValueError) whose text is the whole
# sentence: the CLI reports it as "Invalid value for '--flag': <sentence>" and exits 1 before the command runs
# (kmesh_trace.cli.group; click's own parser types word a ValueError the same way).

class FlagRefusal(ValueError):
    """A flag's value refused by its parser; the message is one sentence naming the value and the domain."""


def _refuse(text: str) -> Exception:
    return FlagRefusal(text)


def finite_float(lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], float]:
    """A parser of finite floats in [lo, hi] (an open end excludes its bound); NaN and infinities are refused.
    Both bounds are required: a finite float is not yet a sane one (1e300 overflows whatever it sizes)."""
    bounds = [f"{'above' if lo_open else 'at least'} {_num(lo)}", f"{'below' if hi_open else 'at most'} {_num(hi)}"]
    want = "a finite number" + (f" {' and '.join(bounds)}" if bounds else "")

    def parse(value: Any) -> float:
        try:
            v = float(value)
        except (TypeError, ValueError):
            v = math.nan
        if not math.isfinite(v) or (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi):
            raise _refuse(f"{value!r} is not {want}.")
        return v

    parse.bounds = (lo, hi)  # what tests/test_cli_float_bounds.py checks every float flag for
    return parse


def _num(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def bounded_int(lo: int | None = None, hi: int | None = MAX_INT64) -> Callable[[Any], int]:
    """A parser of integers in [lo, hi] (hi defaults to the int64 range of every count column)."""
    want = " and ".join(x for x in ("" if lo is None else f"at least {lo:,}", "" if hi is None else f"at most {hi:,}") if x)

    def parse(value: Any) -> int:
        try:
            v = value if type(value) is int else int(str(value).strip(), 10)
        except ValueError:
            raise _refuse(f"{value!r} is not an integer.") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _refuse(f"{value!r} is not an integer {want}.")
        return v

    return parse


def control_characters(text: str) -> list[str]:
    """The characters of `text` that do not print as themselves (controls such as newline and ESC, format
    characters such as bidi overrides, separators other than the space, unassigned code points), as escapes."""
    return [ch.encode("unicode_escape").decode("ascii") for ch in text if not ch.isprintable() and ch != " "]


def identifier_problem(text: str) -> str | None:
    """Why `text` cannot be an id that names a partition or a file (None when it can): empty, padded
    with white space, holding control characters or a path separator, or over 200 characters."""
    bad = control_characters(text)
    if bad:
        return f"holds control characters ({', '.join(dict.fromkeys(bad))})"
    if not text or text.strip() != text:
        return "is empty or starts or ends with white space"
    if "/" in text or "\\" in text or text in (".", ".."):
        return "holds a path separator or is . or .."
    if len(text) > 200:
        return "is longer than 200 characters"
    return None


def identifier(value: Any) -> str:
    """A parser of ids that become part of a trace (`--engine-id`)."""
    text = str(value)
    why = identifier_problem(text)
    if why:
        raise _refuse(f"{text!r} {why}.")
    return text


#: Longest duration (seconds) that still fits an int64 nanosecond column: every flag given in seconds
#: that becomes nanoseconds is bounded by it.
MAX_SECONDS = MAX_INT64 // 10**9
#: The largest prefill throughput a flag may give (tokens per second): far beyond any accelerator.
MAX_TOKENS_PER_S = 1e12
#: The largest multiple or factor a flag may give.
MAX_FACTOR = 1e6
#: Block counts and ids are int32 in the contract.
MAX_BLOCKS = (1 << 31) - 1
#: Most KV bytes one token may occupy (1 TiB, over a million times a large model's): the flag, a model's
#: `config.json` and a capture's metadata are all held to it.
MAX_KV_BYTES_PER_TOKEN = 1 << 40


def kv_bytes_refusal(kv_bytes_per_token: int, source: str) -> str | None:
    """Why `kv_bytes_per_token` (from `source`) cannot be used (None when it can): not positive, or over 1 TiB."""
    if kv_bytes_per_token <= 0 or kv_bytes_per_token > MAX_KV_BYTES_PER_TOKEN:
        return (f"{source} gives {kv_bytes_per_token:,} KV bytes per token, outside 1 to "
                f"{MAX_KV_BYTES_PER_TOKEN:,} (1 TiB); check it or pass --kv-bytes-per-token.")
    return None


def token_bytes(tokens: int, kv_bytes_per_token: int, what: str) -> int:
    """`tokens` x `kv_bytes_per_token` exactly, or one KmeshTraceError when the bytes do not fit the int64
    counters the simulators keep (`what` names the tokens)."""
    total = int(tokens) * int(kv_bytes_per_token)
    if total > MAX_INT64:
        from kmesh_trace.errors import KmeshTraceError

        raise KmeshTraceError(f"{what} ({int(tokens):,} tokens at {int(kv_bytes_per_token):,} KV bytes per token) "
                              f"come to {total:,} bytes, past the int64 byte counters ({MAX_INT64:,}); "
                              f"check the KV bytes per token.")
    return total


# ---- the JSON the tools print ----------------------------------------------------------------------

def json_text(obj: Any, indent: int | None = 2) -> str:
    """`obj` as strict JSON: a float that is NaN or infinite (an undefined ratio, a 0/0) becomes null,
    so `--json` output is always valid JSON (RFC 8259 has no NaN or Infinity); unknown types as text."""
    import json

    dump = json.dumps if indent is None else _dump_compact_arrays
    try:
        return dump(obj, indent=indent, default=str, allow_nan=False)
    except ValueError:  # a non-finite float somewhere: replace it, then dump again
        return dump(finite_or_null(obj), indent=indent, default=str, allow_nan=False)


def _dump_compact_arrays(obj: Any, *, indent: int, default, allow_nan: bool, _level: int = 0) -> str:
    """`json.dumps(obj, indent=indent)`, except that an array of numbers, strings, booleans and nulls is written
    on one line (a curve's thousand capacities: one line, not a thousand)."""
    import json

    def scalar(x: Any) -> str:
        return json.dumps(x, default=default, allow_nan=allow_nan)

    if isinstance(obj, dict):
        if not obj:
            return "{}"
        pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
        items = [f"{inner}{json.dumps(k if isinstance(k, str) else json.dumps(k) if k is None or isinstance(k, bool) else str(k))}: "
                 f"{_dump_compact_arrays(v, indent=indent, default=default, allow_nan=allow_nan, _level=_level + 1)}"
                 for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if not obj:
            return "[]"
        if all(x is None or isinstance(x, (bool, int, float, str)) for x in obj):
            return "[" + ", ".join(scalar(x) for x in obj) + "]"
        pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
        return "[\n" + ",\n".join(inner + _dump_compact_arrays(v, indent=indent, default=default, allow_nan=allow_nan,
                                                                _level=_level + 1) for v in obj) + "\n" + pad + "]"
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return scalar(obj)
    converted = default(obj)  # as json.dumps: an unknown type through `default`
    return _dump_compact_arrays(converted, indent=indent, default=default, allow_nan=allow_nan, _level=_level)


#: The file readers (msgspec), in kmesh_trace.json_files: loaded when first named, so a command's flags parse
#: without importing msgspec.
_FILE_NAMES = ("decode_json", "read_json_file", "read_model_config", "Positive", "NonNegative", "PositiveFloat",
               "Timer", "RouteSummary", "ReplaySummary", "ReplayBench")


def __getattr__(name: str):
    if name in _FILE_NAMES:
        from kmesh_trace import json_files  # deferred: it loads msgspec

        return getattr(json_files, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def finite_or_null(obj: Any) -> Any:
    """`obj` with every NaN or infinite float (nested in dicts, lists and tuples) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_null(v) for v in obj]
    return obj
