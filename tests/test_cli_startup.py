"""The CLI starts light: `kmesh-trace --help` loads no command module, and a command's help and option parsing
import none of the heavy libraries; each is imported by the command that uses it. (The time itself is measured
in benchmarks/startup_bench.py, not here.)"""

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


# ---- the lazy command tree (kmesh_trace.cli.group.COMMANDS) ------------------------------------------


def test_the_root_help_lists_every_command_and_a_bare_command_prints_it():
    """`kmesh-trace --help` and a bare `kmesh-trace` print the root group's help, at every terminal width, with
    every command's summary, and load none of the commands' modules nor pydantic."""
    from kmesh_trace.cli.group import COMMANDS

    for columns in (20, 50, 80, 100, 300):
        env = {**os.environ, "COLUMNS": str(columns)}
        runs = [subprocess.run([sys.executable, "-c", "import sys; from kmesh_trace.cli import main\n"
                                "sys.argv[0] = 'kmesh-trace'; main()\n", *args], capture_output=True, text=True, env=env)
                for args in (["--help"], [])]
        assert [(r.returncode, r.stdout, r.stderr) for r in runs] == [(0, runs[0].stdout, "")] * 2, columns
        assert runs[0].stdout.startswith("Usage: kmesh-trace [OPTIONS] COMMAND [ARGS]...")
        for name, _, _ in COMMANDS:
            assert f"\n  {name} " in runs[0].stdout, (columns, name)
    probe = ("import contextlib, io, sys\nfrom kmesh_trace.cli import main\nsys.argv = ['kmesh-trace', '--help']\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main()\n    except SystemExit:\n"
             "        pass\nprint(sorted({m for m in sys.modules if m.startswith('kmesh_trace.cli.')} | "
             "({m.split('.')[0] for m in sys.modules} & {'pydantic', 'rich', *HEAVY})))")
    r = subprocess.run([sys.executable, "-c", probe.replace("HEAVY", repr(HEAVY))], capture_output=True, text=True,
                       check=True)
    assert r.stdout.strip() == "['kmesh_trace.cli.group', 'kmesh_trace.cli.help_text']"


def _full_group():
    import typer.main

    from kmesh_trace.cli import app

    return typer.main.get_command(app)


def test_the_command_table_is_the_commands_themselves():
    """Every command is in COMMANDS, in --help order, with its own module and its own summary line."""
    from kmesh_trace.cli.group import COMMANDS

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


def test_help_and_a_bad_value_import_neither_rich_nor_a_heavy_library():
    """A command's --help and a refused flag value load no output layer (rich) and no analysis library."""
    from kmesh_trace.cli.group import COMMANDS

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
                f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY) | {'rich', 'msgspec'}}))\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert r.stdout.strip().splitlines()[-1] == "[]", args


def test_a_parsers_refusal_reads_as_its_sentence(cli):
    """A flag value a parser refuses: `Invalid value for '--flag': <the parser's sentence>`, control characters
    shown as escapes, exit 1, before the command runs."""
    for args, flag, sentence in (
            (["tiers", "--scenario", "fork-tree", "--gpu-blocks", "0"], "--gpu-blocks",
             "'0' is not an integer at least 1 and at most 2,147,483,647."),
            (["tiers", "--scenario", "fork-tree", "--host-gbps", "abc"], "--host-gbps",
             "'abc' is not a finite number above 0 and at most 1,000,000."),
            (["tiers", "--scenario", "fork-tree", "--children", "1\x1b[31m"], "--children",
             "'1\\x1b[31m' is not an integer.")):
        r = cli(args)
        assert r.exit_code == 1 and r.stdout == "", args
        assert r.stderr == f"Error: Invalid value for '{flag}': {sentence} (see 'kmesh-trace tiers --help')\n", args


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


def test_sql_loads_no_polars(tmp_path):
    """`sql` answers from DuckDB and Arrow batches: polars (a fifth of its start-up) is not loaded."""
    from capture_traces import write_trace

    trace = write_trace(tmp_path / "t")
    code = ("import contextlib, io, kmesh_trace.cli as c, typer.main\n"
            "cmd = typer.main.get_command(c.app)\n"
            "with contextlib.redirect_stdout(io.StringIO()) as o, contextlib.redirect_stderr(io.StringIO()):\n"
            "    try:\n"
            f"        cmd.main(['sql', {str(trace)!r}, 'select count(*) as n from block_events'], "
            "standalone_mode=False)\n"
            "    except SystemExit as x:\n"
            "        assert not x.code, x.code\n"
            "assert ' n ' in o.getvalue(), o.getvalue()\n")
    assert _imported_after(code) & {"polars", "duckdb"} == {"duckdb"}


def test_version_prints_the_installed_version():
    from importlib.metadata import version

    from kmesh_trace.cli import app

    expected = f"kmesh-trace {version('kmesh-trace')}\n"
    run = subprocess.run([sys.executable, "-c", "import sys; from kmesh_trace.cli import main\n"
                          "sys.argv = ['kmesh-trace', '--version']; main()"], capture_output=True, text=True)
    assert (run.returncode, run.stdout, run.stderr) == (0, expected, "")
    from typer.testing import CliRunner

    r = CliRunner().invoke(app, ["--version"])  # the whole app, as tests run it
    assert (r.exit_code, r.stdout) == (0, expected)
