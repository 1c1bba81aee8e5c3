"""Each parameter's line in a command's --help, as a reader wants it: no `<list[str]>` type label (a
repeatable argument reads `COMMAND...`, a repeatable option `<str>`, the value of one use) and one space,
not click's two, before `[default: ...]` and `[required]`.

typer 0.29 writes both into the help record (`TyperArgument` / `TyperOption.get_help_record`), so each
parameter's record is tidied as it is written: on the command the root group resolves, and on the
subcommands of a group.
"""

from __future__ import annotations

import re

_LIST_LABEL = re.compile(r"<list\[([^\]]*)\]>")
_BEFORE_BRACKET = re.compile(r"(?<=\S)  (?=\[)")


def tidy(record: tuple[str, str] | None, *, argument: bool) -> tuple[str, str] | None:
    """The help record `(name, help)` without a list type label and with single spaces before brackets."""
    if record is None:
        return None
    name, help_ = record
    name = _LIST_LABEL.sub("", name).rstrip() if argument else _LIST_LABEL.sub(r"<\1>", name)
    return name, _BEFORE_BRACKET.sub(" ", help_)


def install(command) -> None:
    """Tidy the help record of every parameter of `command` and of its built subcommands (idempotent)."""
    import typer.core

    for p in command.params:
        if getattr(p, "_kmesh_tidy", False):
            continue
        orig = p.get_help_record
        argument = isinstance(p, typer.core.TyperArgument)
        p.get_help_record = lambda ctx, _orig=orig, _argument=argument: tidy(_orig(ctx), argument=_argument)
        p._kmesh_tidy = True
    subcommands = getattr(command, "commands", None)
    if isinstance(subcommands, dict):
        for sub in subcommands.values():
            install(sub)
