"""Option values converted without pydantic: the start-up half of issue 26 item 4.

typer 0.29 converts every parameter value through a pydantic TypeAdapter (typer/_coercion.py
`build_runtime_param`), built the first time the parameter is processed: the first command line that
names a value, or even `kmesh-trace CMD --help` (the root's unset --help is processed too), imports
pydantic and builds adapters, ~0.2 s of a ~0.35 s start. typer 0.29 takes no click types any more, and a
`parser=` is wrapped in an adapter as well, so neither avoids it.

`install(command)` gives each parameter of a command tree a `PlainRuntimeParam` before its values are
processed. It converts the values whose result is certain without pydantic -- a `str`; an `int` or `float`
written canonically (`-12`, `0.5`); a `bool` that already is one; a `Path` from a non-empty string; an Enum
choice (typer's own `coerce_cli_choice`, its refusal worded as pydantic words it); a `parser=` that accepts
the value or refuses it with kmesh_trace.values.FlagRefusal (the sentence is the message) -- and hands every
other value to typer's own runtime parameter (pydantic), so an unusual value is accepted or refused exactly
as typer does it, with typer's message. tests/test_cli_startup.py compares the two on a matrix of values. Where
typer's internals are not the ones this module knows (another typer version), nothing is installed.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

from kmesh_trace.values import FlagRefusal

try:  # typer >= 0.29: the runtime-parameter layer this module plugs into
    from typer._coercion import RuntimeParam, build_runtime_param
    from typer._click.exceptions import BadParameter
    from typer._click.utils import _escape_control_characters
    from typer._param_types import coerce_cli_choice, coerce_cli_path, routes_to_path
except ImportError:  # pragma: no cover - older typer converts with click types, no pydantic
    RuntimeParam = None

def _digits(text: str, most: int) -> bool:
    """`text` is 1 to `most` ASCII digits without a leading zero (or is "0")."""
    return 0 < len(text) <= most and text.isascii() and text.isdigit() and (text == "0" or text[0] != "0")


def _canonical_int(text: str) -> bool:
    """`-12`, `0`, `7`: at most 18 digits, so neither parser meets a big-number edge."""
    return _digits(text[1:] if text.startswith("-") else text, 18)


def _canonical_float(text: str) -> bool:
    """`0.5`, `-3`, `12.25`: a canonical integer part of at most 15 digits, then at most 15 decimals."""
    whole, dot, fraction = (text[1:] if text.startswith("-") else text).partition(".")
    return _digits(whole, 15) and (not dot or (0 < len(fraction) <= 15 and fraction.isascii() and fraction.isdigit()))


class _Unsure(Exception):
    """The value is not one this module converts with certainty: typer's own conversion decides."""


def _plain_value(descriptor, value: Any, param, ctx) -> Any:
    """`value` converted as typer's adapter converts it, or _Unsure."""
    annotation, info = descriptor.annotation, descriptor.parameter_info
    if info.parser is not None:
        try:
            return info.parser(value)
        except FlagRefusal as e:  # our parsers' refusal: the sentence is the message (as typer shows it)
            raise BadParameter(_escape_control_characters(str(e)), ctx=ctx, param=param) from None
        except Exception:  # typer's adapter re-runs the parser and words its refusal
            raise _Unsure() from None
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise _Unsure()
    if not isinstance(value, str):
        raise _Unsure()
    if annotation is str:
        return value
    if annotation is int and info.clamp is not True and _canonical_int(value):
        number = int(value)
        if (info.min is None or number >= info.min) and (info.max is None or number <= info.max):
            return number
        raise _Unsure()
    if annotation is float and info.min is None and info.max is None and _canonical_float(value):
        return float(value)
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        try:
            return coerce_cli_choice(value, choices=tuple(annotation), case_sensitive=info.case_sensitive, ctx=ctx)
        except ValueError as e:  # pydantic words a validator's ValueError "Value error, <it>"
            raise BadParameter(_escape_control_characters(f"Value error, {e}"), ctx=ctx, param=param) from None
    raise _Unsure()


if RuntimeParam is not None:

    class PlainRuntimeParam(RuntimeParam):
        """A typer runtime parameter that converts the common values itself (`_plain_value`) and the rest
        through typer's own (pydantic) runtime parameter, built only then."""

        def _coerce_value(self, value: Any, param, ctx) -> Any:
            descriptor = param.type_descriptor
            if routes_to_path(descriptor.annotation, self.parameter_info):
                if isinstance(value, str) and value and "\0" not in value and descriptor.annotation is Path:
                    return coerce_cli_path(Path(value), self.parameter_info, path_type=Path, param=param, ctx=ctx)
            else:
                try:
                    return _plain_value(descriptor, value, param, ctx)
                except _Unsure:
                    pass
            return build_runtime_param(descriptor)._coerce_value(value, param=param, ctx=ctx)


def _plain_kind(descriptor) -> bool:
    """A parameter whose values `PlainRuntimeParam` knows: one value (no list, tuple or file) of a plain type."""
    if descriptor.is_list or descriptor.is_tuple or descriptor.is_file:
        return False
    annotation = descriptor.annotation
    return annotation in (str, int, float, bool, Path) or (isinstance(annotation, type) and issubclass(annotation, Enum))


def install(command, ctx) -> None:
    """Give every parameter of `command` (and of its subcommands) a PlainRuntimeParam, where it applies; its
    --help option too (made with `ctx`'s help option names, as click makes it once per command)."""
    if RuntimeParam is None:
        return
    for p in [*command.params, command.get_help_option(ctx)]:
        descriptor = getattr(p, "type_descriptor", None)
        if getattr(p, "_runtime_param", False) is None and descriptor is not None and _plain_kind(descriptor):
            p._runtime_param = PlainRuntimeParam(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation)
    subcommands = getattr(command, "commands", None)
    if isinstance(subcommands, dict):  # a group already built (the lazy root's commands install as they are built)
        for sub in subcommands.values():
            install(sub, ctx)
