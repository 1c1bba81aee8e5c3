"""Analysis options as dataclasses that name their CLI flags once, so a command line that reproduces
a run is derived from the options it ran with (`flags`), never kept by hand.

A field declared with `option("--flag", default)` is an analysis option; `flags(options)` gives the
flags of every such field that differs from its default, in field order, as the CLI spells them
(lists comma-separated, enums by value, a true boolean as the bare flag).
"""

from __future__ import annotations

from dataclasses import field, fields
from enum import Enum
from typing import Any

__all__ = ["flags", "option"]


def option(flag: str | None, default: Any = None) -> Any:
    """A dataclass field given on the command line as `flag` (None: it has no flag of its own)."""
    return field(default=default, metadata={"flag": flag})


def flags(options: Any) -> str:
    """" --flag value" for each option of `options` that is not its default (empty when all are)."""
    out = []
    for f in fields(options):
        flag, value = f.metadata.get("flag"), getattr(options, f.name)
        if flag is None or value == f.default:
            continue
        if isinstance(value, bool):
            out.append(f" {flag}" if value else "")
            continue
        if isinstance(value, Enum):
            value = value.value
        elif isinstance(value, (tuple, list)):
            value = ",".join(map(str, value))
        out.append(f" {flag} {value}")
    return "".join(out)
