"""The CLI starts light: `kmesh-trace --help` and option parsing import none of the
heavy libraries; each is imported by the command that uses it. (The time itself is measured in
benchmarks/startup_bench.py, not here.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("numpy", "pyarrow", "polars", "duckdb", "matplotlib", "ray", "torch", "vllm", "jinja2")


def _imported_after(code: str) -> set[str]:
    probe = (f"import sys\n{code}\n"
             f"import json; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def test_the_cli_module_imports_no_heavy_library():
    assert _imported_after("import kmesh_trace.cli") == set()


def test_help_of_every_command_imports_no_heavy_library():
    code = ("import contextlib, io, typer.main, kmesh_trace.cli as c\n"
            "cmd = typer.main.get_command(c.app)\n"
            "for name in ['--help', *[[n, '--help'] for n in cmd.commands]]:\n"
            "    args = name if isinstance(name, list) else [name]\n"
            "    with contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n"
            "            cmd.main(args, standalone_mode=False)\n"
            "        except SystemExit:\n"
            "            pass\n")
    assert _imported_after(code) == set()


# ---- the lazy command tree (kmesh_trace.cli.COMMANDS) ------------------------------------------------


def test_the_root_help_is_written_without_typer_as_the_root_group_writes_it():
    """`kmesh-trace --help` and a bare `kmesh-trace` (kmesh_trace.cli.root_help) print, at every terminal width,
    what the root group prints, and load neither typer nor any other package."""
    from kmesh_trace.cli.root_help import root_help

    for columns in (20, 49, 50, 52, 60, 72, 79, 80, 81, 100, 300):
        env = {**os.environ, "COLUMNS": str(columns)}
        click = subprocess.run([sys.executable, "-c", "import sys; from kmesh_trace.cli.group import _lazy_group\n"
                                "_lazy_group().main(['--help'], prog_name='kmesh-trace')"],
                               capture_output=True, text=True, env=env)
        assert click.returncode == 0 and click.stdout == root_help(columns), columns
        for args in (["--help"], []):
            ours = subprocess.run([sys.executable, "-c", "import sys; from kmesh_trace.cli import main\n"
                                   "sys.argv[0] = 'kmesh-trace'; main()\n", *args],
                                  capture_output=True, text=True, env=env)
            assert (ours.returncode, ours.stdout, ours.stderr) == (0, click.stdout, ""), (columns, args)
    probe = ("import contextlib, io, sys\nfrom kmesh_trace.cli import main\nsys.argv = ['kmesh-trace', '--help']\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main()\n    except SystemExit:\n"
             "        pass\nprint(sorted({m.split('.')[0] for m in sys.modules} & {'typer', 'rich', *HEAVY}))")
    r = subprocess.run([sys.executable, "-c", probe.replace("HEAVY", repr(HEAVY))], capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == "[]"


def _full_group():
    import typer.main

    from kmesh_trace.cli import app

    return typer.main.get_command(app)


def test_the_command_table_is_the_commands_themselves():
    """Every command is in COMMANDS, in --help order, with its own module and its own summary line."""
    from kmesh_trace.cli import COMMANDS

    full = _full_group()
    assert [name for name, _, _ in COMMANDS] == list(full.commands)
    for name, module, summary in COMMANDS:
        command = full.commands[name]
        assert command.get_short_help_str(10_000) == summary, name
        callback = command.callback or next(iter(command.commands.values())).callback
        assert callback.__module__ == module or callback.__wrapped__.__module__ == module, name


def _help(group, args) -> tuple[str, int]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            rc = group.main(args, prog_name="kmesh-trace", standalone_mode=False)
        except SystemExit as e:
            rc = e.code
    return buf.getvalue(), rc


def test_the_lazy_tree_prints_the_help_of_the_whole_app(monkeypatch):
    """`kmesh-trace --help` and every command's --help (subcommands too) as the fully built app prints them."""
    from kmesh_trace.cli import _lazy_group

    monkeypatch.setenv("COLUMNS", "100")
    full = _full_group()
    paths = [[]] + [[n] for n in full.commands]
    paths += [[n, s] for n, c in full.commands.items() for s in getattr(c, "commands", {})]
    for path in paths:
        lazy_text = _help(_lazy_group(), [*path, "--help"])
        assert lazy_text == _help(full, [*path, "--help"]), path
        assert "Usage: kmesh-trace" in lazy_text[0], path


def test_a_command_builds_only_its_own_module():
    code = ("import contextlib, io, sys, kmesh_trace.cli as c\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        c._lazy_group().main(['headroom', '--help'], prog_name='kmesh-trace')\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('kmesh_trace.cli.')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(r.stdout.strip().splitlines()[-1]))
    assert "kmesh_trace.cli.headroom" in loaded
    assert not loaded & {"kmesh_trace.cli.core", "kmesh_trace.cli.tiers", "kmesh_trace.cli.demo", "kmesh_trace.cli.replay"}


def test_help_and_a_bad_value_import_neither_pydantic_nor_rich():
    """typer 0.29 converts values through pydantic; kmesh_trace.cli.coercion keeps the common values off it."""
    from kmesh_trace.cli import COMMANDS

    full = _full_group()
    paths = [[name] for name, _, _ in COMMANDS]
    paths += [[n, s] for n, c in full.commands.items() for s in getattr(c, "commands", {})]
    for args in (["--help"], *([*p, "--help"] for p in paths), ["headroom", "--window", "bad"],
                 ["headroom", "--processes", "0"], ["tiers", "--write", "bogus"]):
        code = ("import contextlib, io, sys, kmesh_trace.cli as c\n"
                "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
                "    try:\n"
                f"        c._lazy_group().main({args!r}, prog_name='kmesh-trace')\n"
                "    except SystemExit:\n"
                "        pass\n"
                f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY) | {'pydantic', 'pydantic_core', 'rich', 'msgspec'}}))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert r.stdout.strip().splitlines()[-1] == "[]", args


# ---- values converted without pydantic, exactly as typer converts them --------------------------------

_VALUES = ["0", "1", "-3", "+4", "007", " 5", "5 ", "12345678901234567890", "1.5", "-0.25", ".5", "1e3", "1_000",
           "nan", "inf", "", "abc", "all", "last-half", "ALL", "Last-Half", "none", "x\x1b[31m", "true", "1,2", "-",
           "/tmp/x", "~/y", "a b", "-0", "-0.0", "1.", "\u0661\u0662", "0.000000000000001", "999999999999999.5"]


def _outcome(runtime, value, param, ctx):
    from typer._click.exceptions import BadParameter

    try:
        result = runtime._coerce_value(value, param=param, ctx=ctx)
        return ("value", type(result), repr(result))
    except BadParameter as e:
        return ("refused", e.format_message())


def _as_before(parser):
    """A flag parser whose refusal is the PydanticCustomError the parsers raised before FlagRefusal (their text
    shown alone), so typer's pydantic path is the reference for our messages too."""
    from pydantic_core import PydanticCustomError

    from kmesh_trace.values import FlagRefusal

    def parse(value):
        try:
            return parser(value)
        except FlagRefusal as e:
            raise PydanticCustomError("kmesh_value", "{text}", {"text": str(e)}) from None

    return parse


def test_plain_conversion_equals_typers_on_every_parameter():
    import copy

    import typer._click as click
    from typer._coercion import build_runtime_param, resolve_type_descriptor

    from kmesh_trace.cli import coercion

    full = _full_group()
    commands = [c for c in full.commands.values() if not hasattr(c, "commands")]
    commands += [s for c in full.commands.values() for s in getattr(c, "commands", {}).values()]
    checked = 0
    for command in commands:
        ctx = click.Context(command)
        for param in command.params:
            descriptor = param.type_descriptor
            if not coercion._plain_kind(descriptor):
                continue
            plain = coercion.PlainRuntimeParam(parameter_info=descriptor.parameter_info, annotation=descriptor.annotation)
            info = copy.copy(descriptor.parameter_info)
            if info.parser is not None:
                info.parser = _as_before(info.parser)
            reference = build_runtime_param(resolve_type_descriptor(descriptor.annotation, info))
            values = [True, False] if descriptor.annotation is bool else _VALUES
            for value in values:
                assert _outcome(plain, value, param, ctx) == _outcome(reference, value, param, ctx), \
                    (command.name, param.name, value)
                checked += 1
    assert checked > 1000


def test_a_path_that_is_no_trace_is_refused_before_the_columnar_libraries_load(tmp_path):
    code = ("import contextlib, io, kmesh_trace.cli as c, typer.main\n"
            "cmd = typer.main.get_command(c.app)\n"
            f"for args in (['info', {str(tmp_path / 'missing')!r}], ['info', {str(tmp_path)!r}]):\n"
            "    with contextlib.redirect_stderr(io.StringIO()) as e:\n"
            "        try:\n"
            "            cmd.main(args, standalone_mode=False)\n"
            "        except SystemExit as x:\n"
            "            assert x.code == 1, x.code\n"
            "    assert 'Error:' in e.getvalue(), e.getvalue()\n")
    assert _imported_after(code) & {"polars", "pyarrow", "duckdb"} == set()


def test_version_prints_the_installed_version_with_and_without_typer():
    from importlib.metadata import version

    from kmesh_trace.cli import app

    expected = f"kmesh-trace {version('kmesh-trace')}\n"
    fast = subprocess.run([sys.executable, "-c", "import sys; from kmesh_trace.cli import main\n"
                           "sys.argv = ['kmesh-trace', '--version']; main()"], capture_output=True, text=True)
    assert (fast.returncode, fast.stdout, fast.stderr) == (0, expected, "")
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["--version"])  # the root group (typer), as `kmesh-trace --version info` runs
    assert (r.exit_code, r.stdout) == (0, expected)
