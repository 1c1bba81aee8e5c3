"""Which content format a chat template takes, detected from its syntax tree as vLLM does
(`vllm/renderers/hf.py`, `_detect_content_format`, 0.33's rules, which include 0.32's): "openai" when the
template loops over a message's content (directly, through an alias, a namespace attribute or a macro
parameter), "string" otherwise, and "string" for a template that does not parse."""

from __future__ import annotations

from collections import deque
from typing import Iterator

import jinja2
from jinja2 import nodes


class _Unreadable(Exception):
    """A shape vLLM's detection does not handle."""


def detect_content_format(template: str, env: jinja2.Environment) -> str:
    """'openai' or 'string' for `template`, parsed by `env` (the environment the template renders in)."""
    try:
        root = env.parse(template)
        next(_content_loops(root))
    except StopIteration:
        return "string"
    except (jinja2.TemplateError, RecursionError, _Unreadable):
        return "string"
    return "openai"


def _is_var(node: nodes.Node, name: str) -> bool:
    if isinstance(node, nodes.Name):
        return node.ctx == "load" and node.name == name
    if isinstance(node, nodes.Getattr) and "." in name:  # `ns.rest` matches the dotted alias "ns.rest"
        base, _, attr = name.rpartition(".")
        return node.attr == attr and _is_var(node.node, base)
    return False


def _is_attr(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_access(node: nodes.Node, name: str, key: str | None = None) -> bool:
    """`name` (or `name[key]`), through filters, tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_access(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_access(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_access(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _dotted(node: nodes.Node) -> str | None:
    if isinstance(node, nodes.NSRef):
        return f"{node.name}.{node.attr}"
    parts = []
    while isinstance(node, nodes.Getattr):
        parts.append(node.attr)
        node = node.node
    if isinstance(node, nodes.Name):
        parts.append(node.name)
        return ".".join(reversed(parts))
    return None


def _aliases(assign: nodes.Assign, name: str) -> list[str]:
    lhs, rhs = assign.target, assign.node
    if isinstance(lhs, nodes.Name) and isinstance(rhs, nodes.Call) and isinstance(rhs.node, nodes.Name) \
            and rhs.node.name == "namespace":
        return [f"{lhs.name}.{kw.key}" for kw in rhs.kwargs if _is_access(kw.value, name)]
    if isinstance(lhs, (nodes.Getattr, nodes.NSRef)) and _is_access(rhs, name):
        dotted = _dotted(lhs)
        return [dotted] if dotted is not None else []
    return []


def _names_of(root: nodes.Node, name: str) -> list[str]:
    """`name` and every variable assigned from it (breadth first)."""
    found, seen, queue = [name], {name}, deque([name])
    while queue:
        current = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            lhs = assign.target
            new = [lhs.name] if isinstance(lhs, nodes.Name) and _is_access(assign.node, current) else []
            for alias in new + _aliases(assign, current):
                found.append(alias)
                if alias != current and alias not in seen:
                    seen.add(alias)
                    queue.append(alias)
    return found


def _message_names(root: nodes.Node) -> list[str]:
    """The loop variables of loops over the messages."""
    names = _names_of(root, "messages")
    out = []
    for loop in root.find_all(nodes.For):
        if any(_is_access(loop.iter, n) for n in names):
            if not isinstance(loop.target, nodes.Name):
                raise _Unreadable  # vLLM's detection fails there and falls back to "string"
            out.append(loop.target.name)
    return out


def _macro_content_params(root: nodes.Node, messages: list[str]) -> tuple[dict[int, set[str]], set[int]]:
    """Per loop inside a macro, the macro's parameters that receive a message's content; and every macro loop."""
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {a.name for a in macro.args}
        params: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_access(arg, m, "content") for m in messages):
                    params.add(macro.args[i].name)
            for kw in call.kwargs:
                if isinstance(kw, nodes.Keyword) and kw.key in names and any(
                        _is_access(kw.value, m, "content") for m in messages):
                    params.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if params:
                by_loop[id(loop)] = params
    return by_loop, in_macros


def _content_loops(root: nodes.Node) -> Iterator[nodes.For]:
    messages = _message_names(root)
    by_loop, in_macros = _macro_content_params(root, messages)
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if any(_is_access(it, m, "content") for m in messages):
            yield loop
        elif isinstance(it, nodes.Name) and it.name in by_loop.get(id(loop), ()):
            yield loop
        elif id(loop) not in in_macros and isinstance(it, nodes.Name) and it.name == "content":
            yield loop
