"""A command's flags declared once, as a dataclass, and the command's parameters generated from it.

A flags class is written as a command's parameters are, one field per parameter:

    @flags
    class TiersFlags:
        trace: TraceOrScenarioArgument = None          # an Annotated type carrying its typer.Argument/Option
        host: Optional[str] = typer.Option(None, "--host", help="...")   # or the typer parameter as the default
        sizes: CapacityBytesFlags = CapacityBytesFlags()   # a shared block of flags: expanded in its place

`@flags` makes it a frozen, keyword-only dataclass whose defaults are the parameters' defaults (so an
analysis or a test can build one), and `takes_flags` turns a command `fn(f: TiersFlags, ...)` into the
function typer registers: the flags class's fields (blocks expanded in place, in declaration order, which
is the order of `--help`) stand in the signature for `f`, and the values typer parses are given back to
`fn` as one `TiersFlags`. A flag shared by several commands is declared once (an Annotated type or a block)
and named in each flags class. `hidden_alias` declares a deprecated second name of an option (`aliased`
merges the two), and `options_of` builds an analysis' options dataclass from the flags of the same names.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable

from typer.models import ParameterInfo

__all__ = ["aliased", "flags", "hidden_alias", "is_flags", "options_of", "parameters", "takes_flags"]

_PARAMETER = "kmesh_parameter"  # a field's metadata key: the typer parameter given as its default


def is_flags(cls: Any) -> bool:
    return isinstance(cls, type) and getattr(cls, "__kmesh_flags__", False)


def flags(cls: type) -> type:
    """Class decorator: `cls` as a frozen keyword-only dataclass of command flags (see the module's help)."""
    for name in cls.__dict__.get("__annotations__", {}):
        default = cls.__dict__.get(name, dataclasses.MISSING)
        if isinstance(default, ParameterInfo):
            setattr(cls, name, _field_of(default))
        elif is_flags(type(default)):  # a block: each instance its own (frozen, so sharing one is harmless too)
            setattr(cls, name, dataclasses.field(default_factory=type(default)))
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    cls.__kmesh_flags__ = True
    return cls


def _field_of(info: ParameterInfo):
    value = info.default
    if value is ... or value is dataclasses.MISSING:
        return dataclasses.field(metadata={_PARAMETER: info})
    if isinstance(value, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={_PARAMETER: info})
    return dataclasses.field(default=value, metadata={_PARAMETER: info})


def parameters(cls: type) -> list[inspect.Parameter]:
    """The command parameters of a flags class, blocks expanded in place, as typer reads a signature."""
    hints = typing.get_type_hints(cls, include_extras=True)
    params = []
    for f in dataclasses.fields(cls):
        annotation = hints[f.name]
        if is_flags(annotation):
            params += parameters(annotation)
            continue
        if _PARAMETER in f.metadata:
            default = f.metadata[_PARAMETER]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = inspect.Parameter.empty
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
    return params


def _build(cls: type, values: dict) -> Any:
    """The flags object of the parsed `values` (taken out of `values`: each value belongs to one field)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    kwargs = {}
    for f in dataclasses.fields(cls):
        kwargs[f.name] = _build(hints[f.name], values) if is_flags(hints[f.name]) else values.pop(f.name)
    return cls(**kwargs)


def takes_flags(fn: Callable) -> Callable:
    """Decorator: the command `fn`, whose parameters annotated with a flags class are each replaced by that
    class's fields (the others, such as `output`, stay as they are, after them)."""
    sig = inspect.signature(fn, eval_str=True)
    blocks = {name: p.annotation for name, p in sig.parameters.items() if is_flags(p.annotation)}
    if not blocks:
        raise TypeError(f"{fn.__name__} takes no flags class")
    expanded = [q for cls in blocks.values() for q in parameters(cls)]
    rest = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for name, p in sig.parameters.items() if name not in blocks]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        built = {name: _build(cls, kwargs) for name, cls in blocks.items()}
        return fn(**built, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=expanded + rest)
    wrapper.__annotations__ = {p.name: p.annotation for p in expanded + rest}
    return wrapper


def hidden_alias(annotated: Any, flag: str) -> ParameterInfo:
    """A deprecated second name of the option `annotated` (an Annotated type carrying a typer.Option): the same
    value, parsed alike, hidden from --help (`aliased` merges the two)."""
    import typer

    info = next(m for m in typing.get_args(annotated)[1:] if isinstance(m, ParameterInfo))
    name = info.default if isinstance(info.default, str) else info.param_decls[0]  # Annotated: the first name is in `default`
    return typer.Option(None, flag, parser=info.parser, hidden=True, help=f"Deprecated: the old name of {name}.")


def aliased(value: Any, flag: str, old_value: Any, old_flag: str) -> tuple[Any, str]:
    """(the value given, the flag it was given with) of an option and its `hidden_alias`; both given is refused."""
    from kmesh_trace.errors import KmeshTraceError

    if value is not None and old_value is not None:
        raise KmeshTraceError(f"give {flag} once ({old_flag} is its old name).")
    return (value, flag) if old_value is None else (old_value, old_flag)


def options_of(cls: type, source: Any, **given: Any) -> Any:
    """The analysis options `cls` (a dataclass) from a flags object: each field of `cls` that `source` has, by
    name (an Enum by its value), then `given`."""
    from enum import Enum

    values = {}
    for f in dataclasses.fields(cls):
        if f.name in given or not hasattr(source, f.name):
            continue
        value = getattr(source, f.name)
        values[f.name] = value.value if isinstance(value, Enum) else value
    return cls(**values, **given)
