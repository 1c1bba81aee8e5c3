"""A command's flags declared once (kmesh_trace/cli/flags.py): a flags class becomes the command's parameters,
blocks expanded in place, and the parsed values come back as one flags object."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Optional

import pytest
import typer
from typer.testing import CliRunner

from kmesh_trace.cli.flags import aliased, flags, hidden_alias, options_of, parameters, takes_flags
from kmesh_trace.errors import KmeshTraceError
from kmesh_trace.values import bounded_int


class Color(str, Enum):
    red = "red"
    blue = "blue"


CountOption = Annotated[Optional[int], typer.Option("--count", parser=bounded_int(1, 9), help="How many.")]


@flags
class Block:
    width: int = typer.Option(3, "--width", help="Width.")
    tags: list[str] = typer.Option([], "--tag", help="A tag.")


@flags
class Demo:
    name: str = typer.Argument(..., help="A name.")
    count: CountOption = None
    old_count: Optional[int] = hidden_alias(CountOption, "--old-count")
    block: Block = Block()
    color: Color = typer.Option(Color.red, "--color", help="A color.")


@dataclass
class DemoOptions:
    count: Optional[int] = None
    color: str = "red"
    width: int = 0


def test_fields_become_parameters_in_order_with_blocks_in_place():
    assert [p.name for p in parameters(Demo)] == ["name", "count", "old_count", "width", "tags", "color"]
    assert parameters(Demo)[0].default.default is ...  # a required argument stays required


def test_a_flags_object_has_the_parameters_defaults_and_its_own_lists():
    a, b = Demo(name="x"), Demo(name="y")
    assert (a.count, a.block.width, a.color) == (None, 3, Color.red)
    assert a.block.tags == [] and a.block.tags is not b.block.tags
    with pytest.raises(Exception):
        a.count = 2  # frozen


def _app():
    seen = []

    @takes_flags
    def demo(f: Demo) -> None:
        seen.append(f)

    app = typer.Typer()
    app.command()(demo)
    app.command("other")(lambda: None)
    return app, seen


def test_the_command_parses_into_one_flags_object():
    app, seen = _app()
    r = CliRunner().invoke(app, ["demo", "n", "--count", "4", "--width", "7", "--tag", "a", "--tag", "b", "--color", "blue"])
    assert r.exit_code == 0, r.output
    assert seen == [Demo(name="n", count=4, block=Block(width=7, tags=["a", "b"]), color=Color.blue)]
    assert "--old-count" not in CliRunner().invoke(app, ["demo", "--help"]).output


def test_a_hidden_alias_parses_alike_and_is_merged_once():
    app, seen = _app()
    assert CliRunner().invoke(app, ["demo", "n", "--old-count", "5"]).exit_code == 0
    assert aliased(seen[0].count, "--count", seen[0].old_count, "--old-count") == (5, "--old-count")
    assert CliRunner().invoke(app, ["demo", "n", "--old-count", "10"]).exit_code != 0  # the same parser
    assert aliased(2, "--count", None, "--old-count") == (2, "--count")
    with pytest.raises(KmeshTraceError, match=r"give --count once \(--old-count is its old name\)"):
        aliased(2, "--count", 2, "--old-count")


def test_options_of_copies_the_fields_of_the_same_name():
    f = Demo(name="n", count=2, color=Color.blue)
    assert options_of(DemoOptions, f, width=9) == DemoOptions(count=2, color="blue", width=9)


def test_a_command_without_a_flags_class_is_refused():
    def plain(x: int) -> None:
        pass

    with pytest.raises(TypeError):
        takes_flags(plain)
