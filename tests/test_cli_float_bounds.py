"""Every float flag of every command is bounded above as well as finite: 1e300 is refused in one sentence, never
an OverflowError (`--memory-budget 1e300` once was "unexpected OverflowError")."""

from __future__ import annotations

import types
from typing import Union, get_args, get_origin

import click
import typer


#: Float flags whose value a command checks itself (the same check as the variable they stand for).
CHECKED_ELSEWHERE = ("capture --flush-s", "residency --bucket-s")


def _commands(cmd: click.Command, path: tuple[str, ...] = ()):
    yield path, cmd
    if hasattr(cmd, "list_commands"):
        ctx = click.Context(cmd)
        for name in cmd.list_commands(ctx):
            yield from _commands(cmd.get_command(ctx, name), path + (name,))


def _is_float(annotation) -> bool:
    return annotation is float or (get_origin(annotation) in (Union, types.UnionType) and float in get_args(annotation))


def _float_options():
    """(command, option name, its parser) of every option annotated float (typer resolves types lazily)."""
    from kmesh_trace.cli import app

    for path, cmd in _commands(typer.main.get_command(app)):
        for p in cmd.params:
            td = getattr(p, "type_descriptor", None)
            if td is not None and _is_float(td.annotation):
                parser = td.parameter_info.parser
                yield " ".join(path), p.opts[0], getattr(parser, "__wrapped__", parser)


def test_every_float_flag_has_finite_bounds():
    from kmesh_trace.values import FlagRefusal

    options = list(_float_options())
    assert len(options) >= 20 and any(name == "--memory-budget" for _, name, _ in options)
    unparsed = [f"{cmd} {name}" for cmd, name, parser in options if not hasattr(parser, "bounds")]
    assert unparsed == list(CHECKED_ELSEWHERE)
    for cmd, name, parser in options:
        if f"{cmd} {name}" in CHECKED_ELSEWHERE:
            continue
        try:
            parser("1e300")
        except FlagRefusal as e:
            assert "'1e300' is not a finite number" in str(e) and ("at most" in str(e) or "below" in str(e))
        else:
            raise AssertionError(f"{cmd} {name} takes 1e300")


def test_memory_budget_1e300_is_one_sentence(cli, tmp_path):
    src = tmp_path / "r.jsonl"
    src.write_text('{"prompt": "a"}\n')
    for args in (["headroom", src, "--memory-budget", "1e300"], ["headroom", src, "--attention-factor", "1e300"],
                 ["advise", src, "--prefill-tokens-per-s", "1e300"], ["listen", "--duration", "1e300"],
                 ["capture", "--out", tmp_path / "c", "--flush-s", "1e300", "--", "true"]):
        r = cli(args)
        assert r.exit_code == 1 and ("1e300" in r.stderr or "1e+300" in r.stderr), (args, r.stderr)
        assert "This is a bug" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
