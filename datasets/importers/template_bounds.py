"""A chat template rendered in-process with bounds on its time and its output, so that no template and no
record can hang an import or exhaust its memory.

The environment is transformers' (an immutable sandbox with trim_blocks, lstrip_blocks, loop controls, the
`{% generation %}` tag, `raise_exception`, `strftime_now` and a `tojson` that does not escape HTML), with:
- a time bound: every block the template enters (each loop iteration, branch and macro call) and every call,
  attribute and item access checks the render's deadline (`RENDER_SECONDS`);
- an output bound: the rendered text, every string a `*`, `+`, `%` or `~` builds, and every width a filter
  or string method is asked for stay under `MAX_CHARS` characters (lists under `MAX_ITEMS` items); powers
  stay under `MAX_POWER_BITS` bits;
- Python's recursion limit for recursive macros.
A render past a bound raises `RenderBoundError`; it is the record's error, as a template's own refusal is.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from datetime import datetime
from typing import Any, Callable

import jinja2
import jinja2.ext
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: Seconds one render may take.
RENDER_SECONDS = 10.0
#: Characters one render may produce (and any one string it builds).
MAX_CHARS = 32 << 20
#: Items any one list a render builds may hold.
MAX_ITEMS = 4 << 20
#: Bits of the largest integer a power may build.
MAX_POWER_BITS = 1 << 16
#: A width in a printf-style or format-spec string that would pass MAX_CHARS.
_WIDE_FORMAT = re.compile(r"%[-+ #0]*\d{9,}|\{[^{}]*:[^{}]*\d{9,}[^{}]*\}")


class RenderBoundError(jinja2.exceptions.TemplateError):
    """A render ran past its time or output bound."""


class GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}`: its body renders as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _TickingCodeGenerator(CodeGenerator):
    """Compiled templates that check the deadline on entering any block and build `~` joins in bounds."""

    def blockvisit(self, body, frame) -> None:
        self.writeline("environment.tick()")
        super().blockvisit(body, frame)

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _check_size(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_CHARS:
        raise RenderBoundError(f"the template built a string over {MAX_CHARS:,} characters")
    if isinstance(value, (list, tuple)) and len(value) > MAX_ITEMS:
        raise RenderBoundError(f"the template built a list over {MAX_ITEMS:,} items")
    return value


def _check_args(args: tuple, kwargs: dict) -> None:
    """No width, count or repetition argument that alone would pass the output bound."""
    for a in (*args, *kwargs.values()):
        if type(a) is int and abs(a) > MAX_CHARS:
            raise RenderBoundError(f"the template asked for a width or count of {a:.3g}")


def _check_format(fmt: str) -> None:
    """No printf-style or format-spec width that would pass the output bound."""
    if _WIDE_FORMAT.search(fmt):
        raise RenderBoundError("the template asked for a format width past the output bound")


def _size(v: Any) -> int:
    return len(v) if isinstance(v, (str, list, tuple)) else 0


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment with the bounds of the module docstring."""

    code_generator_class = _TickingCodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
        self._state = threading.local()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            _check_args((indent,), {})
            return _check_size(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                          sort_keys=sort_keys))

        self.filters = {name: _bounded(f) for name, f in self.filters.items()}
        self.filters["tojson"] = tojson
        self.globals["raise_exception"] = raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)

    def tick(self) -> None:
        deadline = getattr(self._state, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise RenderBoundError(f"the template ran past its {RENDER_SECONDS:g} s bound")

    def concat(self, values: tuple) -> str:
        parts = [str(v) for v in values]
        if sum(map(len, parts)) > MAX_CHARS:
            raise RenderBoundError(f"the template built a string over {MAX_CHARS:,} characters")
        return "".join(parts)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        self.tick()
        if operator == "*":
            seq, n = (left, right) if type(right) is int else (right, left) if type(left) is int else (None, 0)
            if (isinstance(seq, str) and len(seq) * n > MAX_CHARS) or (
                    isinstance(seq, (list, tuple)) and len(seq) * n > MAX_ITEMS):
                raise RenderBoundError("the template repeated a string or list past the output bound")
        elif operator == "+" and _size(left) + _size(right) > MAX_CHARS:
            raise RenderBoundError(f"the template built a string over {MAX_CHARS:,} characters")
        elif operator == "**" and type(left) is int and type(right) is int and abs(left) > 1 and \
                right * math.log2(abs(left)) > MAX_POWER_BITS:
            raise RenderBoundError(f"the template asked for a power over {MAX_POWER_BITS:,} bits")
        elif operator == "%" and isinstance(left, str):
            _check_format(left)
            _check_args(right if isinstance(right, tuple) else (right,), {})
        return _check_size(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        __self.tick()
        if isinstance(getattr(__obj, "__self__", None), str):  # a string method: widths, counts, formats
            _check_args(args, kwargs)
            _check_format(__obj.__self__)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj, attribute):
        self.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.tick()
        return super().getitem(obj, argument)

    def render(self, template: jinja2.Template, context: dict) -> str:
        """`template` rendered with `context` within RENDER_SECONDS and MAX_CHARS (RenderBoundError past them)."""
        self._state.deadline = time.monotonic() + RENDER_SECONDS
        try:
            out, n = [], 0
            for chunk in template.generate(**context):
                n += len(chunk)
                if n > MAX_CHARS:
                    raise RenderBoundError(f"the rendered prompt passed {MAX_CHARS:,} characters")
                out.append(chunk)
                self.tick()
            return "".join(out)
        finally:
            self._state.deadline = None


def _bounded(f: Callable) -> Callable:
    """A built-in filter whose arguments after the value are checked (and the value too, when it is a format
    string), and whose result is sized."""
    skip = 1 + (getattr(f, "jinja_pass_arg", None) is not None)  # the context, eval context or environment

    def bounded(*args, **kwargs):
        value, rest = args[skip - 1:skip], args[skip:]
        _check_args(rest, kwargs)
        if value and isinstance(value[0], str) and rest:
            _check_format(value[0])
        return _check_size(f(*args, **kwargs))

    if hasattr(f, "jinja_pass_arg"):
        bounded.jinja_pass_arg = f.jinja_pass_arg
    bounded.__name__ = getattr(f, "__name__", "filter")
    return bounded
